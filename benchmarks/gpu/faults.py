"""A slow rank and a known-duration kernel, injected by gpu_check and the tests (never by the library).

`slow_linears` makes one rank slow *inside* its linear layers (a forward hook on each), where both
straggler rules look: DDP's compute measure and ZeRO-3's / FSDP2's per-linear `local_s`. On a GPU
the device sleeps (`torch.cuda._sleep`), the way a slow GPU is slow while its host is not; on a CPU
the host spins for that much of its own CPU time (what a slower CPU would take), which is what a CPU
rank's clock reads (`DeviceClock.work_mark`) however loaded the machine is. It lives here rather than in tests/ because
benchmarks/gpu_check.py uses it and benchmarks do not import the tests.
"""

from __future__ import annotations

import functools
import os
import time

import torch

from hf_pretrain.telemetry.straggler import timed_linears

SLEEP_CYCLES = 50_000_000  # about 25-50 ms on current GPUs: long enough that launch latency is noise


@functools.cache
def sleep_cycles_per_second(device_index: int = 0) -> float:
    """GPU clock cycles `torch.cuda._sleep` spins per second, measured with the host clock around a synchronised
    sleep (not with CUDA events: the tests use this to check the events). `_sleep` counts SM cycles, so the clock
    is brought up from idle first (an idle H200 sits at 345 of 1980 MHz) by a sleep as long as the measured one."""
    with torch.cuda.device(device_index):
        torch.cuda._sleep(SLEEP_CYCLES)  # the kernel's first launch, and the SM clock up from idle
        torch.cuda.synchronize()
        start = time.perf_counter()
        torch.cuda._sleep(2 * SLEEP_CYCLES)
        torch.cuda.synchronize()
        return 2 * SLEEP_CYCLES / (time.perf_counter() - start)


def device_sleep(seconds: float, device: torch.device | None = None) -> None:
    """Enqueue a kernel that keeps the GPU busy for about `seconds` and return at once."""
    index = (device or torch.device("cuda")).index or 0
    torch.cuda._sleep(int(sleep_cycles_per_second(index) * seconds))


def slow_linears(model: torch.nn.Module, rank: int, seconds: float, device: torch.device | str | None = None) -> int:
    """Make the process of global `rank` slower by `seconds` per forward of `model`, spread over its linears.

    A forward hook on every layer the straggler callback times (`timed_linears`: the linears but the output
    embedding; under AutoTP the column-parallel ones, which DeepSpeed puts in place of the model's linears, so
    register it once they are in place: at train begin) adds
    `seconds / n` of device sleep (GPU) or host spinning (CPU) after the matmul. Registered before the training
    steps, each hook runs inside the callback's per-linear window. Returns how many linears were slowed (0 on the
    other ranks).

    `device`: where the model will train (default: where its weights are now). On a CUDA device the sleep kernel
    is calibrated here, at registration, and each hook enqueues a fixed cycle count: calibrating lazily, inside
    the first forward, would time the host clock around a sleep while the other rank trains on the same GPU,
    read the sleep as longer than it is, and so slow this rank by less than `seconds`."""
    if seconds <= 0 or int(os.environ.get("RANK", "0")) != rank:
        return 0
    linears = timed_linears(model)
    each = seconds / len(linears)
    device = torch.device(device) if device is not None else next(model.parameters()).device
    cycles = int(sleep_cycles_per_second(device.index or 0) * each) if device.type == "cuda" else 0

    def slow(module, args, output):
        # the output's device, not the weight's: under ZeRO-3 reading a released weight in a forward gathers it,
        # a collective on this rank alone (the others hang or mismatch)
        if output.device.type == "cuda":
            torch.cuda._sleep(cycles)
            return
        end = time.thread_time() + each
        while time.thread_time() < end:
            pass

    for linear in linears:
        linear.register_forward_hook(slow)
    return len(linears)
