"""`PretrainConfig`: a `LlamaConfig` with per-layer sliding windows, optional mixture of experts and the chunked loss.

A strict subclass of `transformers.LlamaConfig`: every Llama field keeps its meaning, and a model without windows
loads with plain `LlamaForCausalLM`. It adds:
- `window_pattern` (`S` windowed / `L` full, tiled over the layers, nanochat style; the last layer always full)
  and `sliding_window` (a query at i sees i - sliding_window < j <= i, transformers' convention), from which
  `layer_types` is derived (never set by hand): the field transformers' mask builders and `DynamicCache` read;
- `attention_backend`: `"auto"` (per layer type, the fastest kernel installed here, `attention.py`) or one
  kernel for every layer (transformers' `attn_implementation=` sets it too);
- `chunked_loss` (default True): training forwards with labels never hold the [tokens, vocab] logits (`loss.py`);
- mixture of experts (`num_experts > 0`; `moe.py`): top-k, which layers (`moe_every` or `moe_layer_fraction`,
  derived into `mlp_layer_types`), expert width, capacity, `norm_topk_prob`, the aux / z-loss weights.
`tie_word_embeddings` defaults to False. Invalid values raise an error naming the field and the fix. Every
field: docs/model.md and docs/moe.md.
"""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers import AutoConfig, LlamaConfig
from transformers.activations import ACT2FN

from .accounting import layer_windows
from .attention import BACKENDS

WINDOW_LETTERS = {"S": "sliding_attention", "L": "full_attention"}


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _reject(field: str, value: object, allowed: str) -> None:
    raise ValueError(f"PretrainConfig.{field}={value!r} is invalid: {allowed}.")


