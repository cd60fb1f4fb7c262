"""Perplexity and next-token accuracy inside `Trainer.evaluate()` without keeping the logits.

Left alone, `Trainer.evaluate()` with a `compute_metrics` keeps the logits of the whole evaluation
set ([samples, sequence, vocabulary]: 8k tokens x 128k vocabulary is 4 GiB in fp32 per sequence)
until the end of the loop. `preprocess_logits_for_metrics` reduces every batch, as soon as the
model produced it, to three numbers per sequence (`STATS`): the sum of the negative
log-likelihoods of its predicted tokens (fp32, whatever the model's dtype), how many of them the
argmax got right, and how many were predicted. The target of position t is the label at t + 1 (the
causal-LM shift the model's own loss applies) and label -100 is skipped: padding, and with
`PackedDocumentCollator` the first token of every packed document after the first, which the
collator already set to -100, so no prediction across a document boundary is scored.

Rows are per sequence (shape [batch, 3]), not per batch: the Trainer pads, gathers and
concatenates along dim 0 as for any per-sample output, and `gather_for_metrics` drops the
duplicated samples of an uneven last batch under several processes exactly as it does for logits.
What the Trainer accumulates is [samples, 3] floats, independent of vocabulary and sequence length.

`compute_metrics(eval_prediction)` turns those rows into `{"perplexity", "next_token_accuracy"}`
with the package's local `evaluate` metrics (token-weighted: exp(total NLL / total tokens)).
`CausalLMMetrics()` does the same and also serves `batch_eval_metrics=True`, where the Trainer
calls it per batch (`compute_result=False`, then True on the last one): each call is one
`metric.add_batch` and nothing of the evaluation set is kept by the Trainer at all (not even the
labels, which it otherwise accumulates, [samples, sequence] int64, to pass to `compute_metrics`).

    trainer = PretrainTrainer(..., compute_metrics=compute_metrics,
                              preprocess_logits_for_metrics=preprocess_logits_for_metrics)
    trainer.evaluate()  # {"eval_loss": ..., "eval_perplexity": ..., "eval_next_token_accuracy": ...}

`prediction_loss_only=True` (the example script's default) skips the logits and so these metrics.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

IGNORE_INDEX = -100
STATS = ("nll_sum", "correct", "token_count")
# Positions whose fp32 logits are materialised at once: rows are processed in chunks of about
# this many logits (2**26 fp32 = 256 MiB), so the reduction adds a bounded amount of memory.
CHUNK_ELEMENTS = 1 << 26


@torch.no_grad()
def token_statistics(logits: torch.Tensor, labels: torch.Tensor, chunk_elements: int = CHUNK_ELEMENTS) -> torch.Tensor:
    """[batch, 3] float32 on the logits' device: per row (nll_sum, correct, token_count) of next-token prediction.

    `logits` [batch, seq, vocab] in any float dtype; `labels` [batch, seq], unshifted (as given to
    the model), -100 where nothing is predicted. NLL and argmax are computed in fp32, `chunk_elements`
    logits at a time.
    """
    if logits.dim() != 3:
        raise ValueError(f"logits must be [batch, seq, vocab]; got shape {tuple(logits.shape)}.")
    if labels is None or tuple(labels.shape) != tuple(logits.shape[:2]):
        got = None if labels is None else tuple(labels.shape)
        raise ValueError(f"labels must be [batch, seq] = {tuple(logits.shape[:2])} (unshifted); got {got}.")
    batch, seq, vocab = logits.shape
    targets = labels[:, 1:].to(logits.device)
    stats = torch.zeros(batch, 3, dtype=torch.float32, device=logits.device)
    chunk = max(1, chunk_elements // vocab)
    for row in range(batch):
        for start in range(0, seq - 1, chunk):
            target = targets[row, start : start + chunk]
            scores = logits[row, start : start + target.shape[0]].float()
            keep = target != IGNORE_INDEX
            nll = F.cross_entropy(scores, target, ignore_index=IGNORE_INDEX, reduction="sum")
            correct = ((scores.argmax(dim=-1) == target) & keep).sum()
            stats[row] += torch.stack((nll, correct.float(), keep.sum().float()))
    return stats


def preprocess_logits_for_metrics(logits, labels) -> torch.Tensor:
    """For `Trainer(preprocess_logits_for_metrics=...)`: one batch's logits -> [batch, 3] statistics (`STATS`).

    A tuple of model outputs (logits first, as the Trainer passes when the model returns more than
    the loss and logits) is accepted.
    """
    if isinstance(logits, (tuple, list)):
        logits = logits[0]
    if labels is None:
        raise ValueError("preprocess_logits_for_metrics needs the labels: the evaluation batches must carry `labels`.")
    return token_statistics(logits, labels)


def causal_lm_statistics_or_empty(logits, labels) -> torch.Tensor:
    """`preprocess_logits_for_metrics` for a model whose outputs may not be causal-LM logits.

    `[batch, seq, vocab]` logits with `[batch, seq]` labels -> `token_statistics`; anything else
    (other shapes, no labels) -> rows of zeros: no token predicted, so `CausalLMMetrics(skip_empty=True)`
    reports no metric instead of failing the evaluation.
    """
    first = logits[0] if isinstance(logits, (tuple, list)) and logits else logits
    if (
        torch.is_tensor(first)
        and first.dim() == 3
        and torch.is_tensor(labels)
        and tuple(labels.shape) == tuple(first.shape[:2])
    ):
        return token_statistics(first, labels)
    batch = first.shape[0] if torch.is_tensor(first) and first.dim() else 1
    return torch.zeros(batch, len(STATS), device=first.device if torch.is_tensor(first) else None)


def _as_rows(predictions) -> np.ndarray:
    """The accumulated statistics as a float64 [rows, 3] array, or a clear error when they are something else."""
    if isinstance(predictions, torch.Tensor):
        predictions = predictions.detach().float().cpu().numpy()
    elif isinstance(predictions, list):  # eval_do_concat_batches=False: one array per batch
        predictions = (
            np.concatenate([np.asarray(p).reshape(-1, len(STATS)) for p in predictions]) if predictions else []
        )
    elif isinstance(predictions, tuple):
        predictions = predictions[0]
    rows = np.asarray(predictions, dtype=np.float64)
    if rows.size == 0:
        return rows.reshape(0, len(STATS))
    if rows.ndim != 2 or rows.shape[1] != len(STATS):
        raise ValueError(
            f"compute_metrics expects the per-sequence statistics of preprocess_logits_for_metrics, shape "
            f"[samples, {len(STATS)}]; got {rows.shape}. Pass preprocess_logits_for_metrics="
            "hf_pretrain.evaluation.preprocess_logits_for_metrics to the Trainer."
        )
    if (rows[:, 2] < 0).any() or (rows[:, 1] > rows[:, 2]).any():
        raise ValueError(
            "Malformed statistics rows (token_count < 0 or correct > token_count): padded or foreign data."
        )
    return rows


def _add_rows(metrics: dict, rows: np.ndarray) -> None:
    counts = np.rint(rows[:, 2]).astype(np.int64)
    metrics["perplexity"].add_batch(nll_sum=rows[:, 0], token_count=counts)
    metrics["next_token_accuracy"].add_batch(correct=np.rint(rows[:, 1]).astype(np.int64), token_count=counts)


def _result(metrics: dict) -> dict[str, float]:
    return {
        "perplexity": metrics["perplexity"].compute()["perplexity"],
        "next_token_accuracy": metrics["next_token_accuracy"].compute()["next_token_accuracy"],
    }


def _load_metrics() -> dict:
    from .shipped_metrics import METRICS, load_metric

    return {name: load_metric(name) for name in METRICS}


def compute_metrics(eval_prediction) -> dict[str, float]:
    """For `Trainer(compute_metrics=...)`: `{"perplexity", "next_token_accuracy"}` over the whole evaluation set.

    `eval_prediction.predictions` are the [samples, 3] rows of `preprocess_logits_for_metrics`
    (the labels are not needed again). Both metrics are token-weighted; NaN when no token was
    predicted.
    """
    rows = _as_rows(eval_prediction.predictions)
    if len(rows) == 0:
        return {"perplexity": float("nan"), "next_token_accuracy": float("nan")}
    metrics = _load_metrics()
    _add_rows(metrics, rows)
    return _result(metrics)


class CausalLMMetrics:
    """`compute_metrics` for both evaluation modes of the Trainer.

    - `batch_eval_metrics=False` (default): called once with every row, as `compute_metrics`.
    - `batch_eval_metrics=True`: called per batch; each call adds the batch's rows to the local
      `evaluate` metrics (`add_batch`) and returns {} until `compute_result=True` (the last batch),
      which returns the result and starts afresh for the next evaluation. The Trainer then keeps
      nothing of the evaluation set, labels included.
    With `skip_empty=True` an evaluation in which no token was predicted returns {} (no metric)
    instead of NaN: what `PretrainTrainer` installs for models that may not be causal LMs.
    Use one instance per Trainer.
    """

    def __init__(self, skip_empty: bool = False):
        self.skip_empty = skip_empty
        self._metrics: dict | None = None

    def __call__(self, eval_prediction, compute_result: bool | None = None) -> dict[str, float]:
        if compute_result is None:
            return compute_metrics(eval_prediction)
        rows = _as_rows(eval_prediction.predictions)
        if self._metrics is None:
            self._metrics = _load_metrics()
            self._rows = self._tokens = 0
        if len(rows):
            _add_rows(self._metrics, rows)
            self._rows += len(rows)
            self._tokens += int(rows[:, 2].sum())
        if not compute_result:
            return {}
        metrics, seen, tokens, self._metrics = self._metrics, self._rows, self._tokens, None
        if self.skip_empty and tokens == 0:
            return {}
        if seen == 0:
            return {"perplexity": float("nan"), "next_token_accuracy": float("nan")}
        return _result(metrics)
