"""The loss without the full logits (`modeling/loss.py`) against transformers' unfused path: same loss,
same gradients, no [tokens, vocab] tensor, logits whenever they are asked for, and the Trainer on top."""

import copy
import json

import pytest
import torch
from datasets import Dataset
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers import LlamaForCausalLM, default_data_collator

from hf_pretrain import PretrainForCausalLM, PretrainTrainer
from hf_pretrain.data.collator import PackedDocumentCollator
from hf_pretrain.modeling import loss as fused_loss
from hf_pretrain.modeling.export import export_hf
from tests.conftest import quick_args, small_config

EOS = 1
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    """8 tokens per chunk at the test vocabulary of 128, so every batch here spans several chunks."""
    monkeypatch.setattr(fused_loss, "CHUNK_LOGITS", 8 * 128)
    monkeypatch.setattr(fused_loss, "MIN_CHUNK_ROWS", 1)
    monkeypatch.setattr(fused_loss, "GEMM_ROWS", 1)


def twins(**overrides) -> tuple[PretrainForCausalLM, PretrainForCausalLM]:
    """The same weights twice, in training mode: the default (chunked loss) and the unfused path."""
    torch.manual_seed(0)
    fused = PretrainForCausalLM(small_config(**overrides)).train()
    plain = copy.deepcopy(fused)
    plain.config.chunked_loss = False
    return fused, plain


def assert_same_gradients(fused: nn.Module, plain: nn.Module) -> None:
    for (name, a), b in zip(fused.named_parameters(), plain.parameters(), strict=True):
        assert a.grad is not None and b.grad is not None, name
        scale = b.grad.abs().max().item()
        assert scale > 0, name  # every parameter gets a gradient: the comparison below is not vacuous
        assert (a.grad - b.grad).abs().max().item() <= 1e-5 * scale, name


def assert_same_step(fused, plain, **batch) -> None:
    ours, theirs = fused(**batch), plain(**batch)
    assert ours.logits is None and theirs.logits is not None  # the chunked path really ran
    assert ours.loss.item() == pytest.approx(theirs.loss.item(), rel=1e-5)
    ours.loss.backward()
    theirs.loss.backward()
    assert_same_gradients(fused, plain)


def labels_with_ignored(ids: torch.Tensor) -> torch.Tensor:
    labels = ids.clone()
    labels[:, :5] = -100  # e.g. a prompt
    labels[1, 20:] = -100  # e.g. padding
    return labels


def test_ignored_labels_same_loss_and_gradients():
    fused, plain = twins()
    ids = torch.randint(0, 128, (2, 48))
    assert fused_loss.chunk_rows(128, ids.numel()) == 8  # 12 chunks
    assert_same_step(fused, plain, input_ids=ids, labels=labels_with_ignored(ids))


def packed_batch():
    g = torch.Generator().manual_seed(3)
    rows = [[9, 17, 22], [30, 18], [11, 12, 25]]
    docs = [[torch.randint(2, 128, (n - 1,), generator=g).tolist() + [EOS] for n in row] for row in rows]
    batch = PackedDocumentCollator(EOS)([{"input_ids": [t for d in row for t in d]} for row in docs])
    assert (batch["labels"] == -100).sum() > 0 and "position_ids" in batch  # cross-document targets ignored
    return batch


@pytest.mark.parametrize(
    "overrides",
    [dict(window_pattern="SSSL", sliding_window=5), dict(window_pattern="SL", sliding_window=5, **MOE)],
    ids=["windows", "windows+moe"],
)
def test_packed_documents_with_windows_and_moe_same_loss_and_gradients(overrides):
    fused, plain = twins(**overrides)
    assert_same_step(fused, plain, **packed_batch())


