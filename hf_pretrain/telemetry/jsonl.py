"""`JsonlCallback`: every log of the run, one JSON object per line, in `OUTPUT_DIR/telemetry.jsonl`.

The one run-event stream of hf_pretrain: the Trainer's logs with everything the telemetry
callbacks merged into them (throughput, MFU, sensors, straggler per-rank figures, warnings), each
with `step` and wall-clock `time`. Written by the main process only and flushed per line, so a run
that dies keeps what it logged. After a resume the records past the resumed step are dropped
before the replayed steps are logged again, so every step appears once. An `evaluate()` outside `train()` is
appended too (`record_outside_train`). `hf-pretrain report` reads it. It writes what it is given and logs no keys
of its own besides `step` and `time`.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from ..callback import PretrainCallback
from .hardware import HardwareSensorsCallback

FILENAME = "telemetry.jsonl"


def _jsonable(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # NaN/inf as text: JSON has no such numbers
    return value if isinstance(value, (int, float, str, bool, type(None))) else str(value)


class JsonlCallback(PretrainCallback):
    @classmethod
    def from_arguments(cls, trainer, built=()) -> JsonlCallback | None:
        telemetry = any(isinstance(c, HardwareSensorsCallback) for c in built)  # the `telemetry` switch
        return cls(trainer.args.output_dir) if telemetry else None

    def __init__(self, output_dir: str | Path):
        self.path = Path(output_dir) / FILENAME
        self._trimmed = False

    def on_train_begin(self, args, state, control, **kwargs):
        self._trimmed = False  # a roll-back's replay is a new pass too

    def on_step_begin(self, args, state, control, **kwargs):
        """Once per train(), at the first step (the Trainer restores a resumed state after on_train_begin): drop
        what an earlier run logged past this step, so the steps a resume replays appear once."""
        if self._trimmed or not state.is_world_process_zero:
            return
        self._trimmed = True
        if not self.path.exists():
            return
        lines = self.path.read_text(encoding="utf-8").splitlines(keepends=True)
        # (a line cut by a killed run goes too: the next record would be glued to it)
        kept = [line for line in lines if line.endswith("\n") and (_step_of(line) or 0) <= state.global_step]
        if len(kept) < len(lines):
            staged = self.path.with_suffix(".jsonl.tmp")
            staged.write_text("".join(kept), encoding="utf-8")
            staged.replace(self.path)  # one rename: a crash leaves the old stream or the new one

    def on_log(self, args, state, control, logs=None, **kwargs):
        if not state.is_world_process_zero or not logs:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        record = {"step": state.global_step, "time": time.time(), **{k: _jsonable(v) for k, v in logs.items()}}
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")


def record_outside_train(trainer, logs: dict) -> None:
    """A log made outside `train()` (an `evaluate()` after it, as the example's final held-out loss) appended to
    the stream when telemetry is on: no callback of a train() is attached then, and the report must not say "not
    logged" of a figure the run measured."""
    if logs and HardwareSensorsCallback.settings(trainer.args)["telemetry"]:
        JsonlCallback(trainer.args.output_dir).on_log(trainer.args, trainer.state, None, logs=logs)


def _step_of(line: str) -> int | None:
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return None
    return record.get("step") if isinstance(record, dict) and isinstance(record.get("step"), int) else None


def read_jsonl(run_dir: str | Path) -> list[dict]:
    """The records of a run directory's telemetry stream (an empty list when there is none).

    Lines that are not JSON objects with an integer `step` (a truncated last line, foreign text)
    are skipped; `read_records` also says which.
    """
    return read_records(run_dir)[0]


def read_records(run_dir: str | Path) -> tuple[list[dict], list[int]]:
    """The records of the stream and the numbers (from 1) of the lines skipped as no record."""
    path = Path(run_dir) / FILENAME
    if not path.exists():
        return [], []
    records, skipped = [], []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut by a run that died, or not ours
            record = None
        if isinstance(record, dict) and isinstance(record.get("step"), int):
            records.append(record)
        elif line.strip():
            skipped.append(number)
    return records, skipped
