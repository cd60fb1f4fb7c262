"""Data-parallel traffic across nodes: what ZeRO, FSDP2 and DDP send over the network per step, and what of it the
compute does not hide.

Only over several nodes and only with `--network-gbps` (GB/s each way, one GPU's share of the network: a node's
NICs over its GPUs). On one node this traffic rides NVLink and is in the MFU assumption, as before; without the
figure it is unavailable, not zero, and the plan says so.

Per GPU, with W and G the bytes of the weights and gradients the GPU holds whole (the recipe's 16-bit weights and
gradients, `BYTES_PER_PARAMETER`; under AutoTP its `tp_parameters`), and a ring over the n ranks that shard or
replicate them sending (n - 1) / n of each collective (the ring's slowest hop is the network, each GPU its NIC's
share):
- ZeRO-3 / FSDP2 (priced alike, as for memory): per *micro-step* the weights gathered in the forward and again in
  the backward, and the gradients reduce-scattered: 2 W + G. With checkpointing the recompute's gather serves the
  layer's backward (ds_configs/zero3.json's `stage3_max_reuse_distance` keeps weights about to be reused; FSDP2
  does not reshard a forward run inside the backward, `_fully_shard/_fsdp_param_group.post_forward`). n = all the
  GPUs (with Ulysses SP too: DeepSpeed shards over the sequence ranks as well).
- ZeRO-2: per micro-step the gradients reduce-scattered (DeepSpeed's stage 2 reduces every micro-step, engine.py
  `allreduce_gradients`), and per optimizer step the updated weights gathered: G, then W.
- ZeRO-1 (AutoTP's stage) and DDP: per optimizer step only, at the accumulation boundary: G + W (reduce-scatter,
  gather of the updated weights) or 2 G (all-reduce); n = the data-parallel groups (the GPUs / tp).

Overlap: a micro-step's traffic is prefetched and overlapped with that micro-step's compute (DeepSpeed's prefetch
and `overlap_comm`, FSDP2's prefetch), so only what exceeds the compute (its FLOPs at the MFU, the recompute
included) is added: `max(0, traffic - compute)`. The per-step traffic comes after the last backward (ZeRO-1 reduces
there, the gather follows the optimizer) and is added whole: conservative for DDP, which overlaps its buckets with
the last backward. The NVLink collectives (SP's all-to-all, AutoTP's all-reduce) stay on the critical path as the
planner prices them elsewhere, not counted as cover. The rate is the figure x `LINK_EFFICIENCY`, as for the link.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..distributed.memory import BYTES_PER_PARAMETER, tp_parameters

PER_MICRO_STEP = {"zero3": (2, 1), "fsdp2": (2, 1), "zero2": (0, 1)}  # (weight, gradient) passes a micro-step
PER_STEP = {"zero2": (1, 0), "zero1_tp": (1, 1), "ddp": (0, 2)}  # (weight, gradient) passes an optimizer step


@dataclass(frozen=True)
class Traffic:
    """Bytes one GPU sends over the network: per micro-step (overlapped with its compute) and per optimizer step
    (after the last backward, not overlapped); `ranks`: the ring's length."""

    micro_step: float
    step: float
    ranks: int

    def exposed_seconds(self, rate: float, micro_compute_s: float, accumulation: int) -> float:
        """Seconds of an optimizer step the compute does not hide, at `rate` bytes per second."""
        return accumulation * max(0.0, self.micro_step / rate - micro_compute_s) + self.step / rate


def data_parallel_traffic(config, strategy: str, precision: str, world: int, tp: int = 1) -> Traffic:
    """The `Traffic` of `strategy` (a planner strategy name) over `world` GPUs, AutoTP of `tp` inside the node."""
    ranks = world // tp
    weight, grad = BYTES_PER_PARAMETER[precision][:2]
    held = tp_parameters(config, tp)
    ring = (ranks - 1) / ranks
    w_micro, g_micro = PER_MICRO_STEP.get(strategy, (0, 0))
    w_step, g_step = PER_STEP.get(strategy, (0, 0))
    return Traffic(
        micro_step=(w_micro * weight + g_micro * grad) * held * ring,
        step=(w_step * weight + g_step * grad) * held * ring,
        ranks=ranks,
    )
