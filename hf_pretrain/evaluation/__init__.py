"""Evaluation for pretraining: local `evaluate` metrics, per-batch reduction for the Trainer, a generation probe.

- `metric_path(name)` / `load_metric(name)` (`shipped_metrics.py`): the metrics shipped with the package as local
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

from ..lazy import lazy_getattr
from .shipped_metrics import METRICS, load_metric, metric_path

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

__all__ = ["METRICS", "load_metric", "metric_path", *sorted(_HOMES)]


__getattr__ = lazy_getattr(__name__, _HOMES)
