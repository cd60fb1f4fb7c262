"""The one FLOPs-per-token formula of hf_pretrain (MFU, trial, doctor and planners all call it).

Training FLOPs per token = 6 x matmul parameters + attention, where
- matmul parameters are the weights of every matrix multiply a token goes through: q/k/v/o and the
  three SwiGLU projections of each block, and the LM head. The input embedding is a lookup, not a
  matmul, so it is not counted (a tied head is counted once, as the head).
  MoE (`num_experts > 0`): active parameters. An MoE layer's MLP term is its router (E x d) plus
  the k experts a token goes through (k x 3 x d x moe_intermediate_size), not all E experts;
  dense layers keep the SwiGLU term. Dropped (token, expert) pairs under a capacity factor are
  still counted: the formula prices the model, not the luck of the routing.
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


def matmul_parameters(config) -> int:
    """Weights that take part in a matmul for each token: attention and MLP projections, LM head."""
    d = config.hidden_size
    hd = getattr(config, "head_dim", None) or d // config.num_attention_heads
    q_out, kv_out = config.num_attention_heads * hd, config.num_key_value_heads * hd
    attention = d * q_out + 2 * d * kv_out + q_out * d
    mlp = 3 * d * config.intermediate_size
    total = config.num_hidden_layers * (attention + mlp) + d * config.vocab_size
    num_experts = getattr(config, "num_experts", 0) or 0
    if not num_experts:
        return total
    # MoE layers: mlp_layer_types (hf_pretrain), else every layer (Mixtral-like configs).
    kinds = getattr(config, "mlp_layer_types", None) or ["sparse"] * config.num_hidden_layers
    expert_width = getattr(config, "moe_intermediate_size", None) or config.intermediate_size
    active = d * num_experts + config.num_experts_per_tok * 3 * d * expert_width
    return total + kinds.count("sparse") * (active - mlp)


def mean_keys_per_query(seq_len: int, window: int | None = None) -> float:
    """Mean keys a causal query attends over a context of `seq_len` (at most `window` of them)."""
    if window is None or window >= seq_len:
        return (seq_len + 1) / 2
    # positions 0..W-1 see 1..W keys, the remaining T-W positions see W keys each
    return (window * (window + 1) / 2 + (seq_len - window) * window) / seq_len


def attention_flops_per_token(config, seq_len: int, keys_per_layer: Sequence[float] | None = None) -> float:
    """Attention FLOPs per token (forward + backward) summed over layers; windows honoured per layer."""
    if keys_per_layer is None:
        windows = getattr(config, "window_sizes", [None] * config.num_hidden_layers)  # plain Llama: all full
        keys_per_layer = [mean_keys_per_query(seq_len, w) for w in windows]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 12 * config.num_attention_heads * head_dim * sum(keys_per_layer)


def flops_per_token(config, seq_len: int, keys_per_layer: Sequence[float] | None = None) -> float:
    """Training FLOPs per token: 6 x matmul parameters + attention."""
    return 6 * matmul_parameters(config) + attention_flops_per_token(config, seq_len, keys_per_layer)
