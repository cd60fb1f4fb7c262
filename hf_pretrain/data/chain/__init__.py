"""The data chain on datatrove's executors (`run.py` drives it; `stages.py`, `executors.py`, `dedup_shards.py`)."""

from .run import reused_stages, run_pipeline

__all__ = ["reused_stages", "run_pipeline"]
