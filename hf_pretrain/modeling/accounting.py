"""The one accounting of a model's shape: head_dim, per-layer windows, parameter counts, FLOPs per token.

Everything here is arithmetic on a config (no model is built, no torch), so it prices a 7B on a
laptop; the model, the attention planner, telemetry (MFU), the preflight, the memory estimator and
the planner all call it instead of recounting.

Shape. `head_dim` is the config's, else hidden_size / heads; KV heads default to the query heads.
`layer_windows` is each layer's attention window in tokens (None: full causal attention), from
`layer_types` and `sliding_window` (transformers' convention, which PretrainConfig derives from
`window_pattern`); a config without `layer_types` (plain Llama) has no windows. `mlp_kinds` is
`"dense"` / `"sparse"` (MoE) per layer, from `mlp_layer_types`, else every layer sparse when the
config has experts (Mixtral-like), else dense.

Parameters. `count_parameters` is every weight of `PretrainForCausalLM(config)` (norm scales and
biases, all experts, a tied LM head once); `matmul_parameters` the weights a token's matmuls go
through, the N of 6N.

Training FLOPs per token = 6 x matmul parameters + attention, where
- matmul parameters are q/k/v/o and the three SwiGLU projections of each block, and the LM head.
  The input embedding is a lookup, not a matmul, so it is not counted (a tied head is counted once,
  as the head). MoE: active parameters. An MoE layer's MLP term is its router (E x d) plus the k
  experts a token goes through (k x 3 x d x moe_intermediate_size), not all E experts. Dropped
  (token, expert) pairs under a capacity factor are still counted: the formula prices the model,
  not the luck of the routing.
- attention = 12 x head_dim x heads x (keys attended) per layer: QK^T and AV, 2 FLOPs per
  multiply-add, forward + backward (x3). "Keys attended" is the mean number of keys a query
  really sees with an exact kernel: (T + 1) / 2 for a causal layer of context T, and
  mean(min(i + 1, W)) for a window of W tokens. A kernel that computes a dense T x T score matrix
  (SDPA with an explicit mask, eager) does T keys per query; `keys_per_layer` lets callers price
  that waste.
This counts useful work: masked-out scores are never "model FLOPs", so MFU computed from it does
not flatter a kernel that wastes them.
"""

from __future__ import annotations

from collections.abc import Sequence

FULL, SLIDING = "full_attention", "sliding_attention"  # transformers' layer types


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def attention_widths(config) -> tuple[int, int]:
    """(q, k): the output widths of the query projection and of each of the key / value projections."""
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return config.num_attention_heads * head_dim(config), kv_heads * head_dim(config)


def layer_windows(config) -> list[int | None]:
    """Per layer, the window in tokens of a sliding-window layer, None for full attention."""
    types = getattr(config, "layer_types", None) or [FULL] * config.num_hidden_layers
    return [config.sliding_window if t == SLIDING else None for t in types]


def mlp_kinds(config) -> list[str]:
    """Per layer, `"sparse"` (MoE) or `"dense"` (SwiGLU MLP)."""
    kinds = getattr(config, "mlp_layer_types", None)
    if kinds:
        return list(kinds)
    return ["sparse" if getattr(config, "num_experts", 0) else "dense"] * config.num_hidden_layers


def _attention_matmuls(config) -> int:
    h, (q, k) = config.hidden_size, attention_widths(config)
    return h * q + 2 * h * k + q * h


def _expert_width(config) -> int:
    return getattr(config, "moe_intermediate_size", None) or config.intermediate_size


def layer_parameters(config, kind: str = "dense") -> int:
    """Weights of one decoder layer: q/k/v/o, the three SwiGLU projections (all experts and the router for an
    MoE layer), two RMSNorm scales (and biases)."""
    h, inter = config.hidden_size, config.intermediate_size
    q, k = attention_widths(config)
    attention = _attention_matmuls(config) + (q + 2 * k + h if getattr(config, "attention_bias", False) else 0)
    if kind == "sparse":
        mlp = h * config.num_experts + config.num_experts * 3 * h * _expert_width(config)
    else:
        mlp = 3 * h * inter + (2 * inter + h if getattr(config, "mlp_bias", False) else 0)
    return attention + mlp + 2 * h


def count_parameters(config) -> int:
    """Parameters of `PretrainForCausalLM(config)` from its shape alone (a tied LM head is counted once)."""
    embeddings = config.vocab_size * config.hidden_size * (1 if config.tie_word_embeddings else 2)
    return sum(layer_parameters(config, kind) for kind in mlp_kinds(config)) + embeddings + config.hidden_size


def matmul_parameters(config) -> int:
    """Weights that take part in a matmul for each token: attention and MLP projections (active experts), LM head."""
    d = config.hidden_size
    dense_mlp = 3 * d * config.intermediate_size
    per_kind = {"dense": dense_mlp}
    if getattr(config, "num_experts", 0):
        per_kind["sparse"] = d * config.num_experts + config.num_experts_per_tok * 3 * d * _expert_width(config)
    mlp = sum(per_kind[kind] for kind in mlp_kinds(config))
    return config.num_hidden_layers * _attention_matmuls(config) + mlp + d * config.vocab_size


def mean_keys_per_query(seq_len: int, window: int | None = None) -> float:
    """Mean keys a causal query attends over a context of `seq_len` (at most `window` of them)."""
    if window is None or window >= seq_len:
        return (seq_len + 1) / 2
    # positions 0..W-1 see 1..W keys, the remaining T-W positions see W keys each
    return (window * (window + 1) / 2 + (seq_len - window) * window) / seq_len


def attention_flops_per_token(config, seq_len: int, keys_per_layer: Sequence[float] | None = None) -> float:
    """Attention FLOPs per token (forward + backward) summed over layers; windows honoured per layer."""
    if keys_per_layer is None:
        keys_per_layer = [mean_keys_per_query(seq_len, w) for w in layer_windows(config)]
    return 12 * config.num_attention_heads * head_dim(config) * sum(keys_per_layer)


def flops_per_token(config, seq_len: int, keys_per_layer: Sequence[float] | None = None) -> float:
    """Training FLOPs per token: 6 x matmul parameters + attention."""
    return 6 * matmul_parameters(config) + attention_flops_per_token(config, seq_len, keys_per_layer)
