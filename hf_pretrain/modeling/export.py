"""`export_hf`: write a checkpoint that plain transformers loads without hf_pretrain.

- `window_pattern="L"` (no windows) -> a `llama` checkpoint (`LlamaForCausalLM`).
- windowed models -> a `ministral` checkpoint (`MinistralForCausalLM`): the same Llama math
  (RMSNorm, SwiGLU, RoPE, GQA, no biases, untied head) with per-layer `layer_types` and one
  `sliding_window`, masked by the same transformers mask builders. Other families with per-layer
  windows change the math (Gemma's norm offsets and embedding scale, Qwen3/Olmo's q/k norms,
  Qwen2's q/k/v biases), so they are not targets.
- MoE models (`num_experts > 0`, dropless routing) -> `mixtral` (`MixtralForCausalLM`) when every
  layer is MoE, no layer is windowed and the top-k weights are renormalised (`norm_topk_prob`):
  Mixtral's router, experts and attention are exactly this math. Otherwise -> `qwen2_moe`
  (`Qwen2MoeForCausalLM`), the transformers MoE that has per-layer dense MLPs (`mlp_only_layers`),
  per-layer `layer_types` windows, `norm_topk_prob` either way and Llama attention without biases
  (`qkv_bias=False`); its always-present shared expert is given width 0
  (`shared_expert_intermediate_size=0`), which adds exactly 0, so the logits are ours. Other
  transformers MoEs change the math (q/k norms in Qwen3-MoE, OLMoE, Mellum; shared experts or
  sigmoid routing in DeepSeek/GLM; multipliers in Granite-MoE).
  Not exportable, with a ValueError saying why: capacity-limited routing (`moe_capacity_factor`:
  no transformers MoE drops tokens) and attention biases on an MoE model.
Tensors are copied by name (the names are identical) with a strict load, so a missing or extra
weight fails the export instead of producing a silently different model.
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MinistralConfig,
    MinistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    PreTrainedModel,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
)

from .configuration import PretrainConfig
from .model import PretrainForCausalLM

_MOE_FIELDS = {
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "moe_every",
    "moe_layer_fraction",
    "moe_capacity_factor",
    "norm_topk_prob",
    "router_aux_loss_coef",
    "router_z_loss_coef",
}
_OURS_ONLY = {
    "window_pattern",
    "layer_types",
    "sliding_window",
    "model_type",
    "architectures",
    "transformers_version",
    "chunked_loss",
    *_MOE_FIELDS,
}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def export_target(config: PretrainConfig) -> tuple[type, type]:
    """The (config class, model class) of plain transformers that has this config's math."""
    if config.num_experts:
        return _moe_target(config)
    if "sliding_attention" not in config.layer_types:
        return LlamaConfig, LlamaForCausalLM
    if config.attention_bias or config.mlp_bias:
        raise ValueError(
            "export_hf: a windowed model with attention_bias/mlp_bias has no transformers architecture with the same "
            "math (Ministral has no biases). Train with attention_bias=False, mlp_bias=False, or use window_pattern='L'."
        )
    return MinistralConfig, MinistralForCausalLM


def _moe_target(config: PretrainConfig) -> tuple[type, type]:
    if config.moe_capacity_factor is not None:
        raise ValueError(
            f"export_hf: moe_capacity_factor={config.moe_capacity_factor} drops the tokens that overflow an expert, and no "
            "transformers MoE architecture drops tokens, so no export has the same logits. To export the model as it runs "
            "without dropping (the usual way to serve a capacity-trained MoE), set model.config.moe_capacity_factor = None "
            "first; its logits then differ from the capacity-limited forward wherever that forward dropped tokens."
        )
    if config.attention_bias:
        raise ValueError(
            "export_hf: an MoE model with attention_bias=True has no transformers architecture with the same math "
            "(Mixtral has no attention biases, Qwen2-MoE none on o_proj). Train with attention_bias=False."
        )
    windows = "sliding_attention" in config.layer_types
    if not windows and config.norm_topk_prob and set(config.mlp_layer_types) == {"sparse"}:
        return MixtralConfig, MixtralForCausalLM
    return Qwen2MoeConfig, Qwen2MoeForCausalLM


