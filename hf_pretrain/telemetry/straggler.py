"""`StragglerCallback`: per-rank compute, collective wait and data wait; names the slow rank.

Each rank measures, per optimizer step:
- compute: from the step's start until its last gradient bucket is ready to be reduced (a DDP
  communication hook timestamps every bucket; without DDP, e.g. one process, the whole step);
- wait: from that moment until the last all-reduce completes, i.e. time blocked in the collective
  waiting for the other ranks (0 for a single process; unavailable on engines without DDP hooks);
- data wait: from the end of the previous step until this one starts (the data loader).
Every `every` steps the ranks exchange the medians of their window together with their SM clock
and power (one small all_gather), and each rank gets a score = best rank's median compute / its
own. A rank below `threshold` (default 0.75) is a straggler, and the warning names it the way a
person needs it: "rank 1 (node-b) 1.9x slower, SM 600/2190 MHz, no throttle flag; rank 0 waits
3.3 s of 7.2 s".

Logs at the next logging step after an exchange (rank 0's logs carry every rank):
`compute_s`, `wait_s`, `data_wait_s`, `step_s` (this rank's medians), `straggler_score_min`,
`rank{r}_compute_s`, `rank{r}_wait_s`, `rank{r}_score`, `rank{r}_sm_clock_mhz`, `rank{r}_power_w`
(the last two where the GPU exposes them), and `straggler_warning` (text) when a rank is flagged.

Test-only knob: `HF_PRETRAIN_TEST_SLOW_RANK="RANK:SECONDS"` makes that rank sleep SECONDS at the
start of every step, so the detector can be tested for real on CPU ranks.
"""

from __future__ import annotations

import os
import socket
import statistics
import time

import torch
import torch.distributed as dist
from transformers import TrainerCallback
from transformers.utils import logging

logger = logging.get_logger(__name__)

FIELDS = ("compute_s", "wait_s", "data_wait_s", "step_s", "sm_clock_mhz", "sm_clock_max_mhz", "power_w", "throttled")
SLOW_RANK_KNOB = "HF_PRETRAIN_TEST_SLOW_RANK"


def _secs(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds >= 1 else f"{seconds:.2f} s"


def straggler_report(rows: list[dict], hosts: list[str], threshold: float) -> tuple[dict, str | None]:
    """Scores per rank from each rank's medians; the warning text when one is below `threshold`."""
    best = min(r["compute_s"] for r in rows)
    metrics: dict[str, float | str] = {}
    for rank, row in enumerate(rows):
        metrics[f"rank{rank}_score"] = best / row["compute_s"] if row["compute_s"] > 0 else 1.0
        metrics[f"rank{rank}_compute_s"] = row["compute_s"]
        metrics[f"rank{rank}_wait_s"] = row["wait_s"]
        for key in ("sm_clock_mhz", "power_w"):
            if row[key] >= 0:
                metrics[f"rank{rank}_{key}"] = row[key]
    scores = [metrics[f"rank{r}_score"] for r in range(len(rows))]
    metrics["straggler_score_min"] = min(scores)
    slow = [r for r, s in enumerate(scores) if s < threshold]
    if not slow:
        return metrics, None
    parts = []
    for rank in slow:
        row = rows[rank]
        text = f"rank {rank} ({hosts[rank]}) {1 / scores[rank]:.1f}x slower"
        if row["sm_clock_mhz"] >= 0:
            fastest = max(range(len(rows)), key=lambda r: scores[r])
            text += f", SM {row['sm_clock_mhz']:.0f}/{rows[fastest]['sm_clock_mhz']:.0f} MHz"
            text += f", {row['power_w']:.0f} W" if row["power_w"] >= 0 else ""
            text += ", throttle flag set" if row["throttled"] > 0 else ", no throttle flag"
        parts.append(text)
    waits = [
        f"rank {r} waits {_secs(rows[r]['wait_s'])} of {_secs(rows[r]['step_s'])}"
        for r in range(len(rows))
        if r not in slow
    ]
    warning = "; ".join(parts) + ("; " + ", ".join(waits) if waits else "")
    return metrics, warning


class StragglerCallback(TrainerCallback):
    def __init__(self, every: int = 20, threshold: float = 0.75, sensors=None):
        self.every = max(1, every)
        self.threshold = threshold
        self.sensors = sensors  # a HardwareSensorsCallback, for clock and power in the exchange
        self.trainer = None  # set by PretrainTrainer: the DDP model is found through it
        self.warnings: list[tuple[int, str]] = []
        self._pending: dict = {}
        self._hooked = False

    def on_train_begin(self, args, state, control, **kwargs):
        self.rank, self.world = args.process_index, args.world_size
        self.device = args.device
        self.host = socket.gethostname()
        knob = os.environ.get(SLOW_RANK_KNOB, "")
        rank, _, seconds = knob.partition(":")
        self.sleep = float(seconds) if knob and int(rank) == self.rank else 0.0
        self.window: dict[str, list[float]] = {k: [] for k in ("compute_s", "wait_s", "data_wait_s", "step_s")}
        self._last_end = None
        self._hook_ddp()
        self.hosts = self._gather_hosts() if self.world > 1 else [self.host]

    def _hook_ddp(self) -> None:
        model = getattr(self.trainer, "model_wrapped", None)
        if self._hooked or not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            return
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        def timing_hook(_, bucket):
            self._ready = time.perf_counter()

            def done(fut):
                self._done = time.perf_counter()
                return fut.value()

            return default_hooks.allreduce_hook(None, bucket).then(done)

        model.register_comm_hook(None, timing_hook)
        self._hooked = True

    def _gather_hosts(self) -> list[str]:
        hosts = [None] * self.world
        dist.all_gather_object(hosts, self.host)
        return hosts

    def on_step_begin(self, args, state, control, **kwargs):
        now = time.perf_counter()
        self._data_wait = now - self._last_end if self._last_end is not None else 0.0
        self._start, self._ready, self._done = now, None, None
        if self.sleep:
            time.sleep(self.sleep)

    def on_step_end(self, args, state, control, **kwargs):
        end = time.perf_counter()
        hooked = self._ready is not None and self._done is not None
        self.window["compute_s"].append((self._ready if hooked else end) - self._start)
        self.window["wait_s"].append(max(self._done - self._ready, 0.0) if hooked else 0.0)
        self.window["data_wait_s"].append(self._data_wait)
        self.window["step_s"].append(end - self._start)
        self._last_end = end
        if state.global_step % self.every == 0:
            self._exchange(state.global_step)

    def _local_row(self) -> dict[str, float]:
        row = {k: statistics.median(v) if v else 0.0 for k, v in self.window.items()}
        latest = self.sensors.latest if self.sensors is not None else {}
        row["sm_clock_mhz"] = float(latest.get("gpu_sm_clock_mhz", -1))
        row["sm_clock_max_mhz"] = float(latest.get("gpu_sm_clock_max_mhz", -1))
        row["power_w"] = float(latest.get("gpu_power_w", -1))
        row["throttled"] = float(latest.get("gpu_throttle_reasons", "none") not in ("none", "gpu_idle"))
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
        metrics.update({k: local[k] for k in ("compute_s", "wait_s", "data_wait_s", "step_s")})
        if warning:
            self.warnings.append((step, warning))
            metrics["straggler_warning"] = warning
            if self.rank == 0:
                logger.warning(f"straggler at step {step}: {warning}")
        self._pending = metrics

    def metrics_for_log(self, state) -> dict:
        pending, self._pending = self._pending, {}
        return pending
