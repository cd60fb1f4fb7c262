"""`DownstreamEvalCallback`: the downstream suite every N optimizer steps of a training run.

The suite (`DownstreamEvaluator`: tasks, a fixed seeded subset of `examples` a task, `shots`) is
prepared once at `on_train_begin` on every rank; every `every_n_steps` steps, and at the last step
with `at_end`, `on_step_end` scores it on the model the Trainer hands its callbacks (all ranks
together: requests sharded, log-likelihoods summed, a ZeRO-3 / FSDP forward on each rank's share; under DeepSpeed
AutoTP sharded by TP group, whose ranks run each forward together),
under the Trainer's autocast (as `evaluate()`), asks for a log at that step (`should_log` on every
rank) and prints on rank 0:

    [downstream] step 200: hellaswag acc_norm 0.262 | arc_easy acc_norm 0.281 | piqa acc_norm 0.552 | centered 0.012 (3.1 s)

and, while it prepares (`on_train_begin`: the requests encoded) and while it scores, a progress line every
`progress_s` seconds (rank 0's share: requests done per task, the rate, the time left;
`DownstreamEvaluator`), so a long evaluation is never silent.

Logs (merged into that step's log by `PretrainTrainer.log`: console, `report_to`, telemetry.jsonl and
`state.log_history`; rank 0):
- `downstream/<task>/acc`, `/acc_norm`, `/acc_per_token`, `/bpb`, `/centered` for each task
  (definitions in `scoring.py`);
- `downstream/centered`: the mean of the tasks' centered primary figures (CORE-style aggregate).
Its cost is logged by `DownstreamCostCallback` (`cost.py`), kept out of `state.log_history` like
every reading of a clock. With plain `transformers.Trainer` the figures are printed, not logged.
"""

from __future__ import annotations

import contextlib
import time

from ...callback import PretrainCallback
from ..generation_probe import is_sharded
from .evaluator import DEFAULT_BATCH_TOKENS, PROGRESS_S, DownstreamEvaluator, DownstreamResult


class DownstreamEvalCallback(PretrainCallback):
    """The suite every `every_n_steps` steps (0: only at the end); `tokenizer` defaults to the Trainer's."""

    arguments = {
        "downstream_tasks": None,
        "downstream_every": 0,
        "downstream_examples": 500,
        "downstream_shots": 0,
        "downstream_at_end": True,
        "downstream_batch_tokens": DEFAULT_BATCH_TOKENS,
    }

    @classmethod
    def from_arguments(cls, trainer, built=()) -> DownstreamEvalCallback | None:
        s = cls.settings(trainer.args)
        if not s["downstream_tasks"] or (s["downstream_every"] <= 0 and not s["downstream_at_end"]):
            return None
        return cls(
            s["downstream_tasks"],
            s["downstream_every"],
            s["downstream_examples"],
            s["downstream_shots"],
            tokenizer=trainer.processing_class,
            at_end=s["downstream_at_end"],
            batch_tokens=s["downstream_batch_tokens"],
            autocast=trainer.autocast_smart_context_manager,
            phase=getattr(getattr(trainer, "recovery", None), "phase", None),
        )

    def __init__(
        self,
        tasks: str | list[str] = "default",
        every_n_steps: int = arguments["downstream_every"],
        examples: int | None = arguments["downstream_examples"],
        shots: int = arguments["downstream_shots"],
        tokenizer=None,
        at_end: bool = arguments["downstream_at_end"],
        batch_tokens: int = arguments["downstream_batch_tokens"],
        autocast=None,
        seed: int = 1234,
        data_dir: str | None = None,
        phase=None,
        progress_s: float | None = PROGRESS_S,
    ):
        if every_n_steps < 0 or (every_n_steps == 0 and not at_end):
            raise ValueError("downstream_every must be >= 1 (or 0 with downstream_at_end: evaluate only at the end).")
        if examples is not None and examples < 0:
            raise ValueError(
                f"downstream_examples={examples}: pass the rows a task to score (1 or more), or 0 for all."
            )
        self.tasks, self.every_n_steps, self.examples, self.shots = tasks, every_n_steps, examples or None, shots
        self.tokenizer, self.at_end, self.batch_tokens, self.seed = tokenizer, at_end, batch_tokens, seed
        self.autocast, self.data_dir, self.progress_s = autocast, data_dir, progress_s
        self.phase = phase  # PretrainTrainer's recovery.phase: the hang watchdog's floor, goodput's evaluations
        self.evaluator: DownstreamEvaluator | None = None
        self.history: list[tuple[int, DownstreamResult]] = []  # rank 0
        self.last: DownstreamResult | None = None  # every rank
        self.prepare_seconds = 0.0
        self.seconds: list[float] = []  # each evaluation's time, read by DownstreamCostCallback
        self._pending: dict = {}
        self._last_step: int | None = None

    def due(self, state) -> bool:
        step = state.global_step
        if step == self._last_step or step <= 0:
            return False
        periodic = self.every_n_steps > 0 and step % self.every_n_steps == 0
        return periodic or (self.at_end and state.max_steps > 0 and step >= state.max_steps)

    def on_train_begin(self, args, state, control, processing_class=None, **kwargs):
        self._last_step, self._pending, self.prepare_seconds = None, {}, 0.0
        if self.evaluator is not None:
            return
        tokenizer = self.tokenizer or processing_class
        if tokenizer is None:
            raise ValueError(
                "DownstreamEvalCallback needs a tokenizer: pass tokenizer= or processing_class to the Trainer."
            )
        start = time.perf_counter()
        self.evaluator = DownstreamEvaluator(
            tokenizer,
            self.tasks,
            self.examples,
            self.shots,
            self.seed,
            batch_tokens=self.batch_tokens,
            data_dir=self.data_dir,
            progress_s=self.progress_s,  # rank 0's lines while it encodes (a full task: tens of seconds)
        )
        self.prepare_seconds = time.perf_counter() - start

    def on_step_end(self, args, state, control, model=None, **kwargs):
        if not self.due(state):
            return
        self._last_step = state.global_step
        control.should_log = True  # every rank: the figures get a log at this very step
        with self.phase("eval") if self.phase else contextlib.nullcontext():
            self.evaluator.batches(model, args.device)  # prepared at the first evaluation: its notes said before
            for note in self.evaluator.notes() if state.is_world_process_zero else ():
                print(f"[downstream] {note}", flush=True)
            result = self.evaluator.evaluate(
                model,
                args.device,
                sharded=is_sharded(model, args) and args.world_size > 1,
                autocast=self.autocast or contextlib.nullcontext,
                progress_s=self.progress_s,
            )
        self.seconds.append(result.seconds)
        self.last = result
        if not state.is_world_process_zero:
            return
        self.history.append((state.global_step, result))
        self._pending = result.logs()
        print(f"[downstream] step {state.global_step}: {summary(result, self.evaluator)}", flush=True)

    def metrics_for_log(self, state) -> dict:
        pending, self._pending = self._pending, {}
        return pending


def summary(result: DownstreamResult, evaluator: DownstreamEvaluator) -> str:
    parts = [f"{s.task.name} {s.task.primary} {result.tasks[s.task.name][s.task.primary]:.3f}" for s in evaluator.sets]
    return " | ".join(parts) + f" | centered {result.centered:.3f} ({result.seconds:.1f} s)"
