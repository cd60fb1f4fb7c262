"""Telemetry: FLOPs accounting (the one formula), device facts, callbacks."""

from .flops import attention_flops_per_token, flops_per_token, matmul_parameters, mean_keys_per_query

__all__ = ["attention_flops_per_token", "flops_per_token", "matmul_parameters", "mean_keys_per_query"]
