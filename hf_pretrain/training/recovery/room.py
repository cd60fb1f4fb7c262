"""The trainer's room for runs nobody watches: the attempts, the restart-loop guard, the hang watchdog and the
phases (saves, evaluations) that goodput and the watchdog time.

- `start(checkpoint, saved, callbacks)` at each `train()`: rank 0 settles the previous attempt's record from what
  its ranks left (`attempts.py`) and opens this one; every rank then refuses a restart loop (`RestartLoopError`),
  hands goodput how the attempt began (a checkpoint of another output folder starts this run's counters anew: it
  is no restart of this run), and starts the watchdog (`watchdog.py`); rank 0 starts the attempt's recorder with
  it (`recorder.py`: it settles the record once rank 0 is gone, a launch that nothing restarts included).
- `phase(kind)`: a save (`checkpoint`) or an evaluation (`eval`): the watchdog's floor applies, goodput counts it.
- `finish(error)`: how the attempt ended, written down: any rank's own failure in a note of its own (read by rank 0
  at the next start and by the recorder), rank 0's also in the record at once; the watchdog stops, the recorder is
  released. The watchdog's hang is written the same way before it exits.
`RecoveryCallback` beats the watchdog at each optimizer step and owns the arguments' defaults. The watchdog's
floor defaults to `ddp_timeout` less `COLLECTIVE_MARGIN_S`, and no timeout may reach past that (watchdog.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from pathlib import Path

from transformers.utils import logging

from ...callback import PretrainCallback
from ...telemetry.goodput import GoodputCallback
from ..processes import wait_for_everyone
from .attempts import (
    REFUSED,
    Attempt,
    RestartLoopError,
    begin_attempt,
    close_previous,
    gather_evidence,
    locked,
    no_progress,
    read_attempts,
    recovery_folder,
    restart_count,
    restarts_allowed,
    write_attempts,
)
from .recorder import Recorder
from .watchdog import COLLECTIVE_MARGIN_S, HangWatchdog, WatchdogSettings

logger = logging.get_logger(__name__)


class RecoveryCallback(PretrainCallback):
    """Logs nothing: tells the hang watchdog each optimizer step."""

    arguments = {
        "hang_watchdog": None,  # None: on with several processes or when the launcher restarts failed ones
        "hang_timeout_factor": WatchdogSettings.factor,
        "hang_timeout_min_s": WatchdogSettings.min_s,
        "hang_timeout_floor_s": None,  # None: ddp_timeout less COLLECTIVE_MARGIN_S
        "restart_same_failure_limit": 3,
    }

    @classmethod
    def from_arguments(cls, trainer, built=()) -> RecoveryCallback | None:
        return cls(trainer.recovery) if trainer.recovery.watchdog_wanted() else None

    def __init__(self, recovery: Recovery):
        self.recovery = recovery

    def on_step_end(self, args, state, control, **kwargs):
        if self.recovery.watchdog is not None:
            self.recovery.watchdog.beat(state.global_step)


def checkpoint_step(checkpoint: str | None) -> int:
    match = re.search(r"(\d+)$", Path(checkpoint).name) if checkpoint else None
    return int(match.group(1)) if match else 0


def watchdog_settings(settings: dict, ddp_timeout: float) -> WatchdogSettings:
    """The watchdog's settings from the arguments; a floor or minimum that NCCL's watchdog would pre-empt (at
    `ddp_timeout`, with SIGABRT and no Python stacks) is refused, naming the fix."""
    cap = ddp_timeout - COLLECTIVE_MARGIN_S
    floor = settings["hang_timeout_floor_s"]
    floor = cap if floor is None else floor
    for name, value in (("hang_timeout_floor_s", floor), ("hang_timeout_min_s", settings["hang_timeout_min_s"])):
        if value > cap:
            raise ValueError(
                f"{name}={value:g} ends after ddp_timeout={ddp_timeout:g} less {COLLECTIVE_MARGIN_S:g} s: NCCL's "
                f"watchdog would abort a rank stuck in a collective first (SIGABRT, no Python stacks, no record). "
                f"Raise ddp_timeout to at least {value + COLLECTIVE_MARGIN_S:g} or lower {name}."
            )
    return WatchdogSettings(settings["hang_timeout_factor"], settings["hang_timeout_min_s"], floor, 1.0, ddp_timeout)


def start_recorder(output_dir: str, attempt: int) -> Recorder | None:
    """The attempt's recorder (recorder.py); None, said once, where no process can be started."""
    try:
        return Recorder(output_dir, attempt)
    except OSError as error:
        logger.warning(f"The attempt's recorder did not start ({error}): a rank killed is recorded at the next start.")
        return None


def made_here(checkpoint: str | None, output_dir: str) -> bool:
    """Whether a checkpoint is one of this output folder's (not another run's it resumes from)."""
    return checkpoint is not None and Path(checkpoint).resolve().parent == Path(output_dir).resolve()


