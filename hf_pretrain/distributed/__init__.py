"""Distributed training helpers: the per-GPU memory estimator (`hf-pretrain estimate-memory`) and the
distributed doctor (`hf-pretrain doctor --distributed`, `doctor.py`)."""

from .memory import MemoryEstimate, estimate_memory
from .memory_format import format_estimate

__all__ = ["MemoryEstimate", "estimate_memory", "format_estimate"]
