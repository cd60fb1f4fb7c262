"""The attempts of a run, and the guard that stops a restart loop that makes no progress.

A launcher that restarts failed workers (`torchrun --max-restarts N`, `accelerate launch --max_restarts N`) runs
the same command again and says which attempt it is (`TORCHELASTIC_RESTART_COUNT`). Each attempt is a line in
`OUTPUT_DIR/recovery/attempts.json`, written by rank 0: when it started, the step it resumed from, the step it
reached, how it ended and on which rank. Rank 0 writes its own end at once (`finished`, `exception: <type>:
<message>`, `hang: ...` from the watchdog); once rank 0 is gone, the attempt's recorder (recorder.py) settles it
from what every rank left, and so does the next start (`close_previous`, from `Evidence`, `gather_evidence`; under
the record's lock, `locked`): the ranks' own failure notes, the watchdog's heartbeats (the step) and
its SIGTERM stacks files (one left empty: a rank killed with no word, as by SIGKILL, the OOM killer or a lost
node; filled: a rank the launcher ended after another failed). A rank's own error or hang is the cause; failing
that, a rank killed with no word, not the survivors whose collectives then failed ("connection closed by peer").
What no rank left stays unknown (`last_step` None), never 0.

`no_progress(attempts, limit)`: when the last `limit` attempts of this launch all failed the same way at the same
step, restarting again would fail once more: the run stops with the reason instead. A launch is the attempts
since the launcher's count was last 0 (a person launching again starts a new one). The guard cannot keep the
launcher from restarting (any non-zero exit does), so each further restart stops at once, before training.
Written by hand: torchelastic keeps no record of why a worker failed beyond its exit code.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

FOLDER = "recovery"
ATTEMPTS_NAME = "attempts.json"
KILLED = "killed (no reason recorded: SIGKILL, the OOM killer or a lost node)"
REFUSED = "refused: restart loop"
NUMBER = re.compile(r"0x[0-9a-fA-F]+|\d+")
RANK_LOST = "a rank was lost"  # killed with no word, or seen to go by its peers: one failure for the guard
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
    failed_rank: int | None = None  # the rank whose error or hang ended it; else the rank killed with no word

    @property
    def failure(self) -> str | None:
        """What a failure is compared by: a hang by its kind; a lost rank as one failure, whether it was seen
        killed or only through a surviving rank's collective failing (whichever way the transport words it);
        anything else by its first line with every number left out (a peer's port, an address, a size or a time
        changes from one attempt to the next)."""
        if self.ended in ("finished", REFUSED):
            return None
        first = (self.ended or KILLED).splitlines()[0]
        if first.startswith("hang"):
            return "hang"
        return RANK_LOST if first == KILLED or lost_peer(first) else NUMBER.sub("#", first)


def lost_peer(reason: str) -> bool:
    """Whether a rank's failure is its collective failing because another rank went away."""
    return bool(LOST_PEER_WORDS.search(reason.splitlines()[0] if reason else ""))


def read_attempts(output_dir: str | os.PathLike) -> list[Attempt]:
    path = recovery_folder(output_dir) / ATTEMPTS_NAME
    if not path.is_file():
        return []
    try:
        rows = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return []  # a file cut by a crash: the record starts again, the run is not blocked by it
    return [Attempt(**row) for row in rows if isinstance(row, dict)]


@contextlib.contextmanager
def locked(output_dir: str | os.PathLike) -> Iterator[None]:
    """The record's lock, held around each read-modify-write: rank 0 of an attempt and the previous attempt's
    recorder (recorder.py) may settle it at once. Where the file system has no locks, unlocked."""
    folder = recovery_folder(output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / ".attempts.lock", "a") as handle:
        try:
            import fcntl

            fcntl.flock(handle, fcntl.LOCK_EX)
        except (ImportError, OSError):  # Windows, or a file system without flock
            pass
        yield  # the lock goes with the file's close


