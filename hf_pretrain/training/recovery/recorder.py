"""The recorder: a small process beside rank 0 that settles an attempt's record once rank 0 is gone.

Rank 0 writes its own end at once (finished, its exception, its hang). What ends an attempt from outside writes
nothing: a rank SIGKILLed (the OOM killer, a lost node) leaves no word, and the launcher then ends the survivors
with SIGTERM, rank 0 included, often before their collective has even failed. Settled only at the next start (a
restart, a relaunch), a launch that nothing restarted kept `"ended": null`, or rank 0's "Connection closed by
peer" as if rank 0 had failed. The recorder is started by rank 0 with the hang watchdog (whose heartbeats and
SIGTERM stacks files are the evidence), in a session of its own (the launcher signals a worker's whole process
group). It waits for rank 0's end: the pipe rank 0 holds closes (`release()` after rank 0 wrote its end, or any
death, SIGKILL included), or rank 0 is no longer its parent. Unless the attempt finished, it then waits for the
other ranks of this host to end (their pids are in their heartbeats; at most `PEERS_S`) and for the folder to stop
changing (`STABLE_S`: the notes of other hosts' ranks), settles the attempt as the next start would
(`attempts.close_previous`) under the record's lock, and exits: a second or two after a failure, at once after a
clean finish. It leaves the ranks' notes for the next start, which settles again from the same evidence and
more; what the recorder cannot see (its host lost with rank 0, the job's cgroup killed) is still settled there.

Stdlib only and started by path, so it costs a fraction of a second, not the seconds of importing torch.
Written by hand: torch elastic's agent knows which worker died first, but keeps it in its own log only.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import subprocess
import sys
import time
from pathlib import Path

try:
    from . import attempts as record
except ImportError:  # run by path as the recorder process: no package (stdlib only)
    import attempts as record

POLL_S = 0.2
PEERS_S = 30.0  # the longest it waits for the other ranks of its host (torch elastic SIGKILLs after 30 s)
STABLE_S = 1.0  # the folder unchanged this long: the ranks of other hosts have left their notes

_HELD: set[int] = set()  # the pipes' write ends this process holds; a forked child (a dataloader worker) closes them


def _close_in_child() -> None:
    for fd in _HELD:
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_in_child)


class Recorder:
    """Rank 0's handle on the recorder of attempt number `attempt`: the write end of its pipe."""

    def __init__(self, output_dir: str | os.PathLike, attempt: int):
        read, self._write = os.pipe()
        try:
            self.process = subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), str(output_dir), str(attempt)],
                stdin=read,
                stdout=subprocess.DEVNULL,
                start_new_session=True,  # the launcher's SIGTERM/SIGKILL of rank 0's process group spares it
            )
        except BaseException:
            os.close(self._write)
            raise
        finally:
            os.close(read)
        _HELD.add(self._write)

    def release(self) -> None:
        """Rank 0 wrote its end: the recorder settles the attempt (or, finished, just exits)."""
        if self._write in _HELD:
            _HELD.discard(self._write)
            with contextlib.suppress(OSError):
                os.close(self._write)


def pending(attempts: list, attempt: int) -> bool:
    """Whether attempt number `attempt` is still the newest and ended neither finished nor refused."""
    return len(attempts) == attempt + 1 and attempts[attempt].ended not in ("finished", record.REFUSED)


def alive(pid: int) -> bool:
    """Whether process `pid` runs (a zombie, ended but not yet reaped by its launcher, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    with contextlib.suppress(OSError, IndexError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return True


def wait_for_rank0(parent: int) -> None:
    """Until the pipe closes (rank 0 released it, or died) or rank 0 is no longer this process's parent."""
    while os.getppid() == parent:
        ready, _, _ = select.select([sys.stdin.fileno()], [], [], POLL_S)
        if ready and not os.read(sys.stdin.fileno(), 4096):
            return


def wait_for_peers(folder: Path, attempt: int, parent: int) -> None:
    """Until the other ranks of this host ended, then the folder stayed unchanged `STABLE_S` (at most `PEERS_S`)."""
    deadline, host = time.monotonic() + PEERS_S, socket.gethostname()
    beats = [b for b in record.read_heartbeats(folder).values() if b.get("attempt") == attempt]
    local = [b["pid"] for b in beats if b.get("host") == host and isinstance(b.get("pid"), int) and b["pid"] != parent]
    while any(alive(pid) for pid in local) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    seen, since = None, time.monotonic()
    while time.monotonic() < deadline:
        now = snapshot(folder)
        if now != seen:
            seen, since = now, time.monotonic()
        elif time.monotonic() - since >= STABLE_S:
            return
        time.sleep(POLL_S)


def snapshot(folder: Path) -> list[tuple[str, int]]:
    """The folder's files and sizes (one removed while listed is left out)."""
    files = []
    for path in folder.iterdir():
        with contextlib.suppress(OSError):
            files.append((path.name, path.stat().st_size))
    return sorted(files)


def settle(output_dir: str, attempt: int) -> None:
    folder = record.recovery_folder(output_dir)
    with record.locked(output_dir):
        attempts = record.read_attempts(output_dir)
        if pending(attempts, attempt):
            record.close_previous(attempts, record.gather_evidence(folder, attempt, consume=False))
            record.write_attempts(output_dir, attempts)


def main(output_dir: str, attempt: int) -> None:
    parent = os.getppid()
    wait_for_rank0(parent)
    if pending(record.read_attempts(output_dir), attempt):
        wait_for_peers(record.recovery_folder(output_dir), attempt, parent)
        settle(output_dir, attempt)


if __name__ == "__main__":
    try:
        main(sys.argv[1], int(sys.argv[2]))
    except Exception as error:  # one line on the run's stderr; the next start settles the attempt instead
        print(f"hf_pretrain recorder: attempt {sys.argv[2]} of {sys.argv[1]} not settled: {error!r}", file=sys.stderr)
        raise SystemExit(1) from None
