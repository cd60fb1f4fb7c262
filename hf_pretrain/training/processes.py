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
"""

from __future__ import annotations

import contextlib
import datetime
import os
import socket

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
    if not (dist.is_available() and dist.is_initialized()):
        return
    with contextlib.suppress(Exception):
        if dist.get_backend() == "gloo":
            dist.monitored_barrier(timeout=datetime.timedelta(seconds=60))
    with contextlib.suppress(Exception):
        dist.destroy_process_group()
