"""Mixture-of-experts MLP: a top-k softmax router over SwiGLU experts, optional capacity, aux losses.

`PretrainMoE` replaces the SwiGLU MLP of the layers `PretrainConfig.mlp_layer_types` marks `"sparse"`. Per token x:

    logits = x W_r^T                      router, no bias, computed in fp32 (autocast off)
    p      = softmax(logits)              over the E experts
    w, e   = top-k(p)                     k experts per token; w / sum(w) when norm_topk_prob
    y      = sum_j w_j SwiGLU_{e_j}(x)    SwiGLU_e(x) = down_e(silu(gate_e x) * up_e x)

the math of transformers' Mixtral and Qwen2-MoE, with their parameter names and layouts (`mlp.gate.weight`,
`mlp.experts.gate_up_proj`, `mlp.experts.down_proj`), so `export_hf` copies the tensors by name. The forward is
written here because transformers' experts modules route every (token, expert) pair (no capacity) and have no
z-loss, expert load or dropped count. Dispatch is vectorised: pairs sorted by expert once, two matmuls per expert
on its slice, `index_add_` back; the only loop is over experts. Capacity (`moe_capacity_factor=c`): at most
ceil(c x T x k / E) pairs per expert and forward, first choices first, then token order (GShard); a dropped
pair adds nothing. `routing_statistics`: the Switch load-balancing loss (1.0 for a uniform router, E / k
collapsed), the ST-MoE router z-loss, the expert load and the dropped fraction. Details: docs/moe.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers.activations import ACT2FN
from transformers.modeling_outputs import MoeCausalLMOutputWithPast


def route(router_logits: torch.Tensor, top_k: int, norm_topk_prob: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights, experts) of shape (T, k): softmax over experts in fp32, top-k, optionally renormalised."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
    """Token slots per expert: ceil(capacity_factor x tokens x k / experts)."""
    return math.ceil(capacity_factor * num_tokens * top_k / num_experts)


def expert_counts(experts: torch.Tensor, num_bins: int) -> torch.Tensor:
    """Pairs per expert id: `bincount` with a shape known before the data (torch.compile traces it, no break)."""
    flat = experts.reshape(-1)
    return torch.zeros(num_bins, dtype=flat.dtype, device=flat.device).index_add_(0, flat, torch.ones_like(flat))


def capacity_mask(experts: torch.Tensor, num_experts: int, capacity: int) -> torch.Tensor:
    """(T, k) bool: which (token, expert) pairs fit in their expert's `capacity` slots.

    Priority: all top-1 pairs in token order, then all top-2 pairs, ... A stable sort by expert of
    the pairs in that order gives each pair its position in its expert's queue, without a (T, E)
    one-hot.
    """
    num_tokens, top_k = experts.shape
    flat = experts.t().reshape(-1)  # choice-major: every token's first choice comes first
    order = torch.argsort(flat, stable=True)
    counts = expert_counts(flat, num_experts)
    starts = torch.cumsum(counts, 0) - counts
    position = torch.empty_like(flat)
    position[order] = torch.arange(flat.numel(), device=flat.device) - starts[flat[order]]
    return (position < capacity).view(top_k, num_tokens).t()


class PretrainRouter(nn.Module):
    """Linear router without bias (`weight`: experts x hidden), run in fp32 for stable softmax and top-k."""

    def __init__(self, config):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        with torch.autocast(hidden_states.device.type, enabled=False):
            return F.linear(hidden_states.float(), self.weight.float())


class PretrainExperts(nn.Module):
    """E SwiGLU experts as 3D tensors (transformers' layout): `gate_up_proj` (E, 2I, H), `down_proj` (E, H, I)."""

    def __init__(self, config):
        super().__init__()
        self.num_experts = config.num_experts
        size = config.moe_intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(config.num_experts, 2 * size, config.hidden_size))
        self.down_proj = nn.Parameter(torch.empty(config.num_experts, config.hidden_size, size))
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, hidden_states: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """hidden_states (T, H); experts, weights (T, k), expert id `num_experts` marking a dropped pair."""
        num_tokens, top_k = experts.shape
        flat = experts.reshape(-1)
        order = torch.argsort(flat, stable=True)  # pairs grouped by expert, dropped pairs (id E) last
        sizes = expert_counts(flat, self.num_experts + 1)[: self.num_experts].tolist()  # the one host sync
        kept = order[: sum(sizes)]
        tokens = kept // top_k
        inputs = hidden_states[tokens]
        outputs = []
        for expert, chunk in enumerate(inputs.split(sizes)):  # an empty chunk costs an empty matmul, no branch
            gate, up = F.linear(chunk, self.gate_up_proj[expert]).chunk(2, dim=-1)
            outputs.append(F.linear(self.act_fn(gate) * up, self.down_proj[expert]))
        out = hidden_states.new_zeros(num_tokens, hidden_states.shape[-1])
        weighted = torch.cat(outputs) * weights.reshape(-1)[kept].unsqueeze(-1)
        return out.index_add_(0, tokens, weighted.to(out.dtype))


