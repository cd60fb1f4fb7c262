"""`export_hf`: write a checkpoint that plain transformers loads without hf_pretrain.

- `window_pattern="L"` (no windows) -> a `llama` checkpoint (`LlamaForCausalLM`).
- windowed models -> a `ministral` checkpoint (`MinistralForCausalLM`): the same Llama math
  (RMSNorm, SwiGLU, RoPE, GQA, no biases, untied head) with per-layer `layer_types` and one
  `sliding_window`, masked by the same transformers mask builders. Other families with per-layer
  windows change the math (Gemma's norm offsets and embedding scale, Qwen3/Olmo's q/k norms,
  Qwen2's q/k/v biases), so they are not targets.
Tensors are copied by name (the names are identical) with a strict load, so a missing or extra
weight fails the export instead of producing a silently different model.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from transformers import LlamaConfig, LlamaForCausalLM, MinistralConfig, MinistralForCausalLM, PreTrainedModel

from .configuration import PretrainConfig
from .model import PretrainForCausalLM

_OURS_ONLY = {"window_pattern", "layer_types", "sliding_window", "model_type", "architectures", "transformers_version"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def export_target(config: PretrainConfig) -> tuple[type, type]:
    """The (config class, model class) of plain transformers that has this config's math."""
    if "sliding_attention" not in config.layer_types:
        return LlamaConfig, LlamaForCausalLM
    if config.attention_bias or config.mlp_bias:
        raise ValueError(
            "export_hf: a windowed model with attention_bias/mlp_bias has no transformers architecture with the same "
            "math (Ministral has no biases). Train with attention_bias=False, mlp_bias=False, or use window_pattern='L'."
        )
    return MinistralConfig, MinistralForCausalLM


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
    if config_cls is MinistralConfig:
        fields.update(layer_types=list(model.config.layer_types), sliding_window=model.config.sliding_window)
        fields = {k: v for k, v in fields.items() if k in MinistralConfig.__dataclass_fields__ or k == "dtype"}
    target = model_cls(config_cls(**fields))
    target.load_state_dict(model.state_dict(), strict=True)
    target.to(model.dtype)
    out = Path(out_dir)
    target.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    if source_dir is not None:
        for name in TOKENIZER_FILES:
            if (source_dir / name).exists():
                shutil.copy2(source_dir / name, out / name)
    return out
