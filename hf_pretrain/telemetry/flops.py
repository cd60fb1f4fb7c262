"""FLOPs per token: the formula lives in `modeling/accounting.py` (the one accounting of a model's shape).

These names stay importable from here for scripts written against `hf_pretrain.telemetry.flops`;
code in the package imports them from `hf_pretrain.modeling.accounting`.
"""

from ..modeling.accounting import attention_flops_per_token, flops_per_token, matmul_parameters, mean_keys_per_query

__all__ = ["attention_flops_per_token", "flops_per_token", "matmul_parameters", "mean_keys_per_query"]
