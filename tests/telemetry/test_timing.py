"""Device-true step timing: host marks on a CPU, CUDA events on a GPU, read only once the device passed them."""

import logging
import time
from types import SimpleNamespace

import pytest
import torch
from transformers import TrainerControl, TrainerState

from hf_pretrain.telemetry.throughput import ThroughputCallback
from hf_pretrain.telemetry.timing import DeviceClock, PendingIntervals
from tests.conftest import small_config

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (CUDA events)")


class LaggingClock(DeviceClock):
    """Marks that the test says when the 'device' has reached: the order CUDA events complete in.

    A CUDA event cannot be made to lag on a CPU, so this stands for one in the queue's logic test; the real
    events are timed in the GPU tests below.
    """

    def __init__(self):
        super().__init__("cpu")
        self.reached: set[int] = set()
        self.count = 0

    def mark(self):
        self.count += 1
        return self.count

    def done(self, mark) -> bool:
        return mark in self.reached

    def seconds(self, start, end) -> float:
        assert end in self.reached, "read before the device reached it: that would stall the step"
        return float(end - start)


def test_cpu_marks_are_host_seconds_and_ready_at_once():
    clock = DeviceClock("cpu")
    start = clock.mark()
    time.sleep(0.01)
    end = clock.mark()
    assert not clock.cuda and clock.done(end) and clock.seconds(start, end) >= 0.01
    pending = PendingIntervals(clock)
    pending.push({"step": (start, end), "parts": [(start, start + 1.0), (start, start + 2.0)], "none": []})
    (resolved,) = pending.pop_done()
    assert resolved["parts"] == pytest.approx(3.0) and resolved["none"] == 0 and resolved["step"] >= 0.01
    assert pending.pop_done() == [] and len(pending) == 0


def test_intervals_are_read_only_after_the_device_reached_them_and_in_order():
    clock = LaggingClock()
    pending = PendingIntervals(clock, limit=3)
    first = (clock.mark(), clock.mark())  # marks 1, 2
    second = (clock.mark(), clock.mark())  # marks 3, 4
    pending.push({"step": first})
    pending.push({"step": second})
    assert pending.pop_done() == []  # the device is still on step 1: nothing is read, nothing waits
    clock.reached |= {3, 4}
    assert pending.pop_done() == []  # step 2 is done but step 1 is not: order is kept
    clock.reached |= {1, 2}
    assert pending.pop_done() == [{"step": 1.0}, {"step": 1.0}] and len(pending) == 0
    # a device that never catches up: beyond `limit` waiting records the oldest is read anyway (bounded memory)
    for _ in range(4):
        pair = (clock.mark(), clock.mark())
        clock.reached.add(pair[1])  # what `seconds` would wait for
        pending.push({"step": pair})
    clock.reached -= {clock.count}  # the newest not reached
    assert len(pending.pop_done()) == 3 and len(pending) == 1


class PendingEvent:
    """A CUDA event as torch exposes it, on a CPU: `query()` is False until the 'device' reaches it (`synchronize()`
    waits for that), and `elapsed_time` raises on an incomplete event, as torch does, instead of waiting."""

    def __init__(self, at: float):
        self.at, self.complete, self.waited = at, False, False

    def query(self) -> bool:
        return self.complete

    def synchronize(self) -> None:
        self.complete = self.waited = True

    def elapsed_time(self, end: "PendingEvent") -> float:
        if not (self.complete and end.complete):
            raise RuntimeError("Both events must be completed before calculating elapsed time.")
        return (end.at - self.at) * 1000.0


def test_an_incomplete_event_is_waited_for_never_read_early():
    clock = DeviceClock("cpu")
    clock.cuda = True  # the GPU code path, with events that the test completes
    start, end = PendingEvent(1.0), PendingEvent(1.25)
    assert not clock.done(end)
    assert clock.seconds(start, end) == pytest.approx(0.25) and end.waited and start.waited
    # a full queue reads its oldest record anyway (bounded memory): it waits for the events instead of raising
    pending = PendingIntervals(clock, limit=1)
    pending.push({"step": (PendingEvent(0.0), PendingEvent(0.5))})
    pending.push({"step": (PendingEvent(0.5), PendingEvent(1.5))})
    assert pending.pop_done() == [{"step": pytest.approx(0.5)}] and len(pending) == 1