def test_token_normalised_gradient_accumulation_matches_the_whole_batch():
    """Two micro-batches with the Trainer's `num_items_in_batch` (the valid targets of both): the same loss and
    gradients on both paths (MoE), and, dense, the loss and gradients of the unfused path on one batch of both."""
    ids = torch.randint(0, 128, (4, 40))
    labels = labels_with_ignored(ids)
    labels[2, 30:] = -100  # the micro-batches hold different numbers of targets
    total = (labels[:, 1:] != -100).sum()

    def accumulate(model) -> float:
        summed = 0.0
        for half in (slice(0, 2), slice(2, 4)):
            out = model(input_ids=ids[half], labels=labels[half], num_items_in_batch=total)
            out.loss.backward()
            summed += out.loss.item()
        return summed

    fused, plain = twins(**MOE)
    assert accumulate(fused) == pytest.approx(accumulate(plain), rel=1e-5)
    assert_same_gradients(fused, plain)
    # MoE aux losses are weighted per micro-batch, so the whole-batch equality is checked on a dense model
    dense, whole = twins()
    one = whole(input_ids=ids, labels=labels)
    one.loss.backward()
    assert accumulate(dense) == pytest.approx(one.loss.item(), rel=1e-5)
    assert_same_gradients(dense, whole)


