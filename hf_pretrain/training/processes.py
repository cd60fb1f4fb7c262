"""The processes of a run: a launch that lost its ranks, a DeepSpeed process without a launcher, a clean exit.

- `check_launched_world_size(world_size)`: the launcher started several processes but the Trainer sees one (a
  GPU launch config on a CPU-only machine without `use_cpu`): refused, since silent single-process training
  wastes the other ranks.
- `single_process_rendezvous()`: DeepSpeed started without a launcher looks for MPI and fails ("No module named
  'mpi4py'"); this gives it the rendezvous of one process, as a launcher would.
- `wait_for_everyone(accelerator)`: a barrier only when there is a process group (accelerate's would fail for
  one DeepSpeed process before the engine creates the group).
- `leave_process_group()`: registered with `atexit` by `PretrainTrainer`. A gloo or NCCL group alive at
  interpreter teardown can abort the process (SIGABRT), also when it is destroyed while a DDP module still
  holds it: under gloo the ranks meet at a bounded barrier, the group is destroyed, then
  `settle_gloo_threads` waits (at most 2 s, the GIL released) until gloo's worker threads are idle.
- `workers_start_warning(args)`: DataLoader workers started with `fork` in a rank can hang, with `forkserver`
  outlive a killed rank; `spawn` does neither. The arguments stay the user's (as with `Trainer`): this warns
  once and names the fix.
The mechanisms of the abort and the hangs, and the fixes: docs/known-failure-modes.md.
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


def leave_process_group() -> bool:
    """Destroy the group and settle gloo's threads; whether they were seen idle (`settle_gloo_threads`)."""
    if dist.is_available() and dist.is_initialized():
        with contextlib.suppress(Exception):
            if dist.get_backend() == "gloo":
                dist.monitored_barrier(timeout=datetime.timedelta(seconds=60))
        with contextlib.suppress(Exception):
            dist.destroy_process_group()
    return settle_gloo_threads()


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


def settle_gloo_threads(quiet_checks: int = 3, interval_s: float = 0.01, timeout_s: float = 2.0) -> bool:
    """Sleep (the GIL released) until no gloo thread has been running or runnable for `quiet_checks` checks in a
    row (docs/known-failure-modes.md); returns at once when the process has no gloo thread. Whether they were seen
    idle (False: the timeout, or no /proc to read)."""
    states = gloo_thread_states()
    if states is None:
        time.sleep(0.05)
        return False
    deadline, quiet = time.monotonic() + timeout_s, 0
    while states and quiet < quiet_checks and time.monotonic() < deadline:
        time.sleep(interval_s)
        states = gloo_thread_states()
        quiet = 0 if "R" in states else quiet + 1
    return not states or quiet >= quiet_checks
