"""`StragglerCallback`: per-rank compute, wait and data wait; names the slow rank (and any under-clocked one).

Each rank measures, per optimizer step:
- compute: its own forward/backward work, summed over the micro-batches of the step
  (`PretrainTrainer.training_step` reports each one), where the last micro-batch ends when its
  last gradient bucket is ready to be reduced (a DDP communication hook stamps the buckets);
- wait: the rest of the step: blocked in collectives (the gradient all-reduce, the token-count
  gathers transformers does per micro-batch), plus fetching the accumulation's micro-batches;
- data wait: from the end of the previous optimizer step until this one starts (the data loader;
  it also holds that step's logging, evaluation or checkpointing when they ran).
Every `every` steps the ranks exchange the medians of their window with their SM clock, power,
utilization and memory (one small all_gather), and each rank gets a score = best rank's median
compute / its own. A rank below `threshold` (default 0.75) is a straggler:
"rank 1 (node-b) 1.9x slower, SM 600/2190 MHz, 30 W, no throttle flag; rank 0 waits 3.3 s of 7.2 s".
An under-clocked rank (the `underclock_warning` rule on its gathered reading) is reported by rank
0 as well, so a problem on any rank reaches the logs, `report_to`, the JSONL stream and the report.
Timestamps are taken on the host: exact on CPU/gloo; on GPUs they are launch times, so a slow GPU
shows up in `wait_s` of the others and in the step time more than in its own `compute_s`.

Logs at the next logging step after an exchange (rank 0's logs carry every rank):
`compute_s`, `wait_s`, `data_wait_s`, `step_s` (this rank's medians), `straggler_score_min`,
`rank{r}_compute_s`, `rank{r}_wait_s`, `rank{r}_data_wait_s`, `rank{r}_score`,
`rank{r}_sm_clock_mhz`, `rank{r}_power_w`, `rank{r}_memory_gib` (the last three where the device
exposes them), and when something fires: `straggler_warning` (text, the first since the previous
log), `straggler_warnings` (how many exchanges flagged one since then), `straggler_slowest_rank`,
and `underclock_warning` / `underclock_rank` for another rank's under-clock.

Test-only knob: `HF_PRETRAIN_TEST_SLOW_RANK="RANK:SECONDS"` makes that rank sleep SECONDS at the
start of every micro-batch, so the detector can be tested for real on CPU ranks.
"""

from __future__ import annotations

import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
from transformers.utils import logging

from ..callback import PretrainCallback
from .sensors import LIMITING_REASONS
from .underclock import underclock_warning

logger = logging.get_logger(__name__)

TIMES = ("compute_s", "wait_s", "data_wait_s", "step_s")
FIELDS = (*TIMES, "sm_clock_mhz", "sm_clock_max_mhz", "power_w", "utilization_pct", "memory_gib", "throttled")
SLOW_RANK_KNOB = "HF_PRETRAIN_TEST_SLOW_RANK"


