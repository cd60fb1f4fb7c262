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
`--goodput-from RUN` takes both from a run's goodput (`telemetry/goodput.py`, its last log): `C` the stall per
save, `M` its wall time per restart when it had any (a run with none says nothing about failures: the default
stays). A flag given explicitly wins over the run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from ..report.goodput import last_goodput
from ..telemetry.jsonl import read_jsonl

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


@dataclass(frozen=True)
class RunResilience:
    """What a run's goodput measured: its saves and their stall, its restarts over its wall time."""

    run: str
    saves: int
    checkpoint_s: float
    restarts: int
    wall_s: float

    @property
    def stall_s(self) -> float | None:
        return self.checkpoint_s / self.saves if self.saves else None

    @property
    def mtbf_hours(self) -> float | None:
        return self.wall_s / self.restarts / 3600 if self.restarts else None


def run_resilience(run_dir: str | Path) -> RunResilience:
    """A run's goodput counters, from the last log of its telemetry.jsonl that carries them."""
    last = last_goodput(read_jsonl(run_dir))
    if last is None:
        raise ValueError(
            f"--goodput-from {run_dir}: no goodput in its telemetry.jsonl (a run logs it with telemetry on, at each "
            "logging step): give a run directory that trained with telemetry, or --checkpoint-seconds/--mtbf-hours."
        )
    return RunResilience(
        str(run_dir),
        int(last.get("goodput_saves", 0)),
        float(last.get("goodput_checkpoint_s", 0.0)),
        int(last.get("goodput_restarts", 0)),
        float(last["goodput_wall_s"]),
    )


def checkpoint_plan(
    state_bytes: int,
    gpus: int,
    checkpoint_seconds: float | None = None,
    mtbf_hours: float | None = None,
    measured: RunResilience | None = None,
) -> CheckpointPlan:
    """The defaults, then what `measured` measured, then the flags given: each later one wins."""
    stall = state_bytes / STAGING_BYTES_PER_S
    stall_source = f"{state_bytes / 2**30:.1f} GiB staged per GPU at {STAGING_BYTES_PER_S / 1e9:g} GB/s (async save)"
    mtbf = 1 / (LLAMA3_FAILURES_PER_GPU_HOUR * gpus)
    mtbf_source = f"Llama 3's failure rate over {gpus} GPU{'s' if gpus > 1 else ''}"
    if measured is not None and measured.stall_s is not None:
        stall = measured.stall_s
        stall_source = f"measured in {measured.run} ({measured.saves} saves, {stall:.2f} s each)"
    if measured is not None and measured.mtbf_hours is not None:
        mtbf = measured.mtbf_hours
        restarts = f"{measured.restarts} restart{'s' if measured.restarts > 1 else ''}"
        mtbf_source = f"measured in {measured.run} ({restarts} in {measured.wall_s / 3600:.2f} h)"
    if checkpoint_seconds is not None:
        stall, stall_source = checkpoint_seconds, "--checkpoint-seconds"
    if mtbf_hours is not None:
        mtbf, mtbf_source = mtbf_hours, "--mtbf-hours"
    interval = math.sqrt(2 * stall * mtbf * 3600)
    return CheckpointPlan(stall, stall_source, mtbf, mtbf_source, interval)
