"""How often a planned run checkpoints: Young's rule from the stall of one save and the time between failures.

Young (1974) / Daly (2006): with a checkpoint costing the run `C` seconds and failures arriving every `M` seconds
on average, the interval that loses the least time is about `sqrt(2 C M)` (Daly's refinement subtracts `C`,
negligible while `C << M`); the share of the run lost is then about `C / interval + interval / (2 M)` (the saves,
and on average half an interval of work redone per failure), plus the relaunch time per failure.
- `C`: the training loop's stall of one asynchronous save: the state one rank stages (its weights and optimizer
  states, from the memory estimate) at the bandwidth of a copy into pinned host memory, `STAGING_BYTES_PER_S`, or
  the measured stall (`--checkpoint-seconds`: the stall per save `hf-pretrain report` prints, from `goodput_saves`).
- `M`: the job's mean time between failures: `--mtbf-hours`, or the failure rate per GPU of Llama 3's pretraining
  (419 unexpected interruptions in 54 days on 16,384 H100s, Meta 2024) divided by the run's GPUs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

LLAMA3_FAILURES_PER_GPU_HOUR = 419 / (54 * 24 * 16384)  # arXiv 2407.21783, section 3.3.4
# torchtitan's asynchronous DCP save with pinned memory staged an 8B model's sharded state (~16 GB per GPU with
# AdamW over 8 GPUs) in under a second (field notes): about 16 GB/s into pinned host memory.
STAGING_BYTES_PER_S = 16e9
SOURCE = (
    "Young 1974 / Daly 2006: interval = sqrt(2 x save stall x MTBF); failures per GPU-hour from Llama 3's "
    "pretraining (419 unexpected interruptions in 54 days on 16,384 H100s, arXiv 2407.21783)"
)


@dataclass(frozen=True)
class CheckpointPlan:
    stall_s: float
    stall_source: str
    mtbf_hours: float
    mtbf_source: str
    interval_s: float

    @property
    def lost_share(self) -> float:
        """The share of the run lost to saves and to work redone after failures (relaunches not counted)."""
        mtbf_s = self.mtbf_hours * 3600
        return self.stall_s / self.interval_s + self.interval_s / (2 * mtbf_s)


def checkpoint_plan(
    state_bytes: int, gpus: int, checkpoint_seconds: float | None = None, mtbf_hours: float | None = None
) -> CheckpointPlan:
    if checkpoint_seconds is not None:
        stall, stall_source = checkpoint_seconds, "--checkpoint-seconds"
    else:
        stall = state_bytes / STAGING_BYTES_PER_S
        stall_source = (
            f"{state_bytes / 2**30:.1f} GiB staged per GPU at {STAGING_BYTES_PER_S / 1e9:g} GB/s (async save)"
        )
    if mtbf_hours is not None:
        mtbf, mtbf_source = mtbf_hours, "--mtbf-hours"
    else:
        mtbf = 1 / (LLAMA3_FAILURES_PER_GPU_HOUR * gpus)
        mtbf_source = f"Llama 3's failure rate over {gpus} GPU{'s' if gpus > 1 else ''}"
    interval = math.sqrt(2 * stall * mtbf * 3600)
    return CheckpointPlan(stall, stall_source, mtbf, mtbf_source, interval)