def _moe_fields(config: PretrainConfig, config_cls: type, fields: dict) -> dict:
    """The target config's fields: ours where the names agree, the MoE ones mapped."""
    # transformers' aux loss pools the layers and lets the load sum to k: about k times ours (see moe.py).
    shared = dict(num_experts_per_tok=config.num_experts_per_tok, router_aux_loss_coef=config.router_aux_loss_coef)
    shared["router_aux_loss_coef"] /= config.num_experts_per_tok
    if config_cls is MixtralConfig:
        moe = dict(
            num_local_experts=config.num_experts, intermediate_size=config.moe_intermediate_size, sliding_window=None
        )
    else:
        windows = "sliding_attention" in config.layer_types
        moe = dict(
            num_experts=config.num_experts,
            moe_intermediate_size=config.moe_intermediate_size,
            norm_topk_prob=config.norm_topk_prob,
            shared_expert_intermediate_size=0,
            decoder_sparse_step=1,
            mlp_only_layers=[i for i, t in enumerate(config.mlp_layer_types) if t == "dense"],
            qkv_bias=False,
            layer_types=list(config.layer_types),
            use_sliding_window=windows,
            sliding_window=config.sliding_window if windows else None,
            max_window_layers=config.num_hidden_layers,
        )
    keep = {k: v for k, v in fields.items() if k in config_cls.__dataclass_fields__ or k in ("dtype", "head_dim")}
    return {**keep, **shared, **moe}


def _moe_state_dict(model: PretrainForCausalLM, model_cls: type) -> dict:
    """Our tensors, plus, for Qwen2-MoE, the empty shared expert (width 0, so it adds exactly 0) of each MoE layer."""
    state = dict(model.state_dict())
    if model_cls is Qwen2MoeForCausalLM:
        h, like = model.config.hidden_size, model.lm_head.weight
        for i, kind in enumerate(model.config.mlp_layer_types):
            if kind == "sparse":
                prefix = f"model.layers.{i}.mlp.shared_expert"
                state[f"{prefix}.gate_proj.weight"] = like.new_zeros(0, h)
                state[f"{prefix}.up_proj.weight"] = like.new_zeros(0, h)
                state[f"{prefix}.down_proj.weight"] = like.new_zeros(h, 0)
                state[f"{prefix}_gate.weight"] = like.new_zeros(1, h)
    return state


def export_hf(model_or_dir: PreTrainedModel | str | os.PathLike, out_dir: str | os.PathLike) -> Path:
    """Export an hf_pretrain model (or a directory saved by it) to `out_dir`; returns `out_dir`."""
    source_dir = None
    model = model_or_dir
    if not isinstance(model, PreTrainedModel):
        source_dir = Path(model_or_dir)
        model = PretrainForCausalLM.from_pretrained(source_dir)
    if not isinstance(model.config, PretrainConfig):
        raise TypeError(f"export_hf expects a PretrainForCausalLM, got {type(model).__name__}.")
    config_cls, model_cls = export_target(model.config)
    fields = {k: v for k, v in model.config.to_dict().items() if k not in _OURS_ONLY}
    state = model.state_dict()
    if config_cls is MinistralConfig:
        fields.update(layer_types=list(model.config.layer_types), sliding_window=model.config.sliding_window)
        fields = {k: v for k, v in fields.items() if k in MinistralConfig.__dataclass_fields__ or k == "dtype"}
    elif config_cls in (MixtralConfig, Qwen2MoeConfig):
        fields = _moe_fields(model.config, config_cls, fields)
        state = _moe_state_dict(model, model_cls)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Initializing zero-element tensors is a no-op")  # Qwen2-MoE's width 0
        target = model_cls(config_cls(**fields))
    target.load_state_dict(state, strict=True)
    target.to(model.dtype)
    out = Path(out_dir)
    target.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    if source_dir is not None:
        for name in TOKENIZER_FILES:
            if (source_dir / name).exists():
                shutil.copy2(source_dir / name, out / name)
    return out
