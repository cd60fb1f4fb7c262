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
- `workers_start_warning(args)`: the same gloo threads make DataLoader workers started with `fork`
  (Linux's default before Python 3.14) able to hang. A gloo thread that takes the GIL creates a
  thread state under the interpreter's runtime lock; a fork at that moment leaves the lock held in
  the child, and CPython before the gh-112275 fix (3.11.7 here; fixed in 3.12 and later on the 3.11
  branch) waits on it forever right after `os.fork()`: the rank waits on its worker, the other
  ranks in their next collective.
  Seen once in about 1,000 worker forks by ranks (round 28 of the repeated multi-process tests: the
  child stuck in `os.fork()` holding a second, foreign thread state; stacks in
  tests/repeat_record/round-28-hang-stacks.txt). `forkserver` is no cure for a rank that can die:
  its workers are the server's children, and torch's worker watchdog (2.13) only notices its
  parent's death, so a SIGKILLed rank leaves its workers and the server running, holding the
  launcher's output pipes open (seen: the killed-rank test waited on its launch until stopped by
  hand 15 min later). `spawn` starts each worker as a fresh interpreter, a child of the rank:
  neither. Plain `Trainer` runs the same risks, and its arguments stay the user's, so this only
  warns (rank 0, once per trainer) and names the fix: `dataloader_multiprocessing_context="spawn"`
  (the script needs its `if __name__ == "__main__":` guard). `dataloader_persistent_workers=True`
  pays the start (imports, the pickled dataset) once per run instead of every epoch, at a price
  named in docs/distributed.md: a resume at an epoch boundary draws the workers' base seed from the
  CPU generator once more than the uninterrupted run did.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing
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


RISKS = {
    "fork": "a worker forked while a gloo/NCCL thread of the rank holds an interpreter lock can hang right after "
    "the fork, and the run with it (CPython gh-112275 on 3.11 before its fix; fork from a threaded process is "
    "unsafe)",
    "forkserver": "the workers are children of the server, not of the rank: a rank that dies leaves them and the "
    "server running (torch's worker watchdog watches the parent), holding the launcher's output open",
}


def workers_start_warning(args) -> str | None:
    """What can go wrong with the DataLoader workers of `args` (`TrainingArguments`) in a rank of a multi-process
    run, and the fix; None for one process, no workers, or `spawn`."""
    method = args.dataloader_multiprocessing_context or multiprocessing.get_start_method(allow_none=True)
    method = method or multiprocessing.get_all_start_methods()[0]  # this interpreter's default, left unset
    if args.world_size <= 1 or args.dataloader_num_workers <= 0 or method not in RISKS:
        return None
    return (
        f"dataloader_num_workers={args.dataloader_num_workers} started with '{method}' in a run of "
        f"{args.world_size} processes: {RISKS[method]}. Set dataloader_multiprocessing_context='spawn' (the script "
        "keeps its `if __name__ == '__main__':` guard; the dataset and collator must pickle; "
        "dataloader_persistent_workers=True starts the workers once per run instead of every epoch), or "
        "dataloader_num_workers=0."
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