def moe_layer_indices(num_layers: int, moe_every: int = 1, moe_layer_fraction: float | None = None) -> list[int]:
    """Indices of the MoE layers: every `moe_every`-th layer, or `moe_layer_fraction` of them spread evenly."""
    if moe_layer_fraction is not None:
        count = max(1, int(moe_layer_fraction * num_layers + 0.5))
        return [-(-(j + 1) * num_layers // count) - 1 for j in range(count)]  # ceil((j + 1) L / n) - 1
    return [i for i in range(num_layers) if (i + 1) % moe_every == 0]


def layer_types_from_pattern(window_pattern: str, num_layers: int) -> list[str]:
    """Tile `window_pattern` over `num_layers`; the last layer is always full attention."""
    tiled = (window_pattern * (num_layers // len(window_pattern) + 1))[:num_layers]
    letters = tiled[:-1] + "L"
    return [WINDOW_LETTERS[letter] for letter in letters]


@strict
class PretrainConfig(LlamaConfig):
    model_type = "hf_pretrain"
    # Output fields that are not predictions (Trainer.prediction_step leaves them out of the logits it gathers).
    keys_to_ignore_at_inference = ["cache", "aux_loss", "z_loss", "router_logits", "expert_load", "dropped_fraction"]

    vocab_size: int = 32000
    tie_word_embeddings: bool = False
    window_pattern: str = "L"
    sliding_window: int | None = 1024
    layer_types: list[str] | None = None
    attention_backend: str = "auto"
    num_experts: int = 0
    num_experts_per_tok: int = 2
    moe_intermediate_size: int | None = None
    moe_every: int = 1
    moe_layer_fraction: float | None = None
    moe_capacity_factor: float | None = None
    norm_topk_prob: bool = True
    router_aux_loss_coef: float = 0.01
    router_z_loss_coef: float = 0.001
    chunked_loss: bool = True

    def __post_init__(self, **kwargs):
        self._check_shapes()
        self._check_windows()
        if self.moe_intermediate_size is None:
            self.moe_intermediate_size = self.intermediate_size
        self._check_moe()
        self.layer_types = layer_types_from_pattern(self.window_pattern, self.num_hidden_layers)
        super().__post_init__(**kwargs)

    def _check_shapes(self) -> None:
        positive = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        for field in (*positive, "max_position_embeddings"):
            if not _positive_int(getattr(self, field)):
                _reject(field, getattr(self, field), "it must be a positive integer")
        if not isinstance(self.chunked_loss, bool):
            _reject(
                "chunked_loss", self.chunked_loss, "use True (the loss without the full logits in training) or False"
            )
        if self.head_dim is not None and not _positive_int(self.head_dim):
            _reject(
                "head_dim", self.head_dim, "it must be a positive integer (or None: hidden_size // num_attention_heads)"
            )
        if self.hidden_act not in ACT2FN:
            _reject("hidden_act", self.hidden_act, "use one of transformers' activations, e.g. 'silu' (SwiGLU), 'gelu'")
        if not self.rms_norm_eps > 0:
            _reject("rms_norm_eps", self.rms_norm_eps, "it must be > 0, e.g. 1e-6")
        if not 0 <= self.attention_dropout < 1:
            _reject("attention_dropout", self.attention_dropout, "it must be in [0, 1)")
        if self.head_dim is None and self.hidden_size % self.num_attention_heads:
            divisors = [h for h in range(1, self.hidden_size + 1) if self.hidden_size % h == 0 and h <= 128]
            _reject(
                "num_attention_heads",
                self.num_attention_heads,
                f"it must divide hidden_size={self.hidden_size} (e.g. one of {divisors[-6:]}), or set head_dim",
            )
        kv_heads = self.num_key_value_heads
        if kv_heads is not None and (kv_heads <= 0 or self.num_attention_heads % kv_heads):
            allowed = [k for k in range(1, self.num_attention_heads + 1) if self.num_attention_heads % k == 0]
            _reject("num_key_value_heads", kv_heads, f"it must divide num_attention_heads; allowed: {allowed}")

    def _check_windows(self) -> None:
        pattern = self.window_pattern
        if not isinstance(pattern, str) or not pattern or set(pattern) - set(WINDOW_LETTERS):
            _reject(
                "window_pattern",
                pattern,
                "use a non-empty string of 'S' (sliding window) and 'L' (full), e.g. 'SSSL' or 'L'",
            )
        if ("S" in pattern or self.sliding_window is not None) and not _positive_int(self.sliding_window):
            _reject(
                "sliding_window",
                self.sliding_window,
                "it must be a positive integer number of tokens (None is allowed only without 'S' in window_pattern)",
            )
        if self.attention_backend not in ("auto", *BACKENDS):
            _reject("attention_backend", self.attention_backend, f"use 'auto' or one of {list(BACKENDS)}")
        expected = layer_types_from_pattern(pattern, self.num_hidden_layers)
        if self.layer_types is not None and list(self.layer_types) != expected:
            _reject(
                "layer_types",
                self.layer_types,
                f"it is derived from window_pattern={pattern!r}; leave it unset (expected {expected})",
            )

    def _check_moe(self) -> None:
        if not isinstance(self.num_experts, int) or isinstance(self.num_experts, bool) or self.num_experts < 0:
            _reject(
                "num_experts", self.num_experts, "it must be 0 (dense MLPs) or a positive number of experts, e.g. 8"
            )
        if not self.num_experts:
            for field in ("moe_layer_fraction", "moe_capacity_factor"):
                if getattr(self, field) is not None:
                    _reject(
                        field,
                        getattr(self, field),
                        "it applies to MoE layers only: set num_experts > 0 or leave it None",
                    )
            return
        k = self.num_experts_per_tok
        if not _positive_int(k) or k > self.num_experts:
            _reject(
                "num_experts_per_tok",
                k,
                f"top-k must be a positive integer <= num_experts={self.num_experts}; lower it or raise num_experts",
            )
        if not _positive_int(self.moe_intermediate_size):
            _reject("moe_intermediate_size", self.moe_intermediate_size, "it must be a positive integer (or None)")
        if not _positive_int(self.moe_every) or self.moe_every > self.num_hidden_layers:
            _reject(
                "moe_every",
                self.moe_every,
                f"it must be a positive integer <= num_hidden_layers={self.num_hidden_layers} "
                "(1: every layer is MoE, 2: every second layer)",
            )
        fraction = self.moe_layer_fraction
        if fraction is not None:
            if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 < fraction <= 1:
                _reject(
                    "moe_layer_fraction", fraction, "it must be in (0, 1], e.g. 0.1 for 10 % of the layers, or None"
                )
            if self.moe_every != 1:
                _reject("moe_layer_fraction", fraction, f"set either moe_every={self.moe_every} or moe_layer_fraction")
        capacity = self.moe_capacity_factor
        if capacity is not None and (
            isinstance(capacity, bool) or not isinstance(capacity, (int, float)) or not capacity > 0
        ):
            _reject("moe_capacity_factor", capacity, "it must be > 0 (e.g. 1.25), or None for dropless routing")
        for field in ("router_aux_loss_coef", "router_z_loss_coef"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                _reject(field, value, "it must be >= 0 (0 turns the loss off)")
        if self.mlp_bias:
            _reject("mlp_bias", self.mlp_bias, "experts have no biases; set mlp_bias=False for an MoE model")

    def validate_architecture(self):
        self._check_shapes()
        self._check_windows()
        self._check_moe()

    @property
    def window_sizes(self) -> list[int | None]:
        """Per-layer window in tokens (None for full attention): `accounting.layer_windows`."""
        return layer_windows(self)

    @property
    def mlp_layer_types(self) -> list[str]:
        """Per layer, `"sparse"` (MoE) or `"dense"` (SwiGLU MLP); all dense when num_experts == 0."""
        if not self.num_experts:
            return ["dense"] * self.num_hidden_layers
        sparse = set(moe_layer_indices(self.num_hidden_layers, self.moe_every, self.moe_layer_fraction))
        return ["sparse" if i in sparse else "dense" for i in range(self.num_hidden_layers)]


AutoConfig.register(PretrainConfig.model_type, PretrainConfig)  # AutoConfig.from_pretrained reads our checkpoints
