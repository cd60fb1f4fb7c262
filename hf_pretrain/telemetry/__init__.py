"""Telemetry: device facts (measured ceilings, sensors, clocks) and the callbacks that log them.

The FLOPs formula is `modeling/accounting.py`'s and the spec peaks are `chips.py`'s; these names are
re-exported here for scripts written against `hf_pretrain.telemetry`.
"""

from ..modeling.accounting import attention_flops_per_token, flops_per_token, matmul_parameters, mean_keys_per_query

__all__ = ["attention_flops_per_token", "flops_per_token", "matmul_parameters", "mean_keys_per_query"]
