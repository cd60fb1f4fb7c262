"""`HangWatchdog`: a rank that completes no optimizer step within a timeout dumps its stacks and exits.

A rank stuck in a collective (a peer stopped or wedged), a data worker that never answers or a deadlock in the
step make no error: the job sits there. Two threads per rank, so that a hung output file system (a common cause
of hangs) cannot keep the timeout from firing:
- the monitor reads memory only, every `poll_s`: the time of the last step (or of the start of a save or an
  evaluation, `long_phase`) against the timeout. Past it, it fires: every thread's Python stack (`faulthandler`)
  to `stacks-rank<r>-step<s>.txt` (to stderr when that cannot be written), NCCL's flight recorder where torch
  keeps one, which peers stopped reporting, the record (`on_hang`: attempts.py), all on a helper thread given
  `FIRE_IO_S`; then the rank exits with `HANG_EXIT_CODE` whatever happened, so a launcher with restarts left
  starts the run again (from the newest checkpoint with `resume_from_checkpoint="auto"`);
- the beat thread does every file operation: the heartbeat (`recovery/heartbeat-rank<r>.json`: step, phase, a
  counter `seq`, host, pid) every `heartbeat_s` (a tenth of the least timeout: 30 s by default) and, on rank 0, at
  each step (the step an attempt reached, exactly, for the record of a killed attempt and the restart-loop
  guard: ranks of a data-parallel step are at most one step apart); the SIGTERM stacks file renamed with it; the
  peers' heartbeats read when this rank's wait passes half its timeout. At 1,000 ranks and 30 s that is ~100
  metadata operations a second on the shared folder (2,000 when every rank wrote every second).
Whether a peer still reports is judged on the reader's own clock, never by comparing two nodes' clocks: a peer
whose `seq` did not change between the read at half the timeout and the read at firing (at least 5 heartbeat
periods apart) stopped reporting (stopped, dead, stuck holding its interpreter, or its file system hung). Only
ranks below `PEER_READERS` read the others' heartbeats (a million reads at 1,000 ranks otherwise, in one burst).
When the launcher ends a rank with SIGTERM (it does to every rank once one failed), `faulthandler`'s signal
handler writes its stacks to `stacks-rank<r>-attempt<a>-step<s>-terminated.txt` before the default action ends
it, even inside a collective's C code. The file is opened at the start (the handler cannot open one), renamed
with the heartbeat, removed at a clean stop: one left empty belonged to a rank killed with no word (SIGKILL, the
OOM killer, a lost node), which is how the record tells the killed rank from the ones that saw it go.

The timeout: `factor` x the median of the last steps' durations, at least `min_s`; `floor_s` until
`WARMUP_STEPS` steps were timed and during a save or an evaluation. Every one ends `COLLECTIVE_MARGIN_S` before
`collective_timeout_s` (`ddp_timeout`), at which NCCL's own watchdog aborts a rank stuck in a collective
(SIGABRT: no Python stacks, no record) and gloo raises: ours fires first, and ddp_timeout stays the bound the
user chose for any collective wait. Written by hand: torch elastic's expiration timers (`TORCHELASTIC_ENABLE_FILE_TIMER`)
SIGKILL a worker from the agent with no stacks, and NVIDIA's Resiliency Extension (rank monitors outside the
training process, timeouts learned from the run's heartbeats) needs its own launcher (`ft_launcher`): see
docs/resume.md.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import signal
import socket
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from transformers.utils import logging

from .attempts import heartbeat_path

logger = logging.get_logger(__name__)

HANG_EXIT_CODE = 124  # as timeout(1): the launcher restarts on any non-zero exit
WARMUP_STEPS = 3
TIMED_STEPS = 50  # the median is of the last this-many step durations
FIRE_IO_S = 30.0  # the stacks, the peers' heartbeats and the record get this long; the rank exits then regardless
COLLECTIVE_MARGIN_S = 60.0  # every timeout ends this long before ddp_timeout (NCCL's watchdog, gloo's timeout)
PEER_READERS = 8  # the ranks that read every other rank's heartbeat when they fire
TRACE_ENTRIES = "2000"  # NCCL's flight recorder: the collectives it keeps (TORCH_NCCL_TRACE_BUFFER_SIZE)


@dataclass(frozen=True)
class WatchdogSettings:
    factor: float = 10.0
    min_s: float = 300.0
    floor_s: float = 1800.0
    poll_s: float = 1.0
    collective_timeout_s: float | None = None  # ddp_timeout: every timeout ends COLLECTIVE_MARGIN_S before it

    def __post_init__(self):
        for name in ("factor", "min_s", "floor_s", "poll_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"hang watchdog: {name}={getattr(self, name)!r} must be positive.")

    @property
    def heartbeat_s(self) -> float:
        """A tenth of the least timeout: a peer's is read 5 periods apart at least (half a timeout)."""
        return min(self.min_s, self.floor_s) / 10

    @property
    def cap_s(self) -> float | None:
        """The longest any timeout may be: before NCCL's watchdog (or gloo's timeout) ends a collective."""
        return None if self.collective_timeout_s is None else self.collective_timeout_s - COLLECTIVE_MARGIN_S


