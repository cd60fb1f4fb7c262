"""Evaluation for pretraining: local `evaluate` metrics, per-batch reduction for the Trainer, a generation probe.

- `metric_path(name)` / `load_metric(name)`: the metrics shipped with the package as local
  `evaluate` modules (`perplexity`, `next_token_accuracy`), loaded from the installed package
  with `evaluate.load(path)`: no Hub download, so they work on air-gapped clusters.
- `preprocess_logits_for_metrics` / `compute_metrics` / `CausalLMMetrics` (`reduce.py`): reduce
  every evaluation batch to three numbers per sequence inside `Trainer.evaluate()`, so the Trainer
  never holds the logits of the evaluation set.
- `GenerationProbeCallback` (`generation_probe.py`): greedy completions of fixed prompts every N
  steps, with exact-match scoring, in the console, `telemetry.jsonl` and `report_to`.
See docs/evaluation.md.
"""

from __future__ import annotations

from pathlib import Path

from .generation_probe import GenerationProbeCallback, exact_match, normalize_answer, parse_prompt
from .reduce import (
    CausalLMMetrics,
    causal_lm_statistics_or_empty,
    compute_metrics,
    preprocess_logits_for_metrics,
    token_statistics,
)

METRICS_DIR = Path(__file__).resolve().parent / "metrics"
METRICS = ("perplexity", "next_token_accuracy")


def metric_path(name: str) -> str:
    """The local path of a shipped metric module (a folder holding `<name>.py`), for `evaluate.load(path)`."""
    if name not in METRICS:
        raise ValueError(f"Unknown hf_pretrain metric {name!r}; shipped: {list(METRICS)}.")
    path = METRICS_DIR / name
    if not (path / f"{name}.py").is_file():
        raise FileNotFoundError(
            f"{path / f'{name}.py'} is missing: the package was installed without its metric modules "
            "(setup.cfg [options.package_data] must include evaluation/metrics/*/*.py)."
        )
    return str(path)


def load_metric(name: str, **kwargs):
    """`evaluate.load(metric_path(name), **kwargs)`; `keep_in_memory=True` unless given.

    In memory, the metric writes no Arrow cache file under ~/.cache/huggingface/metrics, so ranks
    that compute at the same time share no file and a read-only home directory is no problem. The
    module itself is still copied into `evaluate`'s modules cache (`HF_MODULES_CACHE`) on load.
    """
    import evaluate

    kwargs.setdefault("keep_in_memory", True)
    return evaluate.load(metric_path(name), **kwargs)


__all__ = [
    "METRICS",
    "CausalLMMetrics",
    "causal_lm_statistics_or_empty",
    "GenerationProbeCallback",
    "compute_metrics",
    "exact_match",
    "load_metric",
    "metric_path",
    "normalize_answer",
    "parse_prompt",
    "preprocess_logits_for_metrics",
    "token_statistics",
]
