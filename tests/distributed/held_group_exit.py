"""Launched by test_clean_exit.py under torchrun: a gloo group still held after `destroy_process_group()` (as a DDP
module holds it), collectives on Python tensors, then the process exits at once.

    python -m torch.distributed.run --nproc_per_node 2 tests/distributed/held_group_exit.py leave|none

`leave` ends with `leave_process_group()`; `none` exits without it: about 1 launch in 4 then aborts at exit on the
shared 2-core machine ("terminate called without an active exception", SIGABRT; see hf_pretrain/training/processes.py).
processes.py is loaded from its file, so a launch imports torch only (a few seconds, not the package's stack).
"""

import importlib.util
import sys
from pathlib import Path

import torch
import torch.distributed as dist

PROCESSES = Path(__file__).resolve().parents[2] / "hf_pretrain" / "training" / "processes.py"
HELD = []  # module-level, as a script's trainer is: alive until the interpreter finalizes


def load_processes():
    spec = importlib.util.spec_from_file_location("processes", PROCESSES)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main(mode: str) -> None:
    processes = load_processes() if mode == "leave" else None
    dist.init_process_group("gloo")
    HELD.append(dist.group.WORLD)  # what keeps the group's worker threads alive past destroy_process_group()
    for _ in range(30):
        mine = torch.full((256,), float(dist.get_rank()))
        gathered = [torch.empty(256) for _ in range(dist.get_world_size())]
        dist.all_gather(gathered, mine)
        del mine, gathered  # a worker may drop the last reference later, as the Trainer's gathered logs are dropped
    dist.destroy_process_group()
    if processes is not None:
        processes.leave_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
