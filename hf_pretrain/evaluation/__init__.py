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

from ..lazy import lazy_getattr

_HOMES = {  # imported on first use: `hf-pretrain eval --help` answers before torch is loaded
    "GenerationProbeCallback": ".generation_probe",
    "exact_match": ".generation_probe",
    "normalize_answer": ".generation_probe",
    "parse_prompt": ".generation_probe",
    "CausalLMMetrics": ".reduce",
    "causal_lm_statistics_or_empty": ".reduce",
    "compute_metrics": ".reduce",
    "preprocess_logits_for_metrics": ".reduce",
    "token_statistics": ".reduce",
}

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


__all__ = sorted(["METRICS", "load_metric", "metric_path", *_HOMES])


__getattr__ = lazy_getattr(__name__, _HOMES)
