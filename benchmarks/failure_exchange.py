"""The per-step cost of the failure exchange of asynchronous checkpoints (`BackgroundSaves.settled`) on gloo ranks.

While a background write is out, every rank must learn by the same step whether every rank's write is over (a failed
write is then raised everywhere at once, and nobody trains into a collective another rank left). Each of `--ranks`
processes (fork, gloo) trains a small MLP with DDP-style gradient all-reduces on the default group and, per
optimizer step of `--accumulation` micro-batches, calls the exchange exactly as the trainer does. Three loops,
interleaved over `--rounds` rounds so the machine's drift falls on all of them alike:
- `none`: no save out (the exchange returns at once);
- `in flight`: a write that never ends during the loop: today's exchange, one 1-element all-reduce per optimizer
  step started with `async_op` and read a step later;
- `per micro-batch` (the design it replaced): a blocking 1-element all-reduce before every micro-batch.
Prints the median step time of each and the ratios to `none` (goal of the issue: in flight / none <= 1.01 at 4
ranks). Timings are printed, never asserted.

    python benchmarks/failure_exchange.py [--ranks 2 4] [--steps 60] [--rounds 3] [--accumulation 4] [--width 512]
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hf_pretrain.training.resume.background import BackgroundSaves, Job

LOOPS = ("none", "in flight", "per micro-batch")


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def micro_batch(model: torch.nn.Module, width: int) -> None:
    x = torch.randn(32, width)
    model(x).square().mean().backward()


def all_reduce_grads(model: torch.nn.Module) -> None:
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad = None


def steps_of(loop: str, saves: BackgroundSaves, model, args) -> list[float]:
    """Seconds per optimizer step of one loop."""
    release = threading.Event()
    saves.job = Job("benchmark", release.wait) if loop != "none" else None  # a write that never ends in the loop
    times = []
    for _ in range(args.steps):
        start = time.perf_counter()
        if loop == "in flight":
            saves.settled()  # once per optimizer step, as Checkpointing.raise_if_failed calls it
        for _ in range(args.accumulation):
            if loop == "per micro-batch":
                flag = torch.tensor([0.0])
                dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=saves._poll_group)
            micro_batch(model, args.width)
        all_reduce_grads(model)
        times.append(time.perf_counter() - start)
    release.set()
    saves.wait()
    return times


def rank_main(rank: int, world: int, port: str, args, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(args.width, args.width) for _ in range(3)])
    saves = BackgroundSaves(rank, world, timeout_s=120)
    saves.group()
    steps_of("none", saves, model, argparse.Namespace(**{**vars(args), "steps": 3}))  # warm-up
    medians = {loop: [] for loop in LOOPS}
    for _ in range(args.rounds):
        for loop in LOOPS:
            dist.barrier()
            medians[loop].append(statistics.median(steps_of(loop, saves, model, args)))
    if rank == 0:
        results.update({loop: statistics.median(values) for loop, values in medians.items()})
    dist.barrier()
    dist.destroy_process_group()


def measure(world: int, args) -> dict[str, float]:
    with mp.Manager() as manager:
        results = manager.dict()
        mp.start_processes(rank_main, args=(world, free_port(), args, results), nprocs=world, start_method="fork")
        return dict(results)


def main(argv: list[str] | None = None) -> dict[int, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--accumulation", type=int, default=4)
    parser.add_argument("--width", type=int, default=512)
    args = parser.parse_args(argv)
    print(
        f"{os.cpu_count()} cores; {args.steps} optimizer steps of {args.accumulation} micro-batches a loop, "
        f"{args.rounds} rounds; median step time"
    )
    out = {}
    for world in args.ranks:
        times = measure(world, args)
        none = times["none"]
        row = "  ".join(f"{loop} {times[loop] * 1e3:.2f} ms ({times[loop] / none:.3f}x)" for loop in LOOPS)
        print(f"{world} gloo ranks: {row}")
        out[world] = {
            **times,
            "ratio": times["in flight"] / none,
            "ratio_per_micro_batch": times["per micro-batch"] / none,
        }
    return out


if __name__ == "__main__":
    main()
