"""Our downstream scores equal lm-eval-harness's on the same model, rows and prompts (its tasks pointed at local files).

The model runs in float64 in both harnesses, so the per-example log-likelihoods agree to ~1e-12 and any
difference of tokens, positions, truncation or prompt shows as a gap far above the 1e-4 tolerance (in fp32 the
two sum ~100 log-probabilities in different orders and differ by up to ~1e-4 on long HellaSwag endings).
"""

import json
import os
from pathlib import Path

import pytest
import torch

from hf_pretrain.evaluation.downstream import DownstreamEvaluator, data_root
from tests.evaluation.downstream_models import bpe_tokenizer, tiny_model

try:
    import lm_eval
except ImportError:  # the [test] extra installs it: a missing one fails every test here, unless allowed
    lm_eval = None

ALLOW_NO_LM_EVAL = "HF_PRETRAIN_ALLOW_NO_LM_EVAL"


@pytest.fixture(autouse=True)
def needs_lm_eval() -> None:
    """Fail (not skip) without lm-eval, so a broken install cannot pass the agreement silently; skip only when
    HF_PRETRAIN_ALLOW_NO_LM_EVAL=1 says its absence is intended."""
    if lm_eval is not None:
        return
    if os.environ.get(ALLOW_NO_LM_EVAL) == "1":
        pytest.skip(f"lm-eval is not installed and {ALLOW_NO_LM_EVAL}=1")
    pytest.fail(
        "lm-eval is not installed: it is in the [test] extra (pip install -e '.[test]', make venv does it); "
        f"set {ALLOW_NO_LM_EVAL}=1 to skip these tests on purpose.",
        pytrace=False,
    )


# our task -> (lm-eval's task config, how a row of our data becomes a row of the dataset lm-eval's config reads)
LM_EVAL_TASKS = {
    "hellaswag": ("hellaswag/hellaswag.yaml", None),
    "arc_easy": ("arc/arc_easy.yaml", None),
    "arc_challenge": ("arc/arc_challenge.yaml", None),
    "piqa": ("piqa/piqa.yaml", None),
    "winogrande": ("winogrande/default.yaml", None),
    "openbookqa": ("openbookqa/openbookqa.yaml", None),
    "boolq": ("super_glue/boolq/default.yaml", lambda row: {**row, "label": int(row["answer"])}),  # aps/super_glue
    "sciq": ("sciq/sciq.yaml", None),
    "copa": ("super_glue/copa/default.yaml", None),
    "commonsense_qa": ("commonsense_qa/default.yaml", None),
    "social_iqa": ("siqa/siqa.yaml", None),
}


def crafted_tokenizer():
    """A BPE whose merges cross the context / continuation boundary ("b" + "c"): the continuation's tokens must be
    those of the whole text past the context's, not the continuation encoded alone."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<|eos|>": 0, "a": 1, "b": 2, "c": 3, "d": 4, " ": 5, "bc": 6, "cd": 7}
    bpe = models.BPE(vocab=vocab, merges=[("b", "c"), ("c", "d")])
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(bpe), eos_token="<|eos|>")


@pytest.mark.parametrize("kind", ["bpe", "bpe_with_bos", "merges_across_the_boundary"])
def test_tokens_equal_lm_eval_encode_pair(kind):
    """Every request of every task is split into context / continuation tokens as lm-eval's HFLM splits it."""
    from lm_eval.models.huggingface import HFLM

    from hf_pretrain.evaluation.downstream.requests import Encoder, Request, requests_of
    from hf_pretrain.evaluation.downstream.tasks import TASKS, build_examples

    if kind == "merges_across_the_boundary":
        tokenizer = crafted_tokenizer()
        requests = [Request("t", 0, 0, c, k) for c, k in (("ab", "cd"), ("ab ", "cd"), ("a", "bcd"), ("abc", "d"))]
    else:
        tokenizer = bpe_tokenizer(bos=kind == "bpe_with_bos")
        requests = [
            r for t in TASKS.values() for r in requests_of(t.name, build_examples(t, limit=3, shots=1).examples)
        ]
    lm = HFLM(pretrained=tiny_model(), tokenizer=tokenizer, batch_size=1, device="cpu")
    ours = Encoder(tokenizer).encode(requests)
    for request, encoded in zip(requests, ours):
        assert (encoded.context_ids, encoded.continuation_ids) == tuple(
            lm._encode_pair(request.context, request.continuation)
        )
    if kind == "merges_across_the_boundary":
        assert ours[0].continuation_ids == [4] != tokenizer("cd")["input_ids"]  # "b"+"c" merged: only "d" is left


