"""`HangWatchdog`: a rank that completes no optimizer step within a timeout dumps its stacks and exits.

A rank stuck in a collective (a peer stopped or wedged), a data worker that never answers or a deadlock in the
step make no error: the job sits there. Each rank runs a thread that wakes every `poll_s` and at each step:
- it writes the rank's heartbeat (`OUTPUT_DIR/recovery/heartbeat-rank<r>.json`: the last step, when it ended,
  and `alive`, the thread's own time) so the other ranks can tell who stopped reporting: a rank whose
  heartbeat stopped is stopped (SIGSTOP), dead or stuck holding the interpreter; one that still beats but
  makes no step waits for someone; written at each step, it gives a killed attempt's last step exactly (the
  restart-loop guard compares them);
- past the timeout without a step it writes every thread's Python stack (`faulthandler`) to
  `stacks-rank<r>-step<s>.txt` (and NCCL's flight recorder where torch keeps one), logs which ranks stopped
  reporting, records the hang in the attempts (`attempts.py`) and exits with `HANG_EXIT_CODE`, so a launcher
  with restarts left starts the run again (from the newest checkpoint with `resume_from_checkpoint="auto"`);
- when the launcher ends the rank with SIGTERM (it does to every rank once one failed, the hung rank's own exit
  included), `faulthandler`'s signal handler writes its stacks to
  `stacks-rank<r>-attempt<a>-step<s>-terminated.txt` before the default action ends it: a rank waiting in a
  collective is caught in C code, where no Python handler would run. The file is opened at the start (the handler
  cannot open one), renamed by the watchdog thread as the steps go (the open file stays the handler's, so its name
  carries the last step the rank completed), and removed at a clean stop.

The timeout: `factor` x the median of the last steps' durations, at least `min_s`; `floor_s` until
`WARMUP_STEPS` steps were timed (compilation, the first collectives, data start-up) and during a save or an
evaluation (`phase`), which can legitimately take minutes. Written by hand: torch's NCCL watchdog only covers a
collective on a GPU (not gloo, not a data worker, not a stopped peer's own rank), and NVIDIA's Resiliency
Extension (its rank monitors) is a Megatron-side service with its own launcher.
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

logger = logging.get_logger(__name__)

HANG_EXIT_CODE = 124  # as timeout(1): the launcher restarts on any non-zero exit
WARMUP_STEPS = 3
TIMED_STEPS = 50  # the median is of the last this-many step durations
STOPPED_AFTER_POLLS = 5  # a heartbeat this many polls old: the rank stopped reporting


@dataclass(frozen=True)
class WatchdogSettings:
    factor: float = 10.0
    min_s: float = 300.0
    floor_s: float = 1800.0
    poll_s: float = 1.0

    def __post_init__(self):
        for name in ("factor", "min_s", "floor_s", "poll_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"hang watchdog: {name}={getattr(self, name)!r} must be positive.")


def heartbeat_path(folder: Path, rank: int) -> Path:
    return folder / f"heartbeat-rank{rank}.json"


def read_heartbeats(folder: Path) -> dict[int, dict]:
    beats = {}
    for path in folder.glob("heartbeat-rank*.json"):
        with contextlib.suppress(OSError, ValueError):
            beat = json.loads(path.read_text(encoding="utf-8"))
            beats[int(beat["rank"])] = beat
    return beats


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
        self.step, self.step_time = 0, time.time()
        self.durations: deque[float] = deque(maxlen=TIMED_STEPS)
        self.steps_timed = 0
        self.phase: str | None = None
        self.phase_since = 0.0
        self.fired: str | None = None
        self._stop = threading.Event()
        self._stepped = threading.Event()  # wakes the watchdog thread to write the new step at once
        self._thread: threading.Thread | None = None
        self._last_activity = time.monotonic()
        self._terminated = None  # the open file SIGTERM writes the stacks to
        self._terminated_path: Path | None = None  # its name now (renamed as the steps go)

    # The training thread's side: one clock read per step, nothing written (the watchdog thread writes the step).
    def start(self, step: int) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.step, self.step_time, self._last_activity = step, time.time(), time.monotonic()
        self._write_heartbeat()
        self._dump_stacks_on_sigterm()
        self._thread = threading.Thread(target=self._run, name="hf_pretrain-hang-watchdog", daemon=True)
        self._thread.start()

    def beat(self, step: int) -> None:
        now = time.monotonic()
        if self.phase is None and step > self.step:
            self.durations.append((now - self._last_activity) / (step - self.step))
            self.steps_timed += 1
        self.step, self.step_time, self._last_activity = step, time.time(), now
        self._stepped.set()  # the heartbeat carries the step a kill -9 interrupts, not one a poll behind

    @contextlib.contextmanager
    def long_phase(self, name: str):
        """A save or an evaluation: the floor applies while it runs, the step timeout again after it."""
        outer = self.phase
        self.phase, self.phase_since = name, time.monotonic()
        try:
            yield
        finally:
            self.phase = outer
            self._last_activity = time.monotonic()

    def stop(self) -> None:
        self._stop.set()
        self._stepped.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5 * self.settings.poll_s)
        self._forget_sigterm()

    def terminated_stacks_path(self) -> Path:
        return self.folder / f"stacks-rank{self.rank}-attempt{self.attempt}-step{self.step}-terminated.txt"

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

    def _name_terminated_stacks(self) -> None:
        """The SIGTERM file renamed after the last step (the watchdog thread, at each step; the file stays open)."""
        path = self.terminated_stacks_path()
        if self._terminated is not None and self._terminated_path != path:
            with contextlib.suppress(OSError):
                self._terminated_path.replace(path)
                self._terminated_path = path

    def _forget_sigterm(self) -> None:
        if self._terminated is not None:
            faulthandler.unregister(signal.SIGTERM)
            self._terminated.close()
            self._terminated_path.unlink(missing_ok=True)
            self._terminated = self._terminated_path = None

    # The watchdog thread's side.
    def timeout_s(self) -> tuple[float, str]:
        s = self.settings
        if self.phase is not None:
            return s.floor_s, f"the floor during {self.phase}"
        if self.steps_timed < WARMUP_STEPS:
            return s.floor_s, f"the floor until {WARMUP_STEPS} steps are timed"
        median = statistics.median(self.durations)
        if s.factor * median >= s.min_s:
            return s.factor * median, f"{s.factor:g} x the median step time {median:.3g} s"
        return s.min_s, f"the minimum; {s.factor:g} x the median step time {median:.3g} s is less"

    def _run(self) -> None:
        while not self._stop.is_set():
            self._stepped.wait(self.settings.poll_s)
            self._stepped.clear()
            if self._stop.is_set():
                return
            with contextlib.suppress(OSError):
                self._write_heartbeat()
            self._name_terminated_stacks()
            timeout, why = self.timeout_s()
            since = self.phase_since if self.phase is not None else self._last_activity
            waited = time.monotonic() - since
            if waited > timeout and not self._stop.is_set():
                self._fire(waited, timeout, why)
                return

    def _write_heartbeat(self) -> None:
        beat = {
            "rank": self.rank,
            "attempt": self.attempt,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "step": self.step,
            "step_time": self.step_time,
            "phase": self.phase,
            "alive": time.time(),
        }
        path = heartbeat_path(self.folder, self.rank)
        staged = path.with_name(f".{path.name}.tmp")
        staged.write_text(json.dumps(beat), encoding="utf-8")
        staged.replace(path)

    def _fire(self, waited: float, timeout: float, why: str) -> None:
        stacks = self.folder / f"stacks-rank{self.rank}-step{self.step}.txt"
        with stacks.open("w", encoding="utf-8") as f:
            f.write(f"rank {self.rank}, step {self.step}, no optimizer step for {waited:.1f} s\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)
        dumped = [str(stacks)] + self._dump_collective_trace()
        where = f" in {self.phase}" if self.phase else ""
        self.fired = (
            f"hang: no optimizer step for {waited:.0f} s{where} after step {self.step} on rank {self.rank} "
            f"(timeout {timeout:.0f} s: {why}); {self.peers()}. Stacks: {', '.join(dumped)}"
        )
        logger.error(self.fired + f". Exiting with {HANG_EXIT_CODE} so the launcher can restart the run.")
        if self.on_hang is not None:
            with contextlib.suppress(Exception):
                self.on_hang(self.fired)
        self._forget_sigterm()  # its stacks are written above
        self._exit(HANG_EXIT_CODE)

    def peers(self) -> str:
        """Which ranks stopped reporting, and where the others are."""
        beats, now = read_heartbeats(self.folder), time.time()
        stale_s = STOPPED_AFTER_POLLS * self.settings.poll_s
        stopped, waiting = [], []
        for rank in range(self.world_size):
            beat = beats.get(rank)
            if beat is None or beat.get("attempt") != self.attempt:
                stopped.append(f"rank {rank} never reported in this attempt")
            elif now - beat["alive"] > stale_s:
                stopped.append(
                    f"rank {rank} ({beat['host']}, pid {beat['pid']}) stopped reporting {now - beat['alive']:.0f} s ago "
                    f"(its last heartbeat: step {beat['step']}): stopped, dead or stuck holding its interpreter"
                )
            else:
                waiting.append(f"{rank} (step {beat['step']}{', in ' + beat['phase'] if beat.get('phase') else ''})")
        alive = f"ranks alive but making no step: {', '.join(waiting)}" if waiting else "no rank alive"
        return "; ".join(stopped + [alive]) if stopped else f"every rank still reports; {alive}"

    def _dump_collective_trace(self) -> list[str]:
        """NCCL's flight recorder (the collectives in flight), where torch keeps one (TORCH_NCCL_TRACE_BUFFER_SIZE)."""
        try:
            import torch.distributed as dist
            from torch._C._distributed_c10d import _dump_nccl_trace  # private, present in NCCL builds only

            if not (dist.is_initialized() and dist.get_backend() == "nccl"):
                return []
            path = self.folder / f"nccl-trace-rank{self.rank}-step{self.step}.pkl"
            path.write_bytes(_dump_nccl_trace())
            return [str(path)]
        except Exception:  # a CPU build, gloo, or no trace buffer
            return []
