"""`GoodputCallback`: how much of the run's wall-clock time trained, and where the rest went.

Logged keys (with every training log; clock readings, so kept out of `state.log_history`):
- `goodput`: productive time / wall time of the run so far, over every attempt (restarts included);
- `goodput_wall_s`: since the run's first start, without the time it was stopped by choice (a run that ended
  and was resumed later);
- `goodput_productive_s`: the optimizer steps that count (from one step's end to the next, less any save or
  evaluation in between; the first step of an attempt from its start);
- `goodput_checkpoint_s`: the training loop stalled by checkpoint saves (with asynchronous saves, the staging
  and any wait for the previous write); `goodput_saves`, how many saves (the stall of one, `hf-pretrain plan
  --checkpoint-seconds`, is their quotient, which `hf-pretrain report` prints);
- `goodput_eval_s`: evaluations during training;
- `goodput_restart_s`: time lost to failures: from each resumed checkpoint to the first step of the attempt
  that resumed it (the steps redone, the relaunch, start-up); `goodput_restarts`, how many;
- the rest of the wall time (start-up of the first attempt, logging, the final save) is what none of these
  names.
The counters ride in every checkpoint (`state()`, saved in `hf_pretrain_state.json` by the trainer): a resumed
run continues from the checkpoint's counters, and the time since that checkpoint becomes restart time, since the
work after it is lost. A checkpoint of another output folder is handed over as a fresh start (`saved` None: a
new run, not a restart of this one; its age is no time this run lost). The trainer says how each attempt began
(`resume`) and times saves and evaluations (`add`).
"""

from __future__ import annotations

import time

from ..callback import PretrainCallback
from .hardware import HardwareSensorsCallback

KINDS = ("productive", "checkpoint", "eval", "restart")


class GoodputCallback(PretrainCallback):
    keep_in_history = False

    @classmethod
    def from_arguments(cls, trainer, built=()) -> GoodputCallback | None:
        telemetry = any(isinstance(c, HardwareSensorsCallback) for c in built)  # the `telemetry` switch
        return cls() if telemetry else None

    def __init__(self):
        self.seconds = dict.fromkeys(KINDS, 0.0)
        self.restarts = 0
        self.saves = 0
        self.run_start: float | None = None
        self.excluded_s = 0.0  # stopped by choice between attempts: not wall time of the run
        self._lost_since: float | None = None  # a resumed checkpoint's time: lost until the first step
        self._last_end: float | None = None  # the previous step's end (monotonic)
        self._phases_s = 0.0  # saves and evaluations since the previous step's end

    # The trainer's side.
    def resume(self, saved: dict | None, failed: bool, previous_end: float | None) -> None:
        """At the start of an attempt: `saved` the resumed checkpoint's counters (None: a fresh start); `failed`
        whether the attempt before ended in a failure (else it stopped by choice at `previous_end`)."""
        now = time.time()
        self._last_end, self._phases_s = None, 0.0
        if not saved:
            if self.run_start is None:
                self.run_start = now
            return
        self.seconds = {kind: float(saved.get(f"{kind}_s", 0.0)) for kind in KINDS}
        self.restarts = int(saved.get("restarts", 0))
        self.saves = int(saved.get("saves", 0))
        self.run_start = float(saved["run_start"])
        self.excluded_s = float(saved.get("excluded_s", 0.0))
        checkpoint_time = float(saved["time"])
        if failed or previous_end is None:
            self._lost_since = checkpoint_time
        else:  # resumed by choice: the pause is no run time; the steps after the checkpoint are redone
            self.excluded_s += max(0.0, now - previous_end)
            self.seconds["restart"] += max(0.0, previous_end - checkpoint_time)

    def add(self, kind: str, seconds: float, count: bool = True) -> None:
        """A save (`checkpoint`) or an evaluation (`eval`) that stalled the training loop for `seconds`; `count`
        False for a wait on a save counted before (its stall added, not another save)."""
        self.seconds[kind] += seconds
        self._phases_s += seconds
        self.saves += kind == "checkpoint" and count

    def state(self) -> dict:
        """The counters as of now, for a checkpoint."""
        return {
            **{f"{kind}_s": value for kind, value in self.seconds.items()},
            "restarts": self.restarts,
            "saves": self.saves,
            "run_start": self.run_start,
            "excluded_s": self.excluded_s,
            "time": time.time(),
        }

    # The Trainer's events.
    def on_step_begin(self, args, state, control, **kwargs):
        if self._lost_since is not None:  # the first step after a failure: the time since the checkpoint is lost
            self.seconds["restart"] += max(0.0, time.time() - self._lost_since)
            self.restarts += 1
            self._lost_since = None
        if self._last_end is None:
            self._last_end, self._phases_s = time.monotonic(), 0.0

    def on_step_end(self, args, state, control, **kwargs):
        now = time.monotonic()
        if self._last_end is not None:
            self.seconds["productive"] += max(0.0, now - self._last_end - self._phases_s)
        self._last_end, self._phases_s = now, 0.0

    def metrics_for_log(self, state) -> dict:
        if self.run_start is None:
            return {}
        wall = max(time.time() - self.run_start - self.excluded_s, 1e-9)
        logs = {"goodput": self.seconds["productive"] / wall, "goodput_wall_s": wall}
        logs.update({f"goodput_{kind}_s": value for kind, value in self.seconds.items()})
        logs["goodput_restarts"] = self.restarts
        logs["goodput_saves"] = self.saves
        return logs