def _secs(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds >= 1 else f"{seconds:.2f} s"


def straggler_report(rows: list[dict], hosts: list[str], threshold: float) -> tuple[dict, str | None]:
    """Scores per rank from each rank's medians; the warning text when one is below `threshold`."""
    best = min(r["compute_s"] for r in rows)
    metrics: dict[str, float | str] = {}
    for rank, row in enumerate(rows):
        metrics[f"rank{rank}_score"] = best / row["compute_s"] if row["compute_s"] > 0 else 1.0
        for key in ("compute_s", "wait_s", "data_wait_s"):
            metrics[f"rank{rank}_{key}"] = row[key]
        for key in ("sm_clock_mhz", "power_w", "memory_gib"):
            if row.get(key, -1) >= 0:
                metrics[f"rank{rank}_{key}"] = row[key]
    scores = [metrics[f"rank{r}_score"] for r in range(len(rows))]
    metrics["straggler_score_min"] = min(scores)
    slow = [r for r, s in enumerate(scores) if s < threshold]
    if not slow:
        return metrics, None
    metrics["straggler_slowest_rank"] = min(slow, key=lambda r: scores[r])
    fastest = max(range(len(rows)), key=lambda r: scores[r])
    parts = []
    for rank in slow:
        row = rows[rank]
        text = f"rank {rank} ({hosts[rank]}) {1 / scores[rank]:.1f}x slower"
        if row["sm_clock_mhz"] >= 0:
            text += f", SM {row['sm_clock_mhz']:.0f}/{rows[fastest]['sm_clock_mhz']:.0f} MHz"
            text += f", {row['power_w']:.0f} W" if row["power_w"] >= 0 else ""
            text += ", throttle flag set" if row["throttled"] > 0 else ", no throttle flag"
        parts.append(text)
    waits = [
        f"rank {r} waits {_secs(rows[r]['wait_s'])} of {_secs(rows[r]['step_s'])}"
        for r in range(len(rows))
        if r not in slow
    ]
    return metrics, "; ".join(parts) + ("; " + ", ".join(waits) if waits else "")


def _hook_ddp(model) -> bool:
    """Install one timing comm hook per DDP model; it reports to `model._hf_pretrain_timer` (the current callback)."""
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return False
    if getattr(model, "_hf_pretrain_hooked", False):
        return True
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    def timing_hook(process_group, bucket):
        timer = getattr(model, "_hf_pretrain_timer", None)
        if timer is not None:
            timer._ready = time.perf_counter()

        def done(fut):
            if timer is not None:
                timer._done = time.perf_counter()
            return fut.value()

        return default_hooks.allreduce_hook(process_group, bucket).then(done)

    try:
        model.register_comm_hook(model.process_group, timing_hook)
    except RuntimeError as err:  # another comm hook is already registered (e.g. compression)
        logger.warning(f"straggler detection without bucket timing: {err}")
        return False
    model._hf_pretrain_hooked = True
    return True


class StragglerCallback(PretrainCallback):
    keep_in_history = False  # read off clocks and sensors: differs between identical runs

    def __init__(self, every: int = 20, threshold: float = 0.75, sensors=None, underclock_threshold: float = 0.6):
        self.every = max(1, every)
        self.threshold = threshold
        self.underclock_threshold = underclock_threshold
        self.sensors = sensors  # a HardwareSensorsCallback: clock, power, memory for the exchange
        self.trainer = None  # set by PretrainTrainer: the DDP model is found through it
        self.warnings: list[tuple[int, str]] = []
        self._pending: dict = {}

    def on_train_begin(self, args, state, control, **kwargs):
        self.rank, self.world = args.process_index, args.world_size
        self.device = args.device
        self.host = socket.gethostname()
        knob = os.environ.get(SLOW_RANK_KNOB, "")
        rank, _, seconds = knob.partition(":")
        self.sleep = float(seconds) if knob and int(rank) == self.rank else 0.0
        self.window: dict[str, list[float]] = {k: [] for k in TIMES}
        self._last_end = None
        model = getattr(self.trainer, "model_wrapped", None)
        self.hooked = _hook_ddp(model)
        if self.hooked:
            model._hf_pretrain_timer = self
        self.hosts = self._gather_hosts() if self.world > 1 else [self.host]

    def _gather_hosts(self) -> list[str]:
        hosts = [None] * self.world
        dist.all_gather_object(hosts, self.host)
        return hosts

    def on_step_begin(self, args, state, control, **kwargs):
        now = time.perf_counter()
        self._data_wait = now - self._last_end if self._last_end is not None else 0.0
        self._start, self._micro = now, []

    def before_micro_batch(self) -> None:
        """Called by PretrainTrainer.training_step before each micro-batch (the test knob sleeps here)."""
        if self.sleep:
            time.sleep(self.sleep)
        self._ready = self._done = None

    def record_micro_batch(self, start: float, end: float) -> None:
        """Called by PretrainTrainer.training_step after each micro-batch's forward and backward."""
        if self._ready is not None and start <= self._ready <= end:
            end = self._ready  # the sync micro-batch: local work ends when the last bucket is ready
        self._micro.append(end - start)

    def on_step_end(self, args, state, control, **kwargs):
        end = time.perf_counter()
        step = end - self._start
        compute = min(sum(self._micro), step) if self._micro else step
        self.window["compute_s"].append(compute)
        self.window["wait_s"].append(step - compute)
        self.window["data_wait_s"].append(self._data_wait)
        self.window["step_s"].append(step)
        self._last_end = end
        if state.global_step % self.every == 0:
            self._exchange(state.global_step)

    def _local_row(self) -> dict[str, float]:
        row = {k: statistics.median(v) if v else 0.0 for k, v in self.window.items()}
        latest = self.sensors.latest if self.sensors is not None else {}
        for field, key in (
            ("sm_clock_mhz", "gpu_sm_clock_mhz"),
            ("sm_clock_max_mhz", "gpu_sm_clock_max_mhz"),
            ("power_w", "gpu_power_w"),
            ("utilization_pct", "gpu_utilization_pct"),
            ("memory_gib", "gpu_memory_used_gib"),
        ):
            row[field] = float(latest.get(key, -1))
        reasons = set(str(latest.get("gpu_throttle_reasons", "none")).split(","))
        row["throttled"] = float(bool(reasons & LIMITING_REASONS))
        return row

    def _exchange(self, step: int) -> None:
        local = self._local_row()
        self.window = {k: [] for k in self.window}
        rows = [local]
        if self.world > 1:
            mine = torch.tensor([local[k] for k in FIELDS], dtype=torch.float64, device=self.device)
            gathered = [torch.zeros_like(mine) for _ in range(self.world)]
            dist.all_gather(gathered, mine)
            rows = [dict(zip(FIELDS, t.tolist())) for t in gathered]
        metrics, warning = straggler_report(rows, self.hosts, self.threshold)
        metrics.update({k: local[k] for k in TIMES})
        if warning:
            self.warnings.append((step, warning))
            if self.rank == 0:
                logger.warning(f"straggler at step {step}: {warning}")
            count = self._pending.get("straggler_warnings", 0) + 1
            first = self._pending.get("straggler_warning", warning)  # keep the first until the next log
            metrics.update(straggler_warning=first, straggler_warnings=count)
        for rank, row in enumerate(rows):  # other ranks' under-clock reaches rank 0's logs here
            if rank == self.rank:
                continue  # this rank's own is UnderclockCallback's
            reading = {
                "gpu_sm_clock_mhz": row["sm_clock_mhz"],
                "gpu_sm_clock_max_mhz": row["sm_clock_max_mhz"],
                "gpu_utilization_pct": row["utilization_pct"],
                "gpu_power_w": row["power_w"],
                "gpu_throttle_reasons": "sw_power_cap" if row["throttled"] else "none",
            }
            if row["sm_clock_mhz"] < 0:
                continue
            text = underclock_warning(reading, self.underclock_threshold, rank=rank, host=self.hosts[rank])
            if text:
                metrics.setdefault("underclock_warning", text)
                metrics.setdefault("underclock_rank", rank)
        self._pending = {**self._pending, **metrics}

    def metrics_for_log(self, state) -> dict:
        pending, self._pending = self._pending, {}
        return pending
