"""Checks that run before training's first step: the attention kernels (`attention.py`) and the run's memory
(`memory.py`). Each prices the run with an estimator below it (modeling's attention planner, distributed's memory
estimator) and the trainer enforces its policy (`attn_fallback`, `memory_preflight`)."""

from .attention import AttentionFallbackError, AttentionReport, attention_preflight, enforce_attention_policy

__all__ = [
    "AttentionFallbackError",
    "AttentionReport",
    "attention_preflight",
    "enforce_attention_policy",
]
