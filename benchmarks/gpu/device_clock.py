"""`device_clock`: `DeviceClock`'s CUDA events against a device sleep of known length, read before they complete.

The tests that check device time against a known-duration kernel (tests/telemetry/test_timing.py, marked `gpu`)
are not part of the one GPU try; this row runs their substance there in about a second. A `torch.cuda._sleep`
whose cycle rate was calibrated on the host clock (benchmarks/gpu/faults.py) is enqueued between two marks, and
the interval is read at once, while the end event is still incomplete: `DeviceClock.seconds` must wait for it,
not raise ("Both events must be completed"), and must give the sleep's length, not the host's enqueue time. The
same through a `PendingIntervals` already over its limit (the forced read of the callbacks' overflow path). On a
CPU the clock is the host's, with nothing to check against: the row is skipped there (no CUDA).
"""

from __future__ import annotations

import torch

from .common import Context, Skip

GOAL = "DeviceClock.seconds of a calibrated device sleep within 10 %; reading incomplete events never raises"
SLEEPS = (0.02, 0.08)  # seconds: well above launch latency, together well under a second
TOLERANCE = 0.10


def read_incomplete(clock, seconds: float, device: torch.device, forced: bool) -> dict:
    """One sleep of `seconds` between two marks, read at once: directly (`clock.seconds`) or, `forced`, through a
    `PendingIntervals` over its limit. The reading, whether the end was still incomplete, and any exception."""
    from hf_pretrain.telemetry.timing import PendingIntervals

    from . import faults

    torch.cuda.synchronize(device)
    start = clock.mark()
    faults.device_sleep(seconds, device)
    end = clock.mark()
    incomplete = not clock.done(end)
    try:
        if forced:
            pending = PendingIntervals(clock, limit=0)
            pending.push({"sleep": (start, end)})
            (record,) = pending.pop_done()
            read = record["sleep"]
        else:
            read = clock.seconds(start, end)
    except RuntimeError as err:  # what elapsed_time raises on an incomplete event
        return {"expected": seconds, "incomplete": incomplete, "error": f"{type(err).__name__}: {err}"}
    return {"expected": seconds, "incomplete": incomplete, "seconds": read, "error": None}


def judge(reading: dict) -> str | None:
    """What is wrong with one reading, or None."""
    if reading["error"]:
        return f"reading raised {reading['error']}"
    if not reading["incomplete"]:
        return "the end event was already complete: the incomplete read was not exercised"
    if abs(reading["seconds"] / reading["expected"] - 1) > TOLERANCE:
        return f"{reading['seconds'] * 1e3:.1f} ms for a {reading['expected'] * 1e3:.0f} ms sleep"
    return None


def run(ctx: Context) -> dict:
    if not ctx.cuda:
        raise Skip("no CUDA: on a CPU DeviceClock is the host clock, with no device sleep to time")
    from hf_pretrain.telemetry.timing import DeviceClock

    from .faults import sleep_cycles_per_second

    sleep_cycles_per_second(ctx.device.index or 0)  # calibrated (host clock) before any timed sleep
    clock = DeviceClock(ctx.device)
    readings = [read_incomplete(clock, s, ctx.device, forced) for forced in (False, True) for s in SLEEPS]
    problems = [p for p in map(judge, readings) if p]
    shown = [f"{r['seconds'] * 1e3:.1f}" if r["error"] is None else "raised" for r in readings]
    sleeps = ", ".join(f"{s * 1e3:.0f}" for s in SLEEPS)
    text = f"sleeps of {sleeps} ms read as {', '.join(shown[:2])} ms (direct), {', '.join(shown[2:])} ms (forced)"
    text += f"; {'; '.join(problems)}" if problems else "; every read waited for its incomplete event"
    errors = [abs(r["seconds"] / r["expected"] - 1) for r in readings if r["error"] is None]
    value = max(errors) if errors else None
    return {"result": text, "value": value, "pass": ctx.judge(not problems), "details": readings}
