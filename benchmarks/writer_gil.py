"""Does the background writer's serialisation hold the GIL against the training thread?

The asynchronous checkpoint's writer thread (training/resume/background.py) runs `torch.save` and safetensors'
`save_file` while the training thread launches the next steps from Python. A writer that held the GIL for a whole
write would stall the training thread as long as the write. One thread writes `--gib` GiB with each writer; the
main thread meanwhile runs a short pure-Python loop and records the longest gap between two of its iterations:
how long the writer ever kept it from running. Prints the write time and that gap; timings are printed, never
asserted.

    python benchmarks/writer_gil.py [--gib 1] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import os
import threading
import time
from pathlib import Path

import safetensors.torch
import torch


def longest_gap_while(thread: threading.Thread) -> float:
    gaps, last = [0.0], time.perf_counter()
    while thread.is_alive():
        now = time.perf_counter()
        gaps.append(now - last)
        last = now
        sum(range(200))  # a little Python work, like launching kernels
    return max(gaps)


def main(argv: list[str] | None = None) -> dict[str, tuple[float, float]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--dir", default="/tmp")
    args = parser.parse_args(argv)
    state = {"w": torch.randn(int(args.gib * 2**28))}  # fp32: 4 bytes each
    path = Path(args.dir) / f"writer_gil_{os.getpid()}"
    writers = {
        "torch.save": lambda: torch.save(state, path),
        "safetensors save_file": lambda: safetensors.torch.save_file(state, str(path)),
    }
    results = {}
    for name, write in writers.items():
        thread = threading.Thread(target=write)
        start = time.perf_counter()
        thread.start()
        gap = longest_gap_while(thread)
        thread.join()
        took = time.perf_counter() - start
        path.unlink(missing_ok=True)
        results[name] = (took, gap)
        print(f"{name}: {args.gib:g} GiB written in {took:.2f} s; the main thread's longest wait {gap * 1e3:.1f} ms")
    return results


if __name__ == "__main__":
    main()