def _args(device="cpu", precision=None):
    return SimpleNamespace(device=torch.device(device), world_size=1, bf16=False, fp16=False, precision=precision)


def test_step_time_is_the_interval_from_step_begin_to_step_end_on_a_cpu():
    callback, state, control = ThroughputCallback(seq_len=32, measure_ceiling=False), TrainerState(), TrainerControl()
    state.max_steps, state.num_input_tokens_seen = 10, 0
    callback.on_train_begin(_args(), state, control, model=SimpleNamespace(config=small_config()))
    for step in (1, 2):
        callback.on_step_begin(_args(), state, control)
        time.sleep(0.02)
        state.global_step, state.num_input_tokens_seen = step, 64 * step
        callback.on_step_end(_args(), state, control)
    metrics = callback.metrics_for_log(state)
    assert metrics["step_time_s"] >= 0.02 and metrics["tokens_per_second"] > 0
    assert "mfu_measured" not in metrics and "step_time_s" not in callback.metrics_for_log(state)


def test_an_fp8_recipe_without_fp8_tensor_cores_gets_no_measured_mfu(caplog):
    state, control = TrainerState(), TrainerControl()
    state.max_steps = 10
    fp8 = ThroughputCallback(seq_len=32, measure_ceiling=True)
    with caplog.at_level(logging.WARNING):
        fp8.on_train_begin(_args(precision="fp8"), state, control, model=SimpleNamespace(config=small_config()))
    assert fp8.measured is None and "no native fp8 matmul" in caplog.text  # emulated here: no ceiling to divide by
    fp32 = ThroughputCallback(seq_len=32, measure_ceiling=True)
    fp32.on_train_begin(_args(), state, control, model=SimpleNamespace(config=small_config()))
    assert fp32.measured > 0  # the run's own GEMM precision (fp32) is measured


@gpu
@pytest.mark.gpu
def test_cuda_events_time_a_known_device_duration_not_the_enqueue():
    """A kernel of known length (`torch.cuda._sleep`, its rate calibrated on the host clock) between two marks:
    the interval is its duration, while the host returned long before the device finished."""
    from benchmarks.gpu.faults import device_sleep, sleep_cycles_per_second

    sleep_cycles_per_second()  # calibrated before the timed enqueues
    clock = DeviceClock("cuda")
    pending = PendingIntervals(clock)
    for expected in (0.02, 0.08):
        torch.cuda.synchronize()
        host = time.perf_counter()
        start = clock.mark()
        device_sleep(expected)
        end = clock.mark()
        enqueue = time.perf_counter() - host
        assert not clock.done(end)  # the host is back while the device still sleeps
        pending.push({"step": (start, end)})
        assert pending.pop_done() == []  # nothing is read (or waited for) before the device got there
        torch.cuda.synchronize()  # (the callbacks never do this: they read the events a step later)
        (resolved,) = pending.pop_done()
        assert resolved["step"] == pytest.approx(expected, rel=0.1) and enqueue < 0.25 * expected


@gpu
@pytest.mark.gpu
def test_reading_an_incomplete_cuda_event_waits_for_it():
    from benchmarks.gpu.faults import device_sleep, sleep_cycles_per_second

    sleep_cycles_per_second()
    clock = DeviceClock("cuda")
    torch.cuda.synchronize()
    start = clock.mark()
    device_sleep(0.05)
    end = clock.mark()
    assert not clock.done(end)
    assert clock.seconds(start, end) == pytest.approx(0.05, rel=0.1)  # waited, did not raise


@gpu
@pytest.mark.gpu
def test_fp8_ceiling_is_measured_with_scaled_mm_on_fp8_tensor_cores():
    from hf_pretrain.precision.recipes import fp8_matmul_native
    from hf_pretrain.telemetry.peaks import ceiling_dtype, measure_matmul_tflops

    if not fp8_matmul_native("cuda"):
        pytest.skip("this GPU has no fp8 tensor cores (compute capability < 8.9)")
    dtype = ceiling_dtype("fp8", "cuda")
    fp8 = measure_matmul_tflops("cuda", dtype, size=4096, seconds=0.2)
    assert fp8.dtype.startswith("float8") and fp8.tflops > 0  # its ratio to bf16: benchmarks/gpu_check.py
