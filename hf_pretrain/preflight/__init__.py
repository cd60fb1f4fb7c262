"""Checks that run before training: attention kernels."""

from .attention import AttentionFallbackError, AttentionReport, attention_preflight, enforce_attention_policy

__all__ = [
    "AttentionFallbackError",
    "AttentionReport",
    "attention_preflight",
    "enforce_attention_policy",
]