class LargestTensor(TorchDispatchMode):
    """The element count of the largest tensor any dispatched operation produces (forward and backward).

    The chunked op is one operation here: its inner chunks (`chunk_rows` x vocab) are torch's; what the whole
    process holds is measured by benchmarks/chunked_ce.py."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        sizes = [t.numel() for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        self.largest = max([self.largest, *sizes])
        return out


def test_no_tensor_of_tokens_by_vocab_in_forward_or_backward():
    vocab, batch, seq = 1024, 4, 64
    fused, plain = twins(vocab_size=vocab)
    ids = torch.randint(0, vocab, (batch, seq))
    seen = {}
    for name, model in (("fused", fused), ("plain", plain)):
        with LargestTensor() as mode:
            model(input_ids=ids, labels=ids).loss.backward()
        seen[name] = mode.largest
    tokens_by_vocab = batch * seq * vocab
    assert seen["plain"] >= tokens_by_vocab  # the probe sees the unfused logits...
    assert seen["fused"] < tokens_by_vocab / 2, seen  # ...and nothing of that size on the chunked path
    assert_same_gradients(fused, plain)


def test_logits_whenever_asked_for():
    fused, _ = twins()
    ids = torch.randint(0, 128, (2, 24))
    trained = fused(input_ids=ids, labels=ids)
    assert trained.logits is None and trained.loss.requires_grad
    asked = fused(input_ids=ids, labels=ids, skip_logits=False)
    assert asked.logits.shape == (2, 24, 128) and asked.loss.item() == pytest.approx(trained.loss.item(), rel=1e-5)
    assert fused(input_ids=ids).logits.shape == (2, 24, 128)  # no labels: logits
    assert fused(input_ids=ids, logits_to_keep=1).logits.shape == (2, 1, 128)  # generation
    fused.eval()
    with torch.no_grad():
        evaluated = fused(input_ids=ids, labels=ids)
        assert evaluated.logits.shape == (2, 24, 128)  # evaluation and predict(): logits, as before
        assert evaluated.loss.item() == pytest.approx(trained.loss.item(), rel=1e-5)
        lean = fused(input_ids=ids, labels=ids, skip_logits=True)  # a loss-only evaluation without logits
        assert lean.logits is None and lean.loss.item() == pytest.approx(trained.loss.item(), rel=1e-5)
    with pytest.raises(ValueError, match="skip_logits=True"):
        fused(input_ids=ids, skip_logits=True)


def test_falls_back_to_the_full_logits_when_the_head_or_loss_is_not_the_plain_one():
    fused, plain = twins()
    ids = torch.randint(0, 128, (2, 24))
    assert fused._fused_loss_unavailable() is None
    calls = []
    handle = fused.lm_head.register_forward_hook(lambda module, args, out: calls.append(out.shape))
    assert "hooks" in fused._fused_loss_unavailable()
    out = fused(input_ids=ids, labels=ids)
    assert out.logits is not None and calls == [(2, 24, 128)]  # the hook saw the head run
    handle.remove()
    fused.lm_head = nn.Sequential(fused.lm_head)  # e.g. a PEFT / FSDP wrapper
    assert "Sequential" in fused._fused_loss_unavailable()
    torch.testing.assert_close(fused(input_ids=ids, labels=ids).loss, plain(input_ids=ids, labels=ids).loss)
    fused.lm_head = fused.lm_head[0]

    def halved(logits, labels, vocab_size, **kwargs):
        return plain.loss_function(logits, labels, vocab_size, **kwargs) / 2

    fused.loss_function = halved  # a custom loss_function is honoured
    assert "halved" in fused._fused_loss_unavailable()
    assert fused(input_ids=ids, labels=ids).loss.item() == pytest.approx(
        plain(input_ids=ids, labels=ids).loss.item() / 2
    )


def test_config_flag_validated_saved_and_left_out_of_the_export(tmp_path):
    with pytest.raises(ValueError, match="chunked_loss"):
        small_config(chunked_loss="yes")
    fused, _ = twins()
    fused.config.chunked_loss = False
    fused.save_pretrained(tmp_path / "ours")
    assert PretrainForCausalLM.from_pretrained(tmp_path / "ours").config.chunked_loss is False
    export_hf(fused, tmp_path / "llama")
    assert "chunked_loss" not in json.loads((tmp_path / "llama" / "config.json").read_text())
    llama = LlamaForCausalLM.from_pretrained(tmp_path / "llama").eval()
    ids = torch.randint(0, 128, (2, 24))
    with torch.no_grad():
        assert (fused.eval()(ids).logits - llama(ids).logits).abs().max().item() <= 1e-5


def test_chunks_are_whole_gemm_tiles_of_at_least_512_rows(monkeypatch):
    """At a 128k vocabulary 64 MiB of logits is 130 rows: GEMMs of one full and one 2 %-used tile. The rule keeps
    chunks at >= 512 rows in multiples of 128 (the module docstring says why), and never more than the tokens."""
    monkeypatch.undo()  # the module's own constants, not the small chunks of this file
    for vocab in (32_000, 32_768, 50_304, 128_256, 262_144):
        rows = fused_loss.chunk_rows(vocab, 16_384)
        assert rows >= 512 and rows % 128 == 0 and rows * vocab <= max(fused_loss.CHUNK_LOGITS, 512 * vocab), vocab
    assert fused_loss.chunk_rows(128_256, 16_384) == 512 and fused_loss.chunk_rows(4096, 16_384) == 4096
    assert fused_loss.chunk_rows(128_256, 300) == 300  # fewer tokens than a chunk: one chunk of all of them


def test_liger_sums_the_head_weight_gradient_in_fp32(monkeypatch):
    """Liger-Kernel runs on CUDA only; its documented `accum_dtype` is what hf_pretrain must pass (by default it
    accumulates in the weight's dtype: bf16 under autocast). A stand-in records the construction."""
    made = []

    class Recorder(nn.Module):
        def __init__(self, **kwargs):
            super().__init__()
            made.append(kwargs)

        def forward(self, weight, hidden, targets):
            return nn.functional.cross_entropy(hidden @ weight.T, targets, reduction="sum", ignore_index=-100)

    monkeypatch.setattr(fused_loss, "liger_loss_class", lambda: Recorder)
    monkeypatch.setattr(fused_loss, "implementation", lambda device: "liger")
    hidden, weight = torch.randn(6, 8), torch.randn(16, 8)
    fused_loss.summed_cross_entropy(hidden, weight, torch.randint(0, 16, (6,)), -100)
    assert made == [{"ignore_index": -100, "reduction": "sum", "accum_dtype": torch.float32}]


def test_torch_op_bf16_head_gradient_error_is_within_the_summation_bound(monkeypatch):
    """torch's op sums the chunks' weight gradients in the input dtype. In bf16 (unit roundoff u = 2**-8) the
        k chunks' sum, rounded after each addition, differs from the exact sum by at most u x the sum of the
        partial sums' magnitudes (recursive summation, Higham 2002, section 4.2): checked element by element
        against the exact (fp64) per-chunk gradients of the same bf16 inputs. The bound grows with k, which the chunk
    size keeps small (`chunk_rows`); Liger's path sums in fp32 instead (the test above)."""
    vocab, hidden_size, tokens, rows = 256, 32, 1024, 64
    monkeypatch.setattr(fused_loss, "CHUNK_LOGITS", rows * vocab)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, hidden_size, generator=g).bfloat16().requires_grad_()
    weight = (0.1 * torch.randn(vocab, hidden_size, generator=g)).bfloat16().requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), generator=g)
    targets[::7] = -100
    fused_loss.summed_cross_entropy(hidden, weight, targets, -100).backward()
    assert weight.grad.dtype == torch.bfloat16

    h, w = hidden.detach().double(), weight.detach().double()
    probabilities = (h @ w.T).softmax(-1)
    valid = targets != -100
    probabilities[valid, targets[valid]] -= 1
    probabilities[~valid] = 0
    chunks = [probabilities[i : i + rows].T @ h[i : i + rows] for i in range(0, tokens, rows)]
    partial = torch.stack(chunks).cumsum(0)
    exact = partial[-1]
    bound = 2**-8 * partial.abs().sum(0) + 2**-20 * torch.stack(chunks).abs().sum(0)  # + the fp32 chunk GEMMs
    error = (weight.grad.double() - exact).abs()
    assert len(chunks) == 16 and (error <= bound).all(), (error - bound).max()
    assert (error > 2**-8 * exact.abs()).any()  # more than one rounding's error somewhere: the bound is not idle


