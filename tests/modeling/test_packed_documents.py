"""A packed row gives every document the logits it gets alone, on every backend that runs here."""

import pytest
import torch

from hf_pretrain import PretrainForCausalLM
from hf_pretrain.data.collator import PackedDocumentCollator, document_position_ids
from tests.conftest import small_config

EOS = 1
CPU_BACKENDS = ["sdpa", "eager", "flex_attention"]  # flex runs on CPU for inference (no backward there)
GPU_BACKENDS = ["flash_attention_3", "flash_attention_2", "flex_attention"]


def documents(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(2, 128, (n - 1,), generator=g).tolist() + [EOS] for n in lengths]
    return docs, [tok for doc in docs for tok in doc]


def test_position_ids_restart_after_every_eos():
    ids = torch.tensor([[5, 6, EOS, 7, EOS, 8, 9, 10], [EOS, 2, 3, 4, 5, EOS, EOS, 6]])
    assert document_position_ids(ids, EOS).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2], [0, 0, 1, 2, 3, 4, 0, 0]]


def test_collator_masks_only_cross_document_predictions():
    batch = PackedDocumentCollator(EOS)([{"input_ids": [5, 6, EOS, 7, 8, EOS, 9, 3]}])
    assert set(batch) == {"input_ids", "position_ids", "labels"}  # no attention_mask: it would hide the packing
    assert batch["labels"].tolist() == [[5, 6, EOS, -100, 8, EOS, -100, 3]]
    plain = PackedDocumentCollator(EOS, separate_documents=False)([{"input_ids": [5, 6, EOS, 7]}])
    assert set(plain) == {"input_ids", "labels"} and plain["labels"].tolist() == [[5, 6, EOS, 7]]
    with pytest.raises(ValueError, match="eos_token_id is None"):
        PackedDocumentCollator(None)


ROWS = ((9, 17, 4, 30), (25, 3, 32), (60,))  # different boundaries in each row of one batch


def reference_model(window_pattern, backend="eager", device="cpu", dtype=torch.float32):
    torch.manual_seed(0)
    config = small_config(window_pattern=window_pattern, sliding_window=5, attention_backend=backend)
    return PretrainForCausalLM(config).to(device=device, dtype=dtype).eval()


def check_packed_equals_alone(backend, device, dtype, tol, window_pattern):
    """Packed rows on `backend` against each document alone on the fp32 eager reference (same weights)."""
    model = reference_model(window_pattern, backend, device, dtype)
    reference = reference_model(window_pattern)
    rows = [documents(lengths, seed=i) for i, lengths in enumerate(ROWS)]
    batch = PackedDocumentCollator(EOS)([{"input_ids": row} for _, row in rows])
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"].to(device), position_ids=batch["position_ids"].to(device)).logits
        for r, (docs, _) in enumerate(rows):
            start = 0
            for doc in docs:
                alone = reference(input_ids=torch.tensor([doc])).logits[0]
                diff = (packed[r, start : start + len(doc)].float().cpu() - alone).abs().max().item()
                assert diff <= tol, (backend, window_pattern, r, len(doc), diff)
                start += len(doc)
        if backend == "flex_attention" and device == "cpu":
            return  # the crossing check below costs flex one more compile (14 s here); sdpa and eager make it
        # The boundaries matter: without restarting positions the later documents see the earlier ones.
        crossing = model(input_ids=batch["input_ids"].to(device)).logits
        assert (crossing[0, len(rows[0][0][0]) :] - packed[0, len(rows[0][0][0]) :]).abs().max().item() > 1e-3


@pytest.mark.parametrize(
    "backend,window_pattern",
    [
        # flex on CPU is slow (compiled for each shape): its SSSL case covers full and windowed layers alike
        pytest.param(b, p, id=f"{b}-{p}", marks=[pytest.mark.exhaustive] if (b, p) == ("flex_attention", "L") else [])
        for b in CPU_BACKENDS
        for p in ("L", "SSSL")
    ],
)
def test_packed_rows_match_documents_alone_on_cpu(backend, window_pattern):
    check_packed_equals_alone(backend, "cpu", torch.float32, 1e-5, window_pattern)


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (FlashAttention 2/3 and flex training are GPU-only)"
)
@pytest.mark.parametrize("window_pattern", ["L", "SSSL"])
@pytest.mark.parametrize("backend", GPU_BACKENDS)
def test_packed_rows_match_documents_alone_on_gpu(backend, window_pattern):
    from hf_pretrain.modeling.attention import Environment, LayerNeed, unavailable_reason

    env = Environment.detect("cuda", torch.bfloat16, training=False)
    why_not = unavailable_reason(backend, LayerNeed("full_attention", None, True), env, requested=True)
    if why_not:
        pytest.skip(f"{backend}: {why_not}")
    check_packed_equals_alone(backend, "cuda", torch.bfloat16, 5e-2, window_pattern)
