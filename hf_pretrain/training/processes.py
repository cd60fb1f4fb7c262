"""The processes of a run: a launch that lost its ranks, a DeepSpeed process without a launcher, a clean exit.

- `check_launched_world_size(args)`: the launcher started several processes but the Trainer sees
  one (a GPU launch config on a CPU-only machine without `use_cpu`): refused, since silent
  single-process training wastes the other ranks.
- `single_process_rendezvous()`: DeepSpeed started without a launcher (`python train.py --deepspeed
  ...`, or `accelerate launch` with one process) looks for MPI and fails ("No module named
  'mpi4py'"); this gives it the rendezvous of one process, as a launcher would. Nothing changes when
  a launcher set one.
- `wait_for_everyone(accelerator)`: a barrier only when there is a process group (accelerate's
  would fail for one DeepSpeed process before the engine creates the group).
- `leave_process_group()`: registered with `atexit` by `PretrainTrainer`. A gloo or NCCL group still
  alive at interpreter teardown is destroyed in an arbitrary order with its worker threads, which
  aborts the process now and then ("terminate called without an active exception", SIGABRT); user
  scripts rarely call `destroy_process_group()`. Under gloo the ranks first meet at a barrier
  (bounded: a peer that died makes it fail at once), so no rank closes its connections while
  another still uses them.

  Destroying the group is not enough under gloo: whatever still holds it (a DDP module: its
  reducer, its comm hooks) keeps its worker threads (`pt_gloo_runloop`) until the process ends.
  A worker that finished a collective but was not yet scheduled again to release it (a loaded
  machine) drops its last reference to the collective's Python tensors later, which takes the
  GIL; once the interpreter is finalizing, CPython ends such a thread with `pthread_exit`, whose
  forced unwind through a `noexcept` frame calls `std::terminate` (the mechanism described in
  pytorch/pytorch#179291): the same SIGABRT, also after `accelerator.end_training()`. Seen once in
  3 rounds of the 41 multi-process tests, and in 5 of 20 launches of two ranks that hold their
  group at module level (tests/distributed/held_group_exit.py), against 0 of 20 with the wait
  below, launches alternating on the shared 2-core machine. So the exit then waits, the GIL
  released, until no gloo thread of the process has been running or runnable for 3 checks 10 ms
  apart (Linux: the threads' states in /proc/self/task; elsewhere a fixed 50 ms), at most 2 s;
  without gloo threads it returns at once.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket
import time
from pathlib import Path

import torch.distributed as dist


def check_launched_world_size(world_size: int) -> None:
    launched = int(os.environ.get("WORLD_SIZE", "1"))
    if launched != world_size:
        raise RuntimeError(
            f"The launcher started {launched} processes but the Trainer runs with world_size={world_size}. "
            "On a CPU-only machine pass use_cpu=True (PretrainingArguments does it by default) so the ranks join over gloo."
        )


def single_process_rendezvous() -> None:
    if "WORLD_SIZE" in os.environ or "OMPI_COMM_WORLD_SIZE" in os.environ:
        return
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(name, value)
    os.environ.setdefault("MASTER_PORT", str(port))


def wait_for_everyone(accelerator) -> None:
    if dist.is_available() and dist.is_initialized():
        accelerator.wait_for_everyone()


def leave_process_group() -> None:
    if dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):
            if dist.get_backend() == "gloo":
                dist.monitored_barrier(timeout=datetime.timedelta(seconds=60))
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    settle_gloo_threads()


GLOO_THREADS = ("pt_gloo", "gloo_")  # the names torch's gloo backend gives its worker and transport threads
TASKS = Path("/proc/self/task")


def gloo_thread_states() -> list[str] | None:
    """The scheduler state ("R" running or runnable, "S" sleeping, ...) of each gloo thread of this process; None
    where /proc does not tell (not Linux)."""
    if not TASKS.is_dir():
        return None
    states = []
    for task in TASKS.iterdir():
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            if (task / "comm").read_text().startswith(GLOO_THREADS):
                states.append((task / "stat").read_text().rpartition(")")[2].split()[0])
    return states


def settle_gloo_threads(quiet_checks: int = 3, interval_s: float = 0.01, timeout_s: float = 2.0) -> None:
    """Sleep (the GIL released) until no gloo thread has been running or runnable for `quiet_checks` checks in a
    row (see the module docstring); returns at once when the process has no gloo thread."""
    states = gloo_thread_states()
    if states is None:
        time.sleep(0.05)
        return
    deadline, quiet = time.monotonic() + timeout_s, 0
    while states and quiet < quiet_checks and time.monotonic() < deadline:
        time.sleep(interval_s)
        states = gloo_thread_states()
        quiet = 0 if "R" in states else quiet + 1
