"""Local `evaluate` metrics (no network), per-batch reduction, and what `Trainer.evaluate()` keeps with them."""

import math
import socket

import evaluate
import numpy as np
import pytest
import torch
from datasets import Dataset
from transformers import EvalPrediction

from hf_pretrain import PretrainForCausalLM, PretrainingArguments, PretrainTrainer
from hf_pretrain.data.collator import PackedDocumentCollator
from hf_pretrain.evaluation import (
    METRICS,
    CausalLMMetrics,
    compute_metrics,
    load_metric,
    metric_path,
    preprocess_logits_for_metrics,
    token_statistics,
)
from tests.conftest import quick_args, small_config


@pytest.fixture
def no_network(monkeypatch):
    """Any attempt to resolve or connect fails loudly (an air-gapped node)."""

    def refuse(*args, **kwargs):
        raise AssertionError(f"network access attempted: {args[:2]}")

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket.socket, "connect", refuse)


@pytest.mark.parametrize("name", METRICS)
def test_shipped_metrics_load_from_their_local_path_without_network(name, no_network):
    folder = metric_path(name)
    for path in (folder, f"{folder}/{name}.py"):  # the folder, or the script itself
        metric = evaluate.load(path)
        assert isinstance(metric, evaluate.Metric)
        assert metric.name == name
        assert metric.description and metric.citation and metric.inputs_description
        assert "token_count" in metric.features
    assert isinstance(load_metric(name), evaluate.Metric)
    with pytest.raises(ValueError, match="Unknown hf_pretrain metric"):
        metric_path("accuracy")


def test_metric_values_by_hand(no_network):
    perplexity = load_metric("perplexity")
    perplexity.add_batch(nll_sum=[6.0, 1.5], token_count=[3, 1])
    perplexity.add_batch(nll_sum=[0.5], token_count=[2])
    result = perplexity.compute()
    assert result["token_count"] == 6
    assert result["nll_per_token"] == pytest.approx(8.0 / 6)
    assert result["perplexity"] == pytest.approx(math.exp(8.0 / 6))

    accuracy = load_metric("next_token_accuracy")
    accuracy.add_batch(correct=[3, 0], token_count=[4, 4])
    accuracy.add_batch(correct=[2], token_count=[2])
    assert accuracy.compute() == {"next_token_accuracy": 0.5, "token_count": 10}

    empty = load_metric("perplexity").compute(nll_sum=[0.0], token_count=[0])
    assert math.isnan(empty["perplexity"]) and empty["token_count"] == 0
    with pytest.raises(ValueError, match="correct <= token_count"):
        load_metric("next_token_accuracy").compute(correct=[5], token_count=[4])


def test_token_statistics_by_hand():
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 5, 7, generator=g)
    labels = torch.randint(0, 7, (2, 5), generator=g)
    labels[0, 3] = -100  # ignored target
    labels[1, 0] = -100  # position 0 is never a target anyway
    expected = np.zeros((2, 3))
    for b in range(2):
        for t in range(4):  # logits at t predict the label at t + 1
            target = int(labels[b, t + 1])
            if target == -100:
                continue
            log_probs = torch.log_softmax(logits[b, t].double(), dim=-1)
            expected[b] += (-float(log_probs[target]), float(int(logits[b, t].argmax()) == target), 1.0)
    stats = token_statistics(logits, labels)
    assert stats.shape == (2, 3) and stats.dtype == torch.float32
    np.testing.assert_allclose(stats.numpy(), expected, rtol=1e-6)
    assert expected[:, 2].tolist() == [3.0, 4.0]
    # chunked (one position at a time) and from a tuple of outputs: the same numbers
    np.testing.assert_allclose(token_statistics(logits, labels, chunk_elements=1).numpy(), expected, rtol=1e-6)
    np.testing.assert_allclose(preprocess_logits_for_metrics((logits, None), labels).numpy(), expected, rtol=1e-6)
    # bf16 logits are scored in fp32: equal to scoring their fp32 values
    half = logits.bfloat16()
    np.testing.assert_allclose(token_statistics(half, labels).numpy(), token_statistics(half.float(), labels).numpy())
    with pytest.raises(ValueError, match="unshifted"):
        token_statistics(logits, labels[:, 1:])


def test_packed_rows_score_no_prediction_across_a_document_boundary():
    eos = 1
    rows = [[5, 6, 7, eos, 8, 9, eos, 10], [5, 6, eos, 7, 8, 9, 10, 11]]
    batch = PackedDocumentCollator(eos_token_id=eos)([{"input_ids": r} for r in rows])
    logits = torch.zeros(2, 8, 16)
    stats = token_statistics(logits, batch["labels"])
    # 7 targets per row, minus the first token of each later document (8 after the first EOS, 10 after the second)
    assert stats[:, 2].tolist() == [5.0, 6.0]
    assert torch.allclose(stats[:, 0], stats[:, 2] * math.log(16))  # uniform logits: log(vocab) per token