def run_lm_eval(model, tokenizer, evaluator: DownstreamEvaluator, folder: Path) -> dict:
    """lm-eval on the evaluator's rows (and its shots, as a train split read by the `first_n` sampler)."""
    from lm_eval.evaluator import evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    configs = Path(lm_eval.__file__).parent / "tasks"
    root = data_root()
    for s in evaluator.sets:
        config, convert = LM_EVAL_TASKS[s.task.name]
        rows = s.task.rows(root)
        splits = {"validation": s.indices, **({"train": s.shot_indices} if s.shots else {})}
        files = ""
        for split, indices in splits.items():
            path = folder / f"{s.task.name}-{split}.jsonl"
            path.write_text("".join(json.dumps((convert or dict)(rows[i])) + "\n" for i in indices))
            files += f"    {split}: {path}\n"
        shots = "training_split: train\nfewshot_split: train\nfewshot_config:\n  sampler: first_n\n"
        (folder / f"{s.task.name}_local.yaml").write_text(
            f"include: {configs / config}\ntask: {s.task.name}_local\ndataset_path: json\ndataset_name: null\n"
            f"dataset_kwargs:\n  data_files:\n{files}{shots if s.shots else 'training_split: null' + chr(10)}"
            "test_split: null\nvalidation_split: validation\n"
        )
    manager = TaskManager(include_path=str(folder), include_defaults=False)
    tasks = manager.load([f"{s.task.name}_local" for s in evaluator.sets])
    for task in tasks["tasks"].values():
        task.set_config(key="num_fewshot", value=evaluator.shots)
    lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=16, device="cpu")
    return evaluate(lm, tasks, bootstrap_iters=0, log_samples=True, verbosity="ERROR")


def assert_same_scores(ours, theirs, evaluator):
    for s in evaluator.sets:
        name = s.task.name
        samples = theirs["samples"][f"{name}_local"]
        figures = theirs["results"][f"{name}_local"]
        norm = s.task.primary == "acc_norm" or "acc_norm,none" in figures  # our primary figure is always compared
        assert not norm or "acc_norm,none" in figures, f"{name}: lm-eval reported no acc_norm, our primary figure"
        assert len(samples) == len(s.examples)
        for sample in samples:
            expected = [resp[0][0] for resp in sample["resps"]]
            got = ours.examples[name][sample["doc_id"]]
            assert got.loglikelihoods == pytest.approx(expected, abs=1e-4, rel=0), (name, sample["doc_id"])
            assert got.acc == sample["acc"], (name, sample["doc_id"])
            if norm:
                assert got.acc_norm == sample["acc_norm"], (name, sample["doc_id"])
        assert ours.tasks[name]["acc"] == figures["acc,none"], name
        if norm:
            assert ours.tasks[name]["acc_norm"] == figures["acc_norm,none"], name


@pytest.fixture
def no_network(monkeypatch):
    """Every socket call fails: neither harness may reach for the network."""
    import socket

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args[:2]}")

    for target, name in ((socket, "getaddrinfo"), (socket, "create_connection"), (socket.socket, "connect")):
        monkeypatch.setattr(target, name, refuse)


def test_hellaswag_arc_easy_piqa_equal_lm_eval(tmp_path, no_network):
    """The project's own tokenizer (no BOS), 192 positions: HellaSwag's long rows are left-truncated in both."""
    tokenizer, model = bpe_tokenizer(), tiny_model(max_positions=192, dtype=torch.float64)
    evaluator = DownstreamEvaluator(tokenizer, ["hellaswag", "arc_easy", "piqa"], limit=20, seed=7)
    ours = evaluator.evaluate(model, keep_examples=True)
    assert evaluator.truncated > 0 and not evaluator.skipped  # truncation is compared (a skip would stop lm-eval)
    assert_same_scores(ours, run_lm_eval(model, tokenizer, evaluator, tmp_path), evaluator)


@pytest.mark.exhaustive
def test_few_shot_with_a_bos_tokenizer_equals_lm_eval(tmp_path):
    tokenizer, model = bpe_tokenizer(bos=True), tiny_model(max_positions=256, dtype=torch.float64)
    evaluator = DownstreamEvaluator(tokenizer, ["hellaswag", "arc_easy", "piqa"], limit=10, shots=2, seed=3)
    ours = evaluator.evaluate(model, keep_examples=True)
    assert_same_scores(ours, run_lm_eval(model, tokenizer, evaluator, tmp_path), evaluator)


@pytest.mark.exhaustive
def test_every_other_task_equals_lm_eval(tmp_path):
    names = [n for n in LM_EVAL_TASKS if n not in ("hellaswag", "arc_easy", "piqa")]
    tokenizer, model = bpe_tokenizer(), tiny_model(max_positions=512, dtype=torch.float64)
    evaluator = DownstreamEvaluator(tokenizer, names, limit=10, seed=5)
    ours = evaluator.evaluate(model, keep_examples=True)
    assert_same_scores(ours, run_lm_eval(model, tokenizer, evaluator, tmp_path), evaluator)
