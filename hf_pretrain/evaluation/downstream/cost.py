"""`DownstreamCostCallback`: what the downstream evaluations cost the run, in its logs.

Attached after a `DownstreamEvalCallback` (read from `built`), it logs at the steps that evaluated
(rank 0; values of a clock: console, `report_to` and telemetry.jsonl, never `state.log_history`):
- `downstream/seconds`: the wall time of that step's evaluation (all tasks, all ranks together);
- `downstream/time_share`: the time of every evaluation so far / the run's wall time since
  `on_train_begin` (the suite's preparation included in both);
- `downstream/prepare_seconds`: once a `train()`, with the first: loading and tokenizing the suite (0 when
  an earlier `train()` prepared it).
`tokens_per_second` of that interval includes the evaluation's time; `step_time_s` does not.
"""

from __future__ import annotations

import time

from ...callback import PretrainCallback
from .callback import DownstreamEvalCallback


class DownstreamCostCallback(PretrainCallback):
    keep_in_history = False  # read off a clock: differs between identical runs

    @classmethod
    def from_arguments(cls, trainer, built=()) -> DownstreamCostCallback | None:
        evaluation = next((c for c in built if isinstance(c, DownstreamEvalCallback)), None)
        return cls(evaluation) if evaluation is not None else None

    def __init__(self, evaluation: DownstreamEvalCallback):
        self.evaluation = evaluation
        self._start = time.perf_counter()
        self._first = self._reported = 0
        self._prepare_reported = False

    def on_train_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter() - self.evaluation.prepare_seconds  # callbacks run in order: it prepared
        self._first = self._reported = len(self.evaluation.seconds)
        self._prepare_reported = False

    def metrics_for_log(self, state) -> dict:
        seconds = self.evaluation.seconds
        if len(seconds) == self._reported:
            return {}
        self._reported = len(seconds)
        spent = self.evaluation.prepare_seconds + sum(seconds[self._first :])
        logs = {
            "downstream/seconds": seconds[-1],
            "downstream/time_share": spent / max(time.perf_counter() - self._start, 1e-9),
        }
        if not self._prepare_reported:
            logs["downstream/prepare_seconds"] = self.evaluation.prepare_seconds
            self._prepare_reported = True
        return logs
