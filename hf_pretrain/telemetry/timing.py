"""Device-true intervals: CUDA events on a GPU, the host clock on a CPU, read without stalling the step.

On a GPU the host only *enqueues* kernels: a `perf_counter` taken when `backward()` returns is the
time the launches took, not the time the GPU worked. The one honest clock there is the GPU's own:
a `torch.cuda.Event(enable_timing=True)` recorded on the current stream is stamped when the
stream reaches it, so the elapsed time between two events is the device time of everything
enqueued between them (kernels, and waits on other streams such as a collective's), whatever the
host did meanwhile. `elapsed_time` raises on an event the GPU has not reached yet ("Both events
must be completed"), and waiting for it would stall the step, so the callbacks read an interval
only once its end event `query()`s as done: the caller keeps the marks of a step and resolves them
at a later step, when the stream has long passed them (the loss `.item()` of every log, the NaN
check of every micro-batch). `DeviceClock.seconds` itself never calls `elapsed_time` on an
incomplete event: it waits for the event first (`synchronize`), which only a forced read (a full
`PendingIntervals`, a benchmark) ever needs. On a CPU the work is done when the call returns, and
the marks are plain `perf_counter` seconds, ready at once.

`DeviceClock.mark()` returns an opaque mark; `seconds(start, end)` the interval; `done(mark)`
whether it can be read without waiting. `work_mark()` is the clock of a rank's *own work*: the
same event on a GPU (the device's time is its own work), this thread's CPU time on a CPU
(`time.thread_time`: the forward and backward of CPU tensors run on the calling thread, and a
process that others preempt on a shared machine is not slower for it; the time it was preempted
shows in the wall clock only). `PendingIntervals` is the small queue the callbacks use:
push the marks of one step under names, pop what is done.
"""

from __future__ import annotations

import time
from collections import deque

import torch


class DeviceClock:
    """Marks on the current CUDA stream of `device`, or host seconds on any other device."""

    def __init__(self, device: torch.device | str | None):
        device = torch.device(device if device is not None else "cpu")
        self.cuda = device.type == "cuda" and torch.cuda.is_available()
        self.device = device

    def mark(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def work_mark(self):
        """A mark on the clock of this rank's own work: the device's on a GPU, this thread's CPU time on a CPU."""
        return self.mark() if self.cuda else time.thread_time()

    def done(self, mark) -> bool:
        return True if not self.cuda else mark.query()

    def seconds(self, start, end) -> float:
        """Elapsed seconds between two marks (on a GPU: call once `done(end)`, or it waits for the marks)."""
        if not self.cuda:
            return end - start
        for event in (start, end):
            if not event.query():  # elapsed_time raises on an incomplete event instead of waiting for it
                event.synchronize()
        return start.elapsed_time(end) / 1000.0


class PendingIntervals:
    """Marks of recent steps, resolved into seconds once the device has passed them.

    `push(record)` takes a dict name -> (start, end) mark pair, or name -> list of pairs (summed);
    `pop_done()` returns the resolved dicts of the oldest records whose every end mark is done, in
    order. A record never blocks the ones before it. When more than `limit` records wait (a device
    that never catches up: not seen in training, which syncs every step), the oldest is resolved
    anyway: `DeviceClock.seconds` waits for its events. Bounded memory beats a lost reading.
    """

    def __init__(self, clock: DeviceClock, limit: int = 16):
        self.clock = clock
        self.limit = limit
        self._queue: deque[dict] = deque()

    def __len__(self) -> int:
        return len(self._queue)

    def push(self, record: dict) -> None:
        self._queue.append(record)

    def _ends(self, record: dict):
        for value in record.values():
            pairs = value if isinstance(value, list) else [value]
            yield from (end for _, end in pairs)

    def _resolve(self, record: dict) -> dict[str, float]:
        out = {}
        for name, value in record.items():
            pairs = value if isinstance(value, list) else [value]
            out[name] = sum(self.clock.seconds(start, end) for start, end in pairs)
        return out

    def pop_done(self) -> list[dict[str, float]]:
        resolved = []
        while self._queue:
            ready = len(self._queue) > self.limit or all(self.clock.done(end) for end in self._ends(self._queue[0]))
            if not ready:
                break
            resolved.append(self._resolve(self._queue.popleft()))
        return resolved