def test_estimate_and_model_both_fall_back_where_no_chunked_op_runs(monkeypatch):
    """Torch 2.11 (the GPU machine's) has no linear_cross_entropy and Liger is absent there: the model computes
    the full logits, and the memory estimate prices them (it priced the chunked loss, ~7 % low at 1.4B)."""
    from hf_pretrain.distributed.memory import estimate_memory

    chunked = estimate_memory(small_config(), 0, 1, "bf16", 64, 2)
    monkeypatch.setattr(fused_loss, "torch_has_chunked_cross_entropy", lambda: False)
    assert fused_loss.liger_loss_class() is None  # (not installed here)
    fused, _ = twins()
    ids = torch.randint(0, 128, (2, 24))
    assert "no chunked linear_cross_entropy" in fused._fused_loss_unavailable()
    assert fused(input_ids=ids, labels=ids).logits is not None  # the full logits, with a warning
    full = estimate_memory(small_config(), 0, 1, "bf16", 64, 2)
    assert chunked.chunked_loss and not full.chunked_loss
    assert full.logits == 12 * 2 * 64 * 128 != chunked.logits
    assert any("full logits are priced" in note for note in full.notes)


def dataset(n=16, seq=32) -> Dataset:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(2, 128, (n, seq), generator=g)
    labels = ids.clone()
    for i in range(n):
        labels[i, seq - 3 * (i % 5) :] = -100  # a different number of targets per sample
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.tolist()})


def train(tmp_path, chunked: bool) -> tuple[list[float], PretrainForCausalLM, dict]:
    torch.manual_seed(0)
    model = PretrainForCausalLM(small_config(chunked_loss=chunked, num_hidden_layers=2))
    args = quick_args(
        tmp_path,
        max_steps=3,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,  # the Trainer passes num_items_in_batch
        learning_rate=3e-3,
        seed=0,
        measure_peak_tflops=False,
        telemetry=False,
        per_device_eval_batch_size=4,
    )
    data = dataset()
    trainer = PretrainTrainer(
        model=model, args=args, train_dataset=data, eval_dataset=data, data_collator=default_data_collator
    )
    trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    metrics = trainer.evaluate()
    predicted = trainer.predict(data.select(range(4)))
    return losses, model, {**metrics, "predicted_loss": predicted.metrics["test_loss"]}


def test_trainer_with_accumulation_trains_evaluates_and_predicts_alike(tmp_path):
    losses, model, metrics = train(tmp_path / "fused", chunked=True)
    plain_losses, plain_model, plain_metrics = train(tmp_path / "plain", chunked=False)
    assert len(losses) == 3 and losses == pytest.approx(plain_losses, rel=1e-5)
    for a, b in zip(model.parameters(), plain_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    for key in ("eval_loss", "eval_perplexity", "eval_next_token_accuracy", "predicted_loss"):
        assert metrics[key] == pytest.approx(plain_metrics[key], rel=1e-5), key


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="Liger-Kernel's fused linear cross-entropy needs CUDA")
@pytest.mark.skipif(fused_loss.liger_loss_class() is None, reason="liger-kernel not installed (pip install .[liger])")
def test_liger_on_cuda_gives_the_unfused_loss_and_gradients():
    fused, plain = twins(vocab_size=4096)
    fused.cuda()
    plain.cuda()
    assert fused_loss.implementation(torch.device("cuda")) == "liger"
    ids = torch.randint(0, 4096, (4, 256), device="cuda")
    assert_same_step(fused, plain, input_ids=ids, labels=labels_with_ignored(ids))