def flight_recorder_environment(output_dir: str | os.PathLike | None) -> dict[str, str]:
    """What NCCL reads when its process group starts so that a hang leaves its flight recorder (the collectives
    in flight, for `_dump_collective_trace`), and NCCL's own dump in the recovery folder should its watchdog fire
    first. Nothing when the user set a buffer size; gloo ignores them."""
    if os.environ.get("TORCH_NCCL_TRACE_BUFFER_SIZE") or os.environ.get("TORCH_FR_BUFFER_SIZE"):
        return {}
    environment = {"TORCH_NCCL_TRACE_BUFFER_SIZE": TRACE_ENTRIES, "TORCH_NCCL_DUMP_ON_TIMEOUT": "1"}
    if output_dir is not None:  # the older name and the newer (torch >= 2.8)
        prefix = str(Path(output_dir) / "recovery" / "nccl-flight-recorder-rank")
        environment |= {"TORCH_NCCL_DEBUG_INFO_TEMP_FILE": prefix, "TORCH_FR_DUMP_TEMP_FILE": prefix}
    return environment


def _where(rank: int, step: int | None, phase: str | None) -> str:
    return f"{rank} (step {step}{', in ' + phase if phase else ''})"


class HangWatchdog:
    def __init__(
        self,
        folder: str | os.PathLike,
        rank: int,
        world_size: int,
        settings: WatchdogSettings,
        attempt: int = 0,
        on_hang: Callable[[str], None] | None = None,
        exit: Callable[[int], None] = os._exit,
    ):
        self.folder, self.rank, self.world_size = Path(folder), rank, world_size
        self.settings, self.attempt = settings, attempt
        self.on_hang, self._exit = on_hang, exit
        self.step = 0
        self.durations: deque[float] = deque(maxlen=TIMED_STEPS)
        self.steps_timed = 0
        # (the phase or None, since when): one attribute set at once, so the monitor never reads half of a change
        self._clock: tuple[str | None, float] = (None, time.monotonic())
        self.fired: str | None = None
        self.exact_steps = rank == 0  # rank 0's heartbeat follows each step
        self.reads_peers = rank < PEER_READERS
        self._stop = threading.Event()
        self._wake = threading.Event()  # wakes the beat thread: a step on rank 0, a read of the peers wanted
        self._threads: list[threading.Thread] = []
        self._seq = 0
        self._written_step: int | None = None
        self._peers_wanted: float | None = None  # the stall (its `since`) whose peers the monitor wants read
        self._peers_first: tuple[float, float, dict[int, dict]] | None = None  # (stall, read at, beats)
        self._terminated = None  # the open file SIGTERM writes the stacks to
        self._terminated_path: Path | None = None  # its name now (renamed with the heartbeat)

    @property
    def phase(self) -> str | None:
        return self._clock[0]

    # The training thread's side: a clock read per step, nothing written (the beat thread writes).
    def start(self, step: int) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.step, self._clock = step, (None, time.monotonic())
        self._dump_stacks_on_sigterm()
        for target, name in ((self._monitor, "monitor"), (self._beats, "beat")):
            thread = threading.Thread(target=target, name=f"hf_pretrain-hang-watchdog-{name}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def beat(self, step: int) -> None:
        now = time.monotonic()
        phase, since = self._clock
        if phase is None and step > self.step:
            self.durations.append((now - since) / (step - self.step))
            self.steps_timed += 1
        self.step = step
        if phase is None:
            self._clock = (None, now)
        if self.exact_steps:
            self._wake.set()  # the heartbeat carries the step a kill -9 interrupts, not one a beat behind

    @contextlib.contextmanager
    def long_phase(self, name: str):
        """A save or an evaluation: the floor applies while it runs, the step timeout again after it, counted
        from its end (one assignment: a poll never sees the phase over with the activity time before it)."""
        outer = self._clock[0]
        self._clock = (name, time.monotonic())
        try:
            yield
        finally:
            self._clock = (outer, time.monotonic())

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout=5 * self.settings.poll_s)  # a beat stuck in a hung file system stays behind
        self._forget_sigterm()

    def terminated_stacks_path(self, step: int | None = None) -> Path:
        step = self.step if step is None else step
        return self.folder / f"stacks-rank{self.rank}-attempt{self.attempt}-step{step}-terminated.txt"

    def _dump_stacks_on_sigterm(self) -> None:
        if not hasattr(faulthandler, "register"):  # Windows
            return
        for stale in self.folder.glob(f"stacks-rank{self.rank}-attempt*-terminated.txt"):
            with contextlib.suppress(OSError):
                if stale.stat().st_size == 0:  # an attempt that ended without SIGTERM (SIGKILL, a hang's exit)
                    stale.unlink()
        self._terminated_path = self.terminated_stacks_path()
        self._terminated = self._terminated_path.open("w", encoding="utf-8")  # open until stop()
        faulthandler.register(signal.SIGTERM, file=self._terminated, all_threads=True, chain=True)

    def _name_terminated_stacks(self, step: int) -> None:
        """The SIGTERM file renamed after the step of the heartbeat (the beat thread; the file stays open)."""
        path = self.terminated_stacks_path(step)
        if self._terminated is not None and self._terminated_path != path:
            self._terminated_path.replace(path)
            self._terminated_path = path

    def _forget_sigterm(self) -> None:
        if self._terminated is not None:
            faulthandler.unregister(signal.SIGTERM)
            self._terminated.close()
            self._terminated_path.unlink(missing_ok=True)
            self._terminated = self._terminated_path = None

    # The monitor thread: memory only.
    def timeout_s(self) -> tuple[float, str]:
        return self._timeout(self._clock[0])

    def _timeout(self, phase: str | None) -> tuple[float, str]:
        s = self.settings
        if phase is not None:
            timeout, why = s.floor_s, f"the floor during {phase}"
        elif self.steps_timed < WARMUP_STEPS:
            timeout, why = s.floor_s, f"the floor until {WARMUP_STEPS} steps are timed"
        else:
            median = statistics.median(self.durations)
            timeout, why = max(s.factor * median, s.min_s), f"{s.factor:g} x the median step time {median:.3g} s"
            why = why if s.factor * median >= s.min_s else f"the minimum; {why} is less"
        if s.cap_s is not None and timeout > s.cap_s:
            return s.cap_s, f"ddp_timeout less {COLLECTIVE_MARGIN_S:g} s, before NCCL's own watchdog; {why}"
        return timeout, why

    def overdue(self) -> tuple[float, float, str] | None:
        """(waited, timeout, why) when the rank waited past its timeout, else None: what each poll checks."""
        phase, since = self._clock
        timeout, why = self._timeout(phase)
        waited = time.monotonic() - since
        return (waited, timeout, why) if waited > timeout else None

    def _monitor(self) -> None:
        while not self._stop.wait(self.settings.poll_s):
            phase, since = self._clock
            timeout, _ = self._timeout(phase)
            if self.reads_peers and time.monotonic() - since > timeout / 2 and self._peers_wanted != since:
                self._peers_wanted = since
                self._wake.set()
            late = self.overdue()
            if late is not None and not self._stop.is_set():
                self._fire(*late)
                return

    # The beat thread: every file operation of a healthy run.
    def _beats(self) -> None:
        next_beat = 0.0
        while not self._stop.is_set():
            self._wake.wait(max(0.0, next_beat - time.monotonic()))
            self._wake.clear()
            if self._stop.is_set():
                return
            now = time.monotonic()
            with contextlib.suppress(OSError):
                if now >= next_beat or (self.exact_steps and self.step != self._written_step):
                    next_beat = now + self.settings.heartbeat_s
                    self._write_heartbeat()
                wanted = self._peers_wanted
                if wanted is not None and (self._peers_first is None or self._peers_first[0] != wanted):
                    self._peers_first = (wanted, time.monotonic(), self._read_peers())

    def _write_heartbeat(self) -> None:
        self._seq += 1
        step = self.step
        beat = {
            "rank": self.rank,
            "attempt": self.attempt,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "step": step,
            "phase": self._clock[0],
            "seq": self._seq,
            "time": time.time(),  # for people reading the file; no rank judges another's clock
        }
        path = heartbeat_path(self.folder, self.rank)
        staged = path.with_name(f".{path.name}.tmp")
        staged.write_text(json.dumps(beat), encoding="utf-8")
        staged.replace(path)
        self._written_step = step
        self._name_terminated_stacks(step)

    def _read_peers(self) -> dict[int, dict]:
        beats = {}
        for rank in range(self.world_size):
            with contextlib.suppress(OSError, ValueError):
                if rank != self.rank:
                    beats[rank] = json.loads(heartbeat_path(self.folder, rank).read_text(encoding="utf-8"))
        return beats

    # Firing.
    def _fire(self, waited: float, timeout: float, why: str) -> None:
        """Report on a helper thread given FIRE_IO_S (the files may hang with the run), then exit, whatever
        happened on the way."""
        phase, step = self._clock[0], self.step
        where = f" in {phase}" if phase else ""
        head = (
            f"hang: no optimizer step for {waited:.0f} s{where} after step {step} on rank {self.rank} "
            f"(timeout {timeout:.0f} s: {why})"
        )
        self.fired = head
        try:
            report = threading.Thread(target=self._report, args=(head, waited, step), daemon=True)
            report.start()
            report.join(FIRE_IO_S)
            if report.is_alive():
                logger.error(f"{head}; its files did not answer within {FIRE_IO_S:g} s: the stacks follow on stderr.")
                faulthandler.dump_traceback(file=2, all_threads=True)
        finally:
            self._exit(HANG_EXIT_CODE)

    def _report(self, head: str, waited: float, step: int) -> None:
        dumped = self._dump_stacks(waited, step) + self._dump_collective_trace(step)
        self.fired = f"{head}; {self.peers()}. Stacks: {', '.join(dumped)}"
        logger.error(self.fired + f". Exiting with {HANG_EXIT_CODE} so the launcher can restart the run.")
        if self.on_hang is not None:
            with contextlib.suppress(Exception):
                self.on_hang(self.fired)
        with contextlib.suppress(OSError):
            self._forget_sigterm()  # its stacks are written above

    def _dump_stacks(self, waited: float, step: int) -> list[str]:
        stacks = self.folder / f"stacks-rank{self.rank}-step{step}.txt"
        try:
            with stacks.open("w", encoding="utf-8") as f:
                f.write(f"rank {self.rank}, step {step}, no optimizer step for {waited:.1f} s\n")
                f.flush()
                faulthandler.dump_traceback(file=f, all_threads=True)
            return [str(stacks)]
        except OSError as error:
            faulthandler.dump_traceback(file=2, all_threads=True)
            return [f"stderr ({stacks} could not be written: {error})"]

    def peers(self) -> str:
        """Which ranks stopped reporting, and where the others are (judged on this rank's clock)."""
        if not self.reads_peers:
            return f"the other ranks: in the reports of ranks 0-{PEER_READERS - 1}"
        stall = self._clock[1]
        first = self._peers_first if self._peers_first is not None and self._peers_first[0] == stall else None
        beats = self._read_peers()
        stopped, waiting = [], [_where(self.rank, self.step, self.phase)]
        for rank in range(self.world_size):
            beat = beats.get(rank)
            if rank == self.rank:
                continue
            if beat is None or beat.get("attempt") != self.attempt:
                stopped.append(f"rank {rank} never reported in this attempt")
            elif first is not None and rank in first[2] and first[2][rank].get("seq") == beat.get("seq"):
                stopped.append(
                    f"rank {rank} ({beat.get('host')}, pid {beat.get('pid')}) stopped reporting: its heartbeat did "
                    f"not change in {time.monotonic() - first[1]:.0f} s (its last: step {beat.get('step')}): "
                    "stopped, dead, stuck holding its interpreter, or its file system hung"
                )
            else:
                waiting.append(_where(rank, beat.get("step"), beat.get("phase")))
        unknown = "" if first is not None else " (no earlier read of the heartbeats: who stopped is not known)"
        alive = f"ranks alive but making no step: {', '.join(waiting)}{unknown}"
        return "; ".join(stopped + [alive]) if stopped else f"every rank still reports; {alive}"

    def _dump_collective_trace(self, step: int) -> list[str]:
        """NCCL's flight recorder (the collectives in flight), where torch keeps one (TORCH_NCCL_TRACE_BUFFER_SIZE)."""
        try:
            import torch.distributed as dist
            from torch._C._distributed_c10d import _dump_nccl_trace  # private, present in NCCL builds only

            if not (dist.is_initialized() and dist.get_backend() == "nccl"):
                return []
            path = self.folder / f"nccl-trace-rank{self.rank}-step{step}.pkl"
            path.write_bytes(_dump_nccl_trace())
            return [str(path)]
        except Exception:  # a CPU build, gloo, or no trace buffer
            return []
