"""Run by test_background_exchange.py: two gloo ranks, each with a `BackgroundSaves`; rank 1 leaves (os._exit) right
after the checkpointer's groups exist, so rank 0's background write cannot exchange its outcome.

Usage: python tests/distributed/exchange_fault.py OUT PORT
Rank 0 writes OUT/rank0.json: whether the save was promoted, and the error its next step would raise.
"""

import json
import os
import sys
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

from hf_pretrain.training.resume.background import BackgroundSaves, Write


def rank_main(rank: int, out: str, port: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    dist.init_process_group("gloo", rank=rank, world_size=2)
    saves = BackgroundSaves(rank, 2, timeout_s=5)
    saves.group()  # both ranks create the checkpointer's groups
    dist.barrier()
    if rank == 1:
        os._exit(0)  # a peer lost before the exchange
    promoted = []
    errors = lambda error, failed: RuntimeError(f"failed on {failed}: {error}")  # noqa: E731
    saves.submit("checkpoint-1", [Write("x", lambda: None)], lambda: promoted.append(True), errors)
    saves.job.done.wait(60)
    error = saves.error
    record = {"done": saves.job.done.is_set(), "promoted": bool(promoted), "error": str(error) if error else None}
    Path(out, "rank0.json").write_text(json.dumps(record))
    os._exit(0)  # no teardown against the lost peer


if __name__ == "__main__":
    mp.start_processes(rank_main, args=(sys.argv[1], sys.argv[2]), nprocs=2, join=False, start_method="fork")
    for child in mp.active_children():
        child.join(90)
