"""Checks that run before training: attention kernels, restart advice."""

from .attention import AttentionFallbackError, AttentionReport, attention_preflight, enforce_attention_policy
from .restart import RestartAdvice, advise_restart

__all__ = [
    "AttentionFallbackError",
    "AttentionReport",
    "RestartAdvice",
    "advise_restart",
    "attention_preflight",
    "enforce_attention_policy",
]
