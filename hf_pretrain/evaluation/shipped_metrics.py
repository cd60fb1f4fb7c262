"""The metrics shipped with the package as local `evaluate` modules (`perplexity`, `next_token_accuracy`).

`metric_path(name)` is the folder `evaluate.load(path)` loads them from inside the installed package (no Hub
download, so they work on air-gapped clusters); `load_metric(name)` loads one in memory.
"""

from __future__ import annotations

from pathlib import Path

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
