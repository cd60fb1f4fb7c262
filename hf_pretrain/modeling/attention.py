"""The one attention entry point of the model.

Every attention layer calls `attention_forward`; backends plug in here and nowhere else. The
backends of this module are transformers' own kernels, looked up by name in
`transformers.modeling_utils.ALL_ATTENTION_FUNCTIONS` (`sdpa`, `eager`, and the flash / flex
integrations transformers ships), so hf_pretrain inherits their fixes instead of copying them.

Sliding windows are honoured on every backend: the mask for a window layer comes from
`transformers.masking_utils.create_sliding_window_causal_mask` (a banded boolean mask for SDPA, an
additive mask for eager), and the layer's `sliding_window` is also passed to kernels that take it
natively (flash-attn's `window_size`). Plain `LlamaForCausalLM` builds only the full causal mask and
so silently drops windows; this is the difference.

Design trade-off: masks are built once per forward, one per layer type, by
`build_attention_masks`, not per layer; a model without `S` layers builds only the full mask, so a
window-free model pays nothing for the feature.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import eager_attention_forward

FULL, SLIDING = "full_attention", "sliding_attention"


def attention_backend(implementation: str | None) -> Callable:
    """The kernel for `config._attn_implementation` (eager when unset or `"eager"`)."""
    if implementation in (None, "eager"):
        return eager_attention_forward
    if implementation not in ALL_ATTENTION_FUNCTIONS:
        known = ["eager", *ALL_ATTENTION_FUNCTIONS.valid_keys()]
        raise ValueError(f"attn_implementation={implementation!r} is unknown; use one of {known}.")
    return ALL_ATTENTION_FUNCTIONS[implementation]


def build_attention_masks(config, inputs_embeds, attention_mask, cache, position_ids) -> dict:
    """One mask per layer type present in `config.layer_types` (a dict from `generate` passes through)."""
    if isinstance(attention_mask, dict):
        return attention_mask
    kwargs = dict(
        config=config,
        inputs_embeds=inputs_embeds,
        attention_mask=attention_mask,
        cache=cache,
        position_ids=position_ids,
    )
    masks = {FULL: create_causal_mask(**kwargs)}
    if SLIDING in config.layer_types:
        masks[SLIDING] = create_sliding_window_causal_mask(**kwargs)
    return masks


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Run attention for one layer: (batch, heads, seq, head_dim) in, (batch, seq, heads, head_dim) out.

    `module` carries `scaling`, `num_key_value_groups`, `sliding_window` (None on full layers) and
    `is_causal`, the attributes transformers' kernels read.
    """
    kernel = attention_backend(module.config._attn_implementation)
    return kernel(
        module,
        query,
        key,
        value,
        attention_mask,
        scaling=module.scaling,
        dropout=module.attention_dropout if module.training else 0.0,
        sliding_window=module.sliding_window,
        **kwargs,
    )