class Recovery:
    def __init__(self, trainer):
        self.trainer = trainer
        self.settings = RecoveryCallback.settings(trainer.args)
        wanted = self.watchdog_wanted()
        self.watchdog_settings = watchdog_settings(self.settings, trainer.args.ddp_timeout) if wanted else None
        self.watchdog: HangWatchdog | None = None
        self.goodput: GoodputCallback | None = None
        self.attempt: Attempt | None = None
        self.recorder: Recorder | None = None

    @property
    def folder(self) -> Path:
        return recovery_folder(self.trainer.args.output_dir)

    def watchdog_wanted(self) -> bool:
        wanted = self.settings["hang_watchdog"]
        return bool(wanted) if wanted is not None else self.trainer.args.world_size > 1 or restarts_allowed() > 0

    def start(self, checkpoint: str | None, saved: dict, callbacks: list) -> None:
        trainer = self.trainer
        main = trainer.is_world_process_zero()
        if main:
            with locked(trainer.args.output_dir):
                attempts = read_attempts(trainer.args.output_dir)
                close_previous(attempts, gather_evidence(self.folder, len(attempts) - 1, consume=True))
                begin_attempt(attempts, checkpoint_step(checkpoint))
                write_attempts(trainer.args.output_dir, attempts)
        wait_for_everyone(trainer.accelerator)
        attempts = read_attempts(trainer.args.output_dir)
        self.attempt = attempts[-1] if attempts else None
        previous = attempts[-2] if len(attempts) > 1 else None
        limit = self.settings["restart_same_failure_limit"]
        reason = no_progress(attempts[:-1], limit) if restart_count() > 0 else None  # a new launch: no loop yet
        if reason is not None:
            if main:
                self._record_end(REFUSED, checkpoint_step(checkpoint))  # it trained no step
            raise RestartLoopError(
                f"Not training again: {reason} (restart {restart_count()} of this launch). A restart would fail the "
                f"same way: the attempts are in {self.folder / 'attempts.json'}, the stacks of hangs beside it. Fix "
                "the cause and launch again (a new launch starts counting anew), or raise restart_same_failure_limit."
            )
        self.goodput = next((c for c in callbacks if isinstance(c, GoodputCallback)), None)
        if self.goodput is not None:
            failed = previous is not None and previous.ended not in ("finished", None) or restart_count() > 0
            counters = saved.get("goodput") if made_here(checkpoint, trainer.args.output_dir) else None
            self.goodput.resume(counters, failed, previous and previous.end_time)
        if self.watchdog_settings is not None:
            if main and os.name == "posix":
                self.recorder = start_recorder(trainer.args.output_dir, len(attempts) - 1)
            self.watchdog = HangWatchdog(
                self.folder,
                trainer.args.process_index,
                trainer.args.world_size,
                self.watchdog_settings,
                attempt=len(attempts) - 1,
                on_hang=lambda reason: self._note_failure(reason, self.watchdog.step),
            )
            self.watchdog.start(checkpoint_step(checkpoint))

    @contextlib.contextmanager
    def phase(self, kind: str, count: bool = True):
        """A save (`checkpoint`) or an evaluation (`eval`) inside `train()`; `count=False`: a wait for a save
        already counted (the last background write, or the one in flight after a failure), timed as stall only."""
        start = time.monotonic()
        watched = self.watchdog.long_phase(kind) if self.watchdog is not None else contextlib.nullcontext()
        try:
            with watched:
                yield
        finally:
            if self.goodput is not None:
                self.goodput.add(kind, time.monotonic() - start, count)

    def run_state(self) -> dict:
        """What a checkpoint keeps of this room: goodput's counters."""
        return {"goodput": self.goodput.state()} if self.goodput is not None else {}

    def finish(self, error: BaseException | None) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
            self.watchdog = None
        step = self.trainer.state.global_step
        if error is None:
            if self.trainer.is_world_process_zero():
                self._record_end("finished", step)
        elif not isinstance(error, RestartLoopError):
            first = str(error).splitlines()[0][:300] if str(error) else ""
            self._note_failure(f"exception: {type(error).__name__}: {first}", step)
        if self.recorder is not None:  # rank 0's end is written: the recorder may settle the attempt
            self.recorder.release()
            self.recorder = None
        self.goodput = None

    # The record
    def _note_failure(self, reason: str, step: int) -> None:
        """This rank's own account of the failure (any rank may fail; rank 0 reads them all at the next start), and
        on rank 0 the record at once: a launch with no restart left has no next start."""
        rank = self.trainer.args.process_index
        with contextlib.suppress(OSError):
            self.folder.mkdir(parents=True, exist_ok=True)
            note = {"rank": rank, "reason": reason, "step": step, "time": time.time()}
            (self.folder / f"failed-rank{rank}.json").write_text(json.dumps(note), encoding="utf-8")
            if rank == 0:
                self._record_end(reason, step, failed_rank=0)

    def _record_end(self, ended: str, step: int, failed_rank: int | None = None) -> None:
        with locked(self.trainer.args.output_dir):
            attempts = read_attempts(self.trainer.args.output_dir)
            if attempts:
                last = attempts[-1]
                last.ended, last.last_step, last.end_time, last.failed_rank = ended, step, time.time(), failed_rank
                write_attempts(self.trainer.args.output_dir, attempts)
