"""Size presets: plain functions in a registry, each returning a `PretrainConfig`.

`get_preset(name, **overrides)` builds one, `load_config(name_or_path, **overrides)` a preset or a saved
config; `PRESETS` maps names to builders and `nominal_parameters(name)` gives the size the name promises
(checked by the test suite against a real parameter count). Shapes follow the usual recipes: SwiGLU width about 8/3 of the hidden size
rounded up to a multiple of 64/128, head_dim 64 or 128, untied embeddings except where the
original model tied them (GPT-2). MoE presets are named by their total parameters (all experts);
`modeling.accounting.matmul_parameters` gives the active ones.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from .modeling.configuration import PretrainConfig

PRESETS: dict[str, Callable[..., PretrainConfig]] = {}
NOMINAL_PARAMETERS: dict[str, float] = {}


def register_preset(name: str, nominal_parameters: float):
    """Decorator: add a preset builder under `name`, promising about `nominal_parameters` weights."""

    def wrap(builder: Callable[..., PretrainConfig]) -> Callable[..., PretrainConfig]:
        PRESETS[name] = builder
        NOMINAL_PARAMETERS[name] = nominal_parameters
        return builder

    return wrap


def get_preset(name: str, **overrides) -> PretrainConfig:
    """The `PretrainConfig` of preset `name`, with any field overridden by keyword."""
    if name not in PRESETS:
        raise ValueError(f"preset={name!r} is unknown; choose one of {sorted(PRESETS)}.")
    return PRESETS[name](**overrides)


def load_config(name_or_path: str, **overrides) -> PretrainConfig:
    """A preset name, a directory saved by `save_pretrained`, or a config.json file, with any field overridden by
    keyword (a saved config's `layer_types` derived again from the `window_pattern` then in force)."""
    if name_or_path in PRESETS:
        return get_preset(name_or_path, **overrides)
    path = Path(name_or_path)
    if not path.exists():
        raise ValueError(f"config={name_or_path!r} is neither a preset ({sorted(PRESETS)}) nor an existing path.")
    config = PretrainConfig.from_pretrained(path.parent if path.is_file() else path)
    if not overrides:
        return config
    saved = config.to_dict()
    saved.pop("layer_types", None)  # derived from window_pattern, which an override may change
    return PretrainConfig(**{**saved, **overrides})


def nominal_parameters(name: str) -> float:
    return NOMINAL_PARAMETERS[name]


def _config(overrides: dict, **shape) -> PretrainConfig:
    return PretrainConfig(**{**shape, **overrides})


@register_preset("tiny", 1.8e6)
def tiny(**overrides) -> PretrainConfig:
    """CPU default: trains in minutes on two cores in fp32 (vocab matches the example's BPE)."""
    return _config(
        overrides,
        vocab_size=4096,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )


@register_preset("tiny-moe", 3.6e6)
def tiny_moe(**overrides) -> PretrainConfig:
    """`tiny` with an MoE in every layer: 8 experts of width 192, top-2, so about tiny's FLOPs per token
    (2 x 192 = tiny's 384-wide MLP) with twice its parameters (3.6 M in all; named by total parameters)."""
    return tiny(**{"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 192, **overrides})


@register_preset("gpt2-124m", 124e6)
def gpt2_124m(**overrides) -> PretrainConfig:
    """GPT-2 small's shape (12 x 768, 12 heads, 50,257 -> 50,304 vocab) with SwiGLU; tied like GPT-2."""
    return _config(
        overrides,
        vocab_size=50304,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=12,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
    )


@register_preset("0.9b", 0.9e9)
def d20_0_9b(**overrides) -> PretrainConfig:
    """20 layers, ~0.9 B: the single-machine run of the field notes, sliding windows SSSL."""
    return _config(
        overrides,
        vocab_size=65536,
        hidden_size=1664,
        intermediate_size=4480,
        num_hidden_layers=20,
        num_attention_heads=13,
        num_key_value_heads=13,
        head_dim=128,
        max_position_embeddings=2048,
        window_pattern="SSSL",
        sliding_window=1024,
    )


@register_preset("1.4b", 1.4e9)
def d24_1_4b(**overrides) -> PretrainConfig:
    """24 layers, ~1.4 B with GQA (16 heads, 4 KV heads): the two-machine run of the field notes."""
    return _config(
        overrides,
        vocab_size=65536,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=24,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=2048,
    )


@register_preset("llama2-7b", 7e9)
def llama2_7b(**overrides) -> PretrainConfig:
    """Llama 2 7B's shape: 32 x 4096, 32 heads, SwiGLU 11008, 32,000 vocab, untied."""
    return _config(
        overrides,
        vocab_size=32000,
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
    )
