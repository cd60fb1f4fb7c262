"""The summary table of `hf-pretrain report`: what a person judges a run by, read from the run directory.

Rows: the model and its size (`config.json`, written by `save_model`: parameters counted by
`modeling/accounting.py` for hf_pretrain configs, the config's own type otherwise), tokens seen,
the precision, the compute dtype and the attention kernels (`preflight.json`), then the last value of the
training loss, held-out loss, learning rate, tokens/s, MFU, the downstream figures and the
goodput (`goodput.py`) (telemetry.jsonl). What the run directory does not hold is said so, never invented.

The held-out loss of a run whose stream lacks it (a run of a version whose final `evaluate()` did not reach
telemetry.jsonl) is read from `pretrain_summary.json`, where `examples/pretrain.py` writes the figure it
printed (`heldout_loss`), and its source said. `hf-pretrain report` prints the table on the console too.
"""

from __future__ import annotations

import json
from pathlib import Path

from .goodput import goodput_summary

MISSING = "not in the run directory"
SUMMARY = "pretrain_summary.json"  # what examples/pretrain.py writes at its end: the figures it printed
DOWNSTREAM_NOT_RUN = "not run (pass --downstream_tasks)"  # a run that asked for no downstream evaluation
# An MFU whose peak the run never had (telemetry/throughput.py logs the peak once, at the first log, when known)
NO_PEAK = {
    "mfu_spec": ("peak_tflops_spec", "unavailable: no spec peak for this chip and precision (pass peak_tflops)"),
    "mfu_measured": ("peak_tflops_measured", "unavailable: no native GEMM in this precision to measure a ceiling"),
}


def _last(records: list[dict], key: str):
    return next((r[key] for r in reversed(records) if isinstance(r.get(key), (int, float))), None)


def _model(run_dir: Path) -> str:
    path = run_dir / "config.json"
    if not path.is_file():
        return f"{MISSING} (config.json is written by save_model)"
    config = json.loads(path.read_text())
    kind = config.get("model_type", "?")
    try:
        from ..modeling.accounting import count_parameters
        from ..modeling.configuration import PretrainConfig

        if kind == "hf_pretrain":
            size = count_parameters(PretrainConfig.from_dict(config)) / 1e6
            return (
                f"{kind}, {size:.2f} M parameters, {config['num_hidden_layers']} layers, width {config['hidden_size']}"
            )
    except (KeyError, TypeError, ValueError):
        pass
    return f"{kind}, {config.get('num_hidden_layers', '?')} layers, width {config.get('hidden_size', '?')}"


def _preflight(run_dir: Path) -> tuple[str, str, str]:
    """The compute dtype, the attention kernels and the precision the run started with."""
    path = run_dir / "preflight.json"
    if not path.is_file():
        return MISSING, MISSING, MISSING
    written = json.loads(path.read_text())
    attention = written.get("attention", {})
    kernels = ", ".join(f"{r['layers']} x {r['label']}: {r['backend']}" for r in attention.get("rows", []))
    where = f"{attention.get('dtype', '?')} on {attention.get('device', '?')}"
    precision = written.get("precision")
    if precision is None:
        said = f"{MISSING} (preflight.json of an older version)"
    else:
        recipe = f"recipe {precision['recipe']}" if precision.get("recipe") else "no recipe"
        scaling = f", {precision['scaling']} scaling" if precision.get("scaling") else ""
        said = f"{precision['matmuls']} matmuls ({recipe}{scaling})"
    return where, kernels or MISSING, said


def _held_out_loss(run_dir: Path, records: list[dict]) -> str:
    """The last `eval_loss` of the stream, else the example's `heldout_loss` (its source said), else 'not logged'."""
    value = _last(records, "eval_loss")
    if value is not None:
        return f"{value:.4f}"
    path = run_dir / SUMMARY
    try:
        written = json.loads(path.read_text()) if path.is_file() else {}
    except ValueError:  # a file cut short: nothing read from it, and said so
        return f"not logged ({SUMMARY} is no JSON)"
    figure = written.get("heldout_loss") if isinstance(written, dict) else None
    return f"{figure:.4f} ({SUMMARY})" if isinstance(figure, (int, float)) else "not logged"


def _why_missing(key: str, records: list[dict]) -> str:
    """What is true of a figure the stream lacks: never run, never measurable here, or not logged."""
    if key.startswith("downstream/") and not any(k.startswith("downstream/") for r in records for k in r):
        return DOWNSTREAM_NOT_RUN
    peak, unavailable = NO_PEAK.get(key, (None, ""))
    if peak and records and _last(records, "tokens_per_second") is not None and _last(records, peak) is None:
        return unavailable  # throughput was logged, so the MFU's only missing part is its peak
    return "not logged"


def summary_rows(run_dir: Path, records: list[dict]) -> list[tuple[str, str]]:
    dtype, kernels, precision = _preflight(run_dir)
    rows = [("model", _model(run_dir)), ("precision", precision), ("compute dtype", dtype)]
    rows.append(("attention kernels", kernels))
    tokens = _last(records, "num_input_tokens_seen")
    rows.append(("tokens seen", f"{tokens:,.0f}" if tokens is not None else MISSING))
    rows.append(("optimizer steps", str(max((r["step"] for r in records), default=0))))
    finals = (
        ("training loss", "loss", "{:.4f}"),
        ("learning rate", "learning_rate", "{:.3g}"),
        ("tokens / s", "tokens_per_second", "{:,.0f}"),
        ("MFU (spec)", "mfu_spec", "{:.1%}"),
        ("MFU (measured ceiling)", "mfu_measured", "{:.1%}"),
        ("downstream centered accuracy", "downstream/centered", "{:.4f}"),
        ("downstream time share", "downstream/time_share", "{:.1%}"),
    )
    for label, key, form in finals:
        value = _last(records, key)
        rows.append((label, form.format(value) if value is not None else _why_missing(key, records)))
        if key == "loss":
            rows.append(("held-out loss", _held_out_loss(run_dir, records)))
    tasks = sorted({k.split("/")[1] for r in records for k in r if k.startswith("downstream/") and k.count("/") == 2})
    for task in tasks:
        figures = {m: _last(records, f"downstream/{task}/{m}") for m in ("acc", "acc_norm", "bpb", "centered")}
        text = ", ".join(f"{m} {v:.3f}" for m, v in figures.items() if v is not None)
        rows.append((f"downstream {task}", text))
    rows.append(("goodput", goodput_summary(records) or "not logged (telemetry off)"))
    return rows


def summary_table(run_dir: Path, records: list[dict]) -> str:
    """The rows but the goodput (its own line on the console) as aligned console lines."""
    return "\n".join(f"{label:<30}{value}" for label, value in summary_rows(run_dir, records) if label != "goodput")
