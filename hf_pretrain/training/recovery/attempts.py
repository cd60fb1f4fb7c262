"""The attempts of a run, and the guard that stops a restart loop that makes no progress.

A launcher that restarts failed workers (`torchrun --max-restarts N`, `accelerate launch --max_restarts N`) runs
the same command again and says which attempt it is (`TORCHELASTIC_RESTART_COUNT`). Each attempt is a line in
`OUTPUT_DIR/recovery/attempts.json`, written by rank 0: when it started, the step it resumed from, and how it ended
(`finished`, `exception: <type>: <message>`, `hang: ...` from the watchdog, or nothing: killed with no word, as by
SIGKILL, the OOM killer or a lost node). The step an attempt reached is read from the heartbeat files the
watchdog keeps (`watchdog.py`), so a killed attempt has one too.

`no_progress(attempts, limit)`: when the last `limit` attempts of this launch all failed the same way at the same
step, restarting again would fail once more: the run stops with the reason instead. A launch is the attempts
since the launcher's count was last 0 (a person launching again starts a new one). The guard cannot keep the
launcher from restarting (any non-zero exit does), so each further restart stops at once, before training.
Written by hand: torchelastic keeps no record of why a worker failed beyond its exit code.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import asdict, dataclass
from pathlib import Path

FOLDER = "recovery"
ATTEMPTS_NAME = "attempts.json"
KILLED = "killed (no reason recorded: SIGKILL, the OOM killer or a lost node)"
REFUSED = "refused: restart loop"
NUMBER = re.compile(r"0x[0-9a-fA-F]+|\d+")
PEER_LOST = "a peer rank was lost"
# How a survivor's collective fails when a peer dies: gloo says "Connection closed by peer" or "Read error ...:
# Connection reset by peer" depending on where it was (both seen after one SIGKILL), NCCL "remote process exited".
LOST_PEER_WORDS = re.compile(
    r"connection (closed|reset) by peer|broken pipe|remote process exited|communicator was aborted", re.IGNORECASE
)


# What a launch with restarts needs from torch elastic (2.13): a new rendezvous store for each attempt. The agent's
# store is shared with the workers by default (c10d; always with 'static') and keeps the previous attempt's keys, so
# a restarted rank can read a dead peer's address and fail to connect, or hang (pytorch/pytorch#135712).
RESTARTABLE = {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}


def restart_rendezvous_warning() -> str | None:
    """Why the launcher's restarts will not rendezvous, and the fix; None without restarts or when they can."""
    if restarts_allowed() == 0 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    return (
        f"restarts are allowed (--max_restarts {restarts_allowed()}) but the launcher shares its rendezvous store "
        "with the workers across restarts (torch elastic's default for rdzv_backend c10d, always for static): a "
        "restarted rank can read the previous attempt's addresses and fail to connect or hang (pytorch/pytorch#135712). "
        "Launch with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 and --rdzv_backend c10d (accelerate launch; several nodes: "
        "same_network false, so the rendezvous endpoint is main_process_ip:main_process_port)."
    )


class RestartLoopError(RuntimeError):
    """The launcher restarted a run that keeps failing the same way at the same step."""


def recovery_folder(output_dir: str | os.PathLike) -> Path:
    return Path(output_dir) / FOLDER


def restart_count() -> int:
    """Which restart of the launch this process belongs to (0: the first start, or no elastic launcher)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def restarts_allowed() -> int:
    """How many restarts the launcher allows (0 without an elastic launcher)."""
    return int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", "0") or 0)


@dataclass
class Attempt:
    restart: int  # the launcher's restart count
    started: float  # wall-clock time
    resumed_step: int  # 0 for a fresh start
    last_step: int | None = None
    ended: str | None = None  # "finished", "exception: ...", "hang: ...", KILLED, REFUSED
    end_time: float | None = None
    failed_rank: int | None = None  # the rank that reported the failure first

    @property
    def failure(self) -> str | None:
        """What a failure is compared by: a hang by its kind; a lost peer (a surviving rank's collective failing
        because another rank died) as one failure, whichever way the transport words it; anything else by its
        first line with every number left out (a peer's port, an address, a size or a time changes from one
        attempt to the next)."""
        if self.ended in ("finished", REFUSED):
            return None
        first = (self.ended or KILLED).splitlines()[0]
        if first.startswith("hang"):
            return "hang"
        return PEER_LOST if LOST_PEER_WORDS.search(first) else NUMBER.sub("#", first)


def read_attempts(output_dir: str | os.PathLike) -> list[Attempt]:
    path = recovery_folder(output_dir) / ATTEMPTS_NAME
    if not path.is_file():
        return []
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return []  # a file cut by a crash: the record starts again, the run is not blocked by it
    return [Attempt(**row) for row in rows if isinstance(row, dict)]


def write_attempts(output_dir: str | os.PathLike, attempts: list[Attempt]) -> None:
    folder = recovery_folder(output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    staged = folder / f".{ATTEMPTS_NAME}.tmp"
    staged.write_text(json.dumps([asdict(a) for a in attempts], indent=1), encoding="utf-8")
    staged.replace(folder / ATTEMPTS_NAME)  # one rename: the old record or the new one


def close_previous(attempts: list[Attempt], last_step: int | None, last_seen: float | None) -> None:
    """The previous attempt ended without saying how (killed): its last step and time from the heartbeats."""
    if attempts and attempts[-1].ended is None:
        previous = attempts[-1]
        previous.ended = KILLED
        previous.last_step = last_step if last_step is not None else previous.resumed_step
        previous.end_time = last_seen


def this_launch(attempts: list[Attempt]) -> list[Attempt]:
    """The attempts since the launcher's restart count was last 0."""
    starts = [i for i, a in enumerate(attempts) if a.restart == 0]
    return attempts[starts[-1] :] if starts else attempts


def no_progress(attempts: list[Attempt], limit: int) -> str | None:
    """Why the run should stop: the last `limit` failed attempts of this launch failed the same way at the same
    step; None otherwise (or with `limit` 0)."""
    failed = [a for a in this_launch(attempts) if a.ended != REFUSED]
    last = failed[-limit:] if limit > 0 else []
    if len(last) < limit or any(a.failure is None for a in last):
        return None
    if len({(a.failure, a.last_step) for a in last}) != 1:
        return None
    return (
        f"the last {limit} attempts all failed at step {last[-1].last_step} after resuming from step "
        f"{last[-1].resumed_step}: {last[-1].ended or KILLED}"
    )


def begin_attempt(attempts: list[Attempt], resumed_step: int) -> Attempt:
    attempt = Attempt(restart=restart_count(), started=time.time(), resumed_step=resumed_step)
    attempts.append(attempt)
    return attempt
