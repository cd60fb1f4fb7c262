"""`PretrainConfig`: a `LlamaConfig` with per-layer sliding windows.

The config is a strict subclass of `transformers.LlamaConfig`, so every Llama field keeps its
meaning and a checkpoint of a model without windows loads with plain `LlamaForCausalLM`. It adds:

- `window_pattern`: a string of `S` (sliding window) and `L` (full attention) tiled over the layers,
  nanochat style (`"SSSL"` = three windowed layers then one full). The last layer is always full so
  the final representation sees the whole context. `"L"` means no windows.
- `sliding_window`: the window size in tokens for `S` layers. A query at position i sees keys j with
  i - sliding_window < j <= i (the window includes the query itself), the convention of
  transformers' masking utilities and of Mistral/Ministral checkpoints.
- `layer_types`: derived from the two above (`"sliding_attention"` / `"full_attention"` per layer),
  the field transformers' mask builders and `DynamicCache` read. It is never set by hand.

- `attention_backend`: `"auto"` (default: per layer type, the fastest kernel installed here that
  can do what the layer needs, see `attention.py`) or one of `flash_attention_3`,
  `flash_attention_2`, `flex_attention`, `sdpa`, `eager` for every layer. Passing transformers'
  `attn_implementation=` to `from_pretrained`/`from_config` sets it too.

`tie_word_embeddings` defaults to False (untied input and output embeddings).
"""

from __future__ import annotations

from huggingface_hub.dataclasses import strict
from transformers import LlamaConfig
from transformers.activations import ACT2FN

from .attention import BACKENDS

WINDOW_LETTERS = {"S": "sliding_attention", "L": "full_attention"}


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _reject(field: str, value: object, allowed: str) -> None:
    raise ValueError(f"PretrainConfig.{field}={value!r} is invalid: {allowed}.")


def layer_types_from_pattern(window_pattern: str, num_layers: int) -> list[str]:
    """Tile `window_pattern` over `num_layers`; the last layer is always full attention."""
    tiled = (window_pattern * (num_layers // len(window_pattern) + 1))[:num_layers]
    letters = tiled[:-1] + "L"
    return [WINDOW_LETTERS[letter] for letter in letters]


@strict
class PretrainConfig(LlamaConfig):
    model_type = "hf_pretrain"

    vocab_size: int = 32000
    tie_word_embeddings: bool = False
    window_pattern: str = "L"
    sliding_window: int | None = 1024
    layer_types: list[str] | None = None
    attention_backend: str = "auto"

    def __post_init__(self, **kwargs):
        self._check_shapes()
        self._check_windows()
        self.layer_types = layer_types_from_pattern(self.window_pattern, self.num_hidden_layers)
        super().__post_init__(**kwargs)

    def _check_shapes(self) -> None:
        positive = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
        for field in (*positive, "max_position_embeddings"):
            if not _positive_int(getattr(self, field)):
                _reject(field, getattr(self, field), "it must be a positive integer")
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

    def validate_architecture(self):
        self._check_shapes()
        self._check_windows()

    def to_dict(self) -> dict:
        out = super().to_dict()
        out.pop("_attention_request_seen", None)  # bookkeeping of the model's init, not a setting
        return out

    @property
    def window_sizes(self) -> list[int | None]:
        """Per-layer window in tokens (None for full attention)."""
        return [self.sliding_window if t == "sliding_attention" else None for t in self.layer_types]