def write_attempts(output_dir: str | os.PathLike, attempts: list[Attempt]) -> None:
    folder = recovery_folder(output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    staged = folder / f".{ATTEMPTS_NAME}.tmp"
    staged.write_text(json.dumps([asdict(a) for a in attempts], indent=1), encoding="utf-8")
    staged.replace(folder / ATTEMPTS_NAME)  # one rename: the old record or the new one


@dataclass
class Evidence:
    """What the ranks of an attempt left behind (room.py gathers it at the next start)."""

    notes: list[dict]  # each failed rank's own account: {"rank", "reason", "step", "time"}
    killed: dict[int, int]  # rank -> its last heartbeat step: ranks that ended with no word and no SIGTERM
    steps: list[int]  # the steps of every heartbeat of the attempt
    last_seen: float | None  # the newest heartbeat's time


def heartbeat_path(folder: Path, rank: int) -> Path:
    return Path(folder) / f"heartbeat-rank{rank}.json"


def read_heartbeats(folder: Path) -> dict[int, dict]:
    beats = {}
    for path in Path(folder).glob("heartbeat-rank*.json"):
        with contextlib.suppress(OSError, ValueError, KeyError):
            beat = json.loads(path.read_text(encoding="utf-8"))
            beats[int(beat["rank"])] = beat
    return beats


TERMINATED = re.compile(r"stacks-rank(\d+)-attempt(\d+)-step(\d+)-terminated\.txt")


def read_terminated_stacks(folder: Path, attempt: int) -> dict[int, tuple[int, int]]:
    """The SIGTERM stacks files an attempt left: rank -> (the step in its name, its size; 0: the rank ended with
    no SIGTERM and no clean stop, as a SIGKILL ends it)."""
    found = {}
    for path in Path(folder).glob("stacks-rank*-attempt*-terminated.txt"):
        match = TERMINATED.fullmatch(path.name)
        if match and int(match[2]) == attempt:
            with contextlib.suppress(OSError):
                found[int(match[1])] = (int(match[3]), path.stat().st_size)
    return found


def gather_evidence(folder: Path, attempt: int, consume: bool) -> Evidence:
    """What the ranks of attempt number `attempt` left in the recovery folder; `consume`: the failure notes are
    removed once read (the next attempt's start; the recorder leaves them for it)."""
    notes = []
    for path in Path(folder).glob("failed-rank*.json"):
        with contextlib.suppress(OSError, ValueError):
            notes.append(json.loads(path.read_text(encoding="utf-8")))
        if consume:
            path.unlink(missing_ok=True)
    beats = [b for b in read_heartbeats(folder).values() if b.get("attempt") == attempt]
    killed = {rank: step for rank, (step, size) in read_terminated_stacks(folder, attempt).items() if size == 0}
    seen = [b["time"] for b in beats if isinstance(b.get("time"), (int, float))]
    return Evidence(notes, killed, [b["step"] for b in beats], max(seen, default=None))


def close_previous(attempts: list[Attempt], evidence: Evidence) -> None:
    """The previous attempt's end settled from what its ranks left: a rank's own error or hang first (the
    earliest), then a rank killed with no word (the lowest), then a survivor's failed collective (the rank that
    went is then unknown: the watchdog was off). Its last step: the furthest any rank reported."""
    if not attempts or attempts[-1].ended in ("finished", REFUSED):
        return
    previous, notes = attempts[-1], evidence.notes
    causes = sorted((n for n in notes if not lost_peer(n["reason"])), key=lambda n: n["time"])
    if causes:
        cause = causes[0]
        previous.ended, previous.failed_rank, previous.end_time = cause["reason"], cause["rank"], cause["time"]
    elif evidence.killed:
        previous.ended, previous.failed_rank = KILLED, min(evidence.killed)
        previous.end_time = max([n["time"] for n in notes] + [evidence.last_seen or 0.0]) or None
    elif notes:
        first = min(notes, key=lambda n: n["time"])
        previous.ended, previous.failed_rank, previous.end_time = first["reason"], None, first["time"]
    elif previous.ended is None:
        previous.ended, previous.end_time = KILLED, evidence.last_seen
    steps = [*evidence.steps, *(n["step"] for n in notes), *evidence.killed.values()]
    if previous.last_step is not None:
        steps.append(previous.last_step)
    previous.last_step = max(steps) if steps else None  # unknown, not 0


def this_launch(attempts: list[Attempt]) -> list[Attempt]:
    """The attempts since the launcher's restart count was last 0."""
    starts = [i for i, a in enumerate(attempts) if a.restart == 0]
    return attempts[starts[-1] :] if starts else attempts


def no_progress(attempts: list[Attempt], limit: int) -> str | None:
    """Why the run should stop: the last `limit` failed attempts of this launch failed the same way at the same
    step; None otherwise (or with `limit` 0)."""
    failed = [a for a in this_launch(attempts) if a.ended != REFUSED]
    last = failed[-limit:] if limit > 0 else []
    if len(last) < limit or any(a.failure is None or a.last_step is None for a in last):
        return None
    if len({(a.failure, a.last_step) for a in last}) != 1:
        return None
    where = f" (rank {last[-1].failed_rank})" if last[-1].failed_rank is not None else ""
    return (
        f"the last {limit} attempts all failed at step {last[-1].last_step} after resuming from step "
        f"{last[-1].resumed_step}: {last[-1].ended or KILLED}{where}"
    )


def begin_attempt(attempts: list[Attempt], resumed_step: int) -> Attempt:
    attempt = Attempt(restart=restart_count(), started=time.time(), resumed_step=resumed_step)
    attempts.append(attempt)
    return attempt