def test_compute_metrics_from_an_eval_prediction_and_a_clear_error_without_reduction():
    rows = np.array([[6.0, 2.0, 3.0], [2.0, 1.0, 1.0]])
    result = compute_metrics(EvalPrediction(predictions=rows, label_ids=None))
    assert result == {"perplexity": pytest.approx(math.exp(2.0)), "next_token_accuracy": 0.75}
    assert CausalLMMetrics()(EvalPrediction(predictions=rows, label_ids=None)) == result
    with pytest.raises(ValueError, match="preprocess_logits_for_metrics"):
        compute_metrics(EvalPrediction(predictions=np.zeros((2, 8, 128)), label_ids=np.zeros((2, 8))))


def eval_rows(n, seq, vocab, seed=3):
    ids = torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(seed))
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})


def run_evaluate(tmp_path, vocab, seq, n=12, batch=4, **args):
    """evaluate() with the reduction, recording what reaches preprocess_logits_for_metrics and compute_metrics."""
    torch.manual_seed(0)
    model = PretrainForCausalLM(small_config(vocab_size=vocab, max_position_embeddings=max(seq, 64)))
    seen = {"logits": [], "predictions": [], "labels": []}

    def preprocess(logits, labels):
        seen["logits"].append(tuple((logits[0] if isinstance(logits, tuple) else logits).shape))
        return preprocess_logits_for_metrics(logits, labels)

    metrics_fn = CausalLMMetrics()

    def recorder(eval_prediction, compute_result=None):
        seen["predictions"].append(np.asarray(torch.as_tensor(eval_prediction.predictions).cpu()))
        seen["labels"].append(None if eval_prediction.label_ids is None else np.shape(eval_prediction.label_ids))
        return metrics_fn(eval_prediction, compute_result)

    trainer = PretrainTrainer(
        model=model,
        args=quick_args(tmp_path, per_device_eval_batch_size=batch, prediction_loss_only=False, **args),
        eval_dataset=eval_rows(n, seq, vocab),
        compute_metrics=recorder,
        preprocess_logits_for_metrics=preprocess,
    )
    return trainer, trainer.evaluate(), seen


def direct_accuracy(model, data, batch):
    correct = total = 0
    model.eval()
    with torch.no_grad():
        for start in range(0, len(data), batch):
            ids = torch.tensor(data["input_ids"][start : start + batch])
            predicted = model(input_ids=ids).logits[:, :-1].argmax(-1)
            correct += int((predicted == ids[:, 1:]).sum())
            total += ids[:, 1:].numel()
    return correct / total


@pytest.mark.parametrize("vocab,seq", [(128, 16), (4096, 48)])
def test_evaluate_accumulates_three_numbers_per_sequence_whatever_the_vocabulary(tmp_path, vocab, seq):
    trainer, metrics, seen = run_evaluate(tmp_path, vocab, seq)
    assert seen["logits"] == [(4, seq, vocab)] * 3  # the model did produce full logits, batch by batch...
    (predictions,) = seen["predictions"]  # ...but the Trainer accumulated only the reduced rows
    assert predictions.shape == (12, 3)
    assert predictions.nbytes == 12 * 3 * 4  # fp32, independent of vocabulary and sequence length
    assert predictions[:, 2].tolist() == [seq - 1] * 12
    # Every batch has the same number of tokens: the Trainer's eval_loss is the token mean as well
    assert metrics["eval_perplexity"] == pytest.approx(math.exp(metrics["eval_loss"]), rel=1e-4)
    assert metrics["eval_next_token_accuracy"] == direct_accuracy(trainer.model, trainer.eval_dataset, 4)


def test_batch_eval_metrics_gives_the_same_numbers_and_keeps_nothing(tmp_path):
    _, full, _ = run_evaluate(tmp_path / "full", 512, 24, n=10)
    _, batched, seen = run_evaluate(tmp_path / "batched", 512, 24, n=10, batch_eval_metrics=True)
    # one call per batch (4 + 4 + 2 rows), each with only that batch's rows
    assert [p.shape for p in seen["predictions"]] == [(4, 3), (4, 3), (2, 3)]
    assert batched["eval_perplexity"] == pytest.approx(full["eval_perplexity"], rel=1e-6)
    assert batched["eval_next_token_accuracy"] == full["eval_next_token_accuracy"]


@pytest.mark.skipif(not hasattr(PretrainingArguments, "eval_lm_metrics"), reason="no eval_lm_metrics field yet")
def test_pretrain_trainer_reports_reduced_metrics_by_default(tmp_path):
    torch.manual_seed(0)
    data = eval_rows(6, 16, 128)
    trainer = PretrainTrainer(
        model=PretrainForCausalLM(small_config()),
        args=quick_args(tmp_path, per_device_eval_batch_size=3),
        eval_dataset=data,
    )
    metrics = trainer.evaluate()
    assert metrics["eval_perplexity"] == pytest.approx(math.exp(metrics["eval_loss"]), rel=1e-4)
    assert metrics["eval_next_token_accuracy"] == direct_accuracy(trainer.model, data, 3)
    # only for evaluate(): the trainer's own settings are back, predict() still returns logits
    assert trainer.compute_metrics is None and trainer.args.batch_eval_metrics is False
    assert trainer.predict(data).predictions.shape == (6, 16, 128)
    off = PretrainTrainer(
        model=trainer.model, args=quick_args(tmp_path, eval_lm_metrics=False), eval_dataset=data
    ).evaluate()
    assert "eval_perplexity" not in off