class PretrainMoE(nn.Module):
    """Router + experts for one layer; `forward` returns (output, router_logits of shape (tokens, E))."""

    def __init__(self, config):
        super().__init__()
        self.num_experts = config.num_experts
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.capacity_factor = config.moe_capacity_factor
        self.gate = PretrainRouter(config)
        self.experts = PretrainExperts(config)

    def forward(self, hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = hidden_states.shape
        flat = hidden_states.reshape(-1, shape[-1])
        router_logits = self.gate(flat)
        weights, experts = route(router_logits, self.top_k, self.norm_topk_prob)
        if self.capacity_factor is not None:
            capacity = expert_capacity(flat.shape[0], self.top_k, self.num_experts, self.capacity_factor)
            experts = experts.masked_fill(~capacity_mask(experts, self.num_experts, capacity), self.num_experts)
        out = self.experts(flat, experts, weights.to(flat.dtype))
        return out.view(shape), router_logits


@dataclass
class RoutingStatistics:
    """Per forward, averaged over MoE layers: aux and z losses (with grad), load and drops (detached)."""

    aux_loss: torch.Tensor
    z_loss: torch.Tensor
    expert_load: torch.Tensor  # (MoE layers, E): fraction of routed pairs per expert, rows sum to 1
    dropped: torch.Tensor  # dropped (token, expert) pairs, all layers
    routed: torch.Tensor  # routed pairs, all layers

    @property
    def dropped_fraction(self) -> torch.Tensor:
        return self.dropped / self.routed.clamp(min=1)


def routing_statistics(
    router_logits: tuple[torch.Tensor, ...] | list[torch.Tensor],
    top_k: int,
    norm_topk_prob: bool = True,
    capacity_factor: float | None = None,
    token_mask: torch.Tensor | None = None,
    group=None,
) -> RoutingStatistics:
    """Load-balancing loss, z-loss, expert load and drops from each MoE layer's router logits (tokens, E).

    `token_mask` (tokens,) leaves padding out of the losses and the load (capacity counts every token,
    as the layers do). The top-k and capacity decisions are recomputed with the layers' own functions,
    so they are the ones the forward made.

    `group`: a process group whose ranks hold parts of the same rows (Ulysses sequence parallelism: each rank a
    shard of every row). The load-balancing loss is then the whole rows' one: each layer's expert counts, router
    probabilities and token count are summed over the group (two all-reduces a forward, all layers stacked; the
    probabilities' one is differentiable, so each rank's router gets the whole loss's gradient). Without it each
    shard's loss would be its own, not the one process's (training/sequence_parallel.py). The z-loss, a mean over
    the tokens, is summed with the probabilities: the caller weights a shard by its share of the *labelled* tokens,
    and packed documents leave the shards different shares of unlabelled ones (measured: 8.9e-5 off the one process
    within 6 steps with the z-loss per shard, 0 with it summed).
    """
    counts, prob_sums, z_sums, reals, dropped, routed = [], [], [], [], [], []
    for logits in router_logits:
        num_tokens, num_experts = logits.shape
        logits = logits.float()
        _, experts = route(logits, top_k, norm_topk_prob)
        probs = torch.softmax(logits, dim=-1)
        mask = torch.ones(num_tokens, device=logits.device) if token_mask is None else token_mask.float()
        real = mask.sum()
        with torch.no_grad():
            counts.append(
                torch.zeros(num_experts, device=logits.device).index_add_(
                    0, experts.reshape(-1), mask.repeat_interleave(top_k)
                )
            )
            if capacity_factor is not None:
                capacity = expert_capacity(num_tokens, top_k, num_experts, capacity_factor)
                dropped.append((~capacity_mask(experts, num_experts, capacity)).sum())
            else:
                dropped.append(torch.zeros((), dtype=torch.long, device=logits.device))
            routed.append(torch.tensor(num_tokens * top_k, device=logits.device))
        prob_sums.append((probs * mask.unsqueeze(-1)).sum(0))
        reals.append(real.detach())
        z_sums.append((torch.logsumexp(logits, dim=-1).square() * mask).sum())
    counts, reals = torch.stack(counts), torch.stack(reals)
    sums = torch.cat((torch.stack(prob_sums), torch.stack(z_sums).unsqueeze(-1)), dim=-1)  # (layers, E + 1)
    if group is not None:
        from torch.distributed.nn.functional import all_reduce  # differentiable: the gradient summed back

        totals = torch.cat((counts, reals.unsqueeze(-1)), dim=-1)
        torch.distributed.all_reduce(totals, group=group)
        counts, reals = totals[:, :-1], totals[:, -1]
        sums = all_reduce(sums, group=group)
    real = reals.clamp(min=1).unsqueeze(-1)
    loads = counts / (real * top_k)
    means = sums / real  # mean router probability per expert, then the mean squared log-sum-exp
    aux = num_experts * (loads * means[:, :-1]).sum(-1)
    return RoutingStatistics(
        aux_loss=aux.mean(),
        z_loss=means[:, -1].mean(),
        expert_load=loads,
        dropped=torch.stack(dropped).sum(),
        routed=torch.stack(routed).sum(),
    )


class MoEMetrics:
    """Running sums since the last `pop()`, kept on the device (no host sync per step); `MoECallback` pops them.

    The forward count is a tensor and the sums are updated in place, so a compiled forward (torch.compile of the
    whole model) traces `add` without a graph break and without recompiling at every step (an int counter would be
    a new constant each step); the empty state after a `pop` is the one other traced case.
    """

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self._sums: dict[str, torch.Tensor] | None = None

    @property
    def forwards(self) -> int:
        return 0 if self._sums is None else int(self._sums["forwards"].item())

    def add(self, stats: RoutingStatistics) -> None:
        values = {
            "aux": stats.aux_loss.detach(),
            "z": stats.z_loss.detach(),
            "load": stats.expert_load.detach(),
            "dropped": stats.dropped.detach().double(),
            "routed": stats.routed.detach().double(),
            "forwards": torch.ones((), dtype=torch.long, device=stats.aux_loss.device),
        }
        if self._sums is None:
            self._sums = {key: value.clone() for key, value in values.items()}
            return
        for key, value in values.items():
            self._sums[key].add_(value)

    def pop(self, per_layer: bool = False) -> dict[str, float]:
        """Means over the forwards since the last pop (empty when there were none), then reset."""
        n, sums = self.forwards, self._sums
        if not n:
            return {}
        load = (sums["load"] / n).tolist()  # (MoE layers, E)
        metrics = {
            "moe_aux_loss": (sums["aux"] / n).item(),
            "moe_z_loss": (sums["z"] / n).item(),
            "moe_expert_load_max": max(max(row) for row in load),
            "moe_expert_load_min": min(min(row) for row in load),
            "moe_dropped_fraction": (sums["dropped"] / sums["routed"].clamp(min=1)).item(),
        }
        if per_layer:
            for i, row in enumerate(load):
                metrics[f"moe_expert_load_max_layer{i}"] = max(row)
                metrics[f"moe_expert_load_min_layer{i}"] = min(row)
        self.last_expert_load = load
        self.reset()
        return metrics


@dataclass
class PretrainMoeCausalLMOutput(MoeCausalLMOutputWithPast):
    """`MoeCausalLMOutputWithPast` (loss, aux_loss, logits, cache, router_logits, ...) plus:

    z_loss: router z-loss averaged over MoE layers; expert_load: (MoE layers, E) fraction of routed
    pairs per expert; dropped_fraction: dropped (token, expert) pairs / routed pairs (0 when dropless).
    """

    z_loss: torch.Tensor | None = None
    expert_load: torch.Tensor | None = None
    dropped_fraction: torch.Tensor | None = None
