"""Simulated device timelines of one training step under DDP, DeepSpeed ZeRO-1/2/3 and FSDP.

What StragglerCallback's marks would read on GPUs, without GPUs. Each rank walks the same list of
operations (SPMD): `("work", seconds, matmul)` advances its clock by the seconds, times the rank's
clock-slowdown factor when the work is matmul-bound; `("sync", name)` is a collective the compute
stream waits for: every rank's clock jumps to the latest arrival (the collective itself is free
here: what matters is who waits); `("mark", name)` is where the callback records an event. The
operation lists follow where each engine puts its collectives relative to the callback's marks:

- DDP: forward and backward are local; the all-reduce overlaps backward on another stream, and
  the compute stream waits for it at the end of backward (the reducer's finalize), after the
  comm hook marked the last bucket ready. The optimizer is local.
- ZeRO-1 (DeepSpeed through accelerate: `backward` runs the engine's backward *and* step): local
  forward and backward, then the gradient reduce, the optimizer on this rank's partition and the
  all-gather of the updated weights, all before `training_step` returns.
- ZeRO-2: as ZeRO-1, with the gradients reduce-scattered in buckets during backward (the compute
  stream waits for a bucket's reduction before the buffer is reused: every `bucket` layers).
- ZeRO-3: every layer's weights are all-gathered before its forward and again before its backward
  (in hooks that run before the callback's linear hooks), its gradients reduce-scattered after.
- FSDP (FSDP2, one unit per decoder layer): all-gather per layer in forward and backward, the
  reduce-scatters waited for once at the end of backward (the root's post-backward callback).

Timings: the field notes' pair of GB10 boxes, one stuck at 600 MHz against 2190 MHz. Each update
took 7.2 s and the healthy box waited 3.3 s of it, i.e. it worked 3.9 s. With the SM clock 3.65x
slower, matmul-bound work (the linears' forward, twice that in backward) slows 3.65x and the rest
(memory-bound: attention, norms, the optimizer) does not; the matmul share that makes 3.9 s into
7.2 s is (7.2 / 3.9 - 1) / (3.65 - 1) = 32 % of the healthy box's work.
"""

from __future__ import annotations

import random

FIELD_STEP_S, FIELD_WAIT_S = 7.2, 3.3
CLOCK_RATIO = 2190 / 600
OPTIMIZER_S = 0.02
ENGINES = ("ddp", "zero1", "zero2", "zero3", "fsdp")


def layer_times(busy_s: float = FIELD_STEP_S - FIELD_WAIT_S, layers: int = 24, micro_batches: int = 1):
    """Per layer and micro-batch: (forward matmul seconds, forward other seconds) of the healthy rank."""
    matmul = busy_s * (FIELD_STEP_S / busy_s - 1) / (CLOCK_RATIO - 1)  # the work that slows with the clock
    other = busy_s - OPTIMIZER_S - matmul
    passes = 3 * micro_batches * layers  # forward once, backward twice its cost, per micro-batch and layer
    return matmul / passes, other / passes


def operations(engine: str, layers: int = 24, micro_batches: int = 1, bucket: int = 6) -> list[tuple]:
    matmul, other = layer_times(layers=layers, micro_batches=micro_batches)
    ops: list[tuple] = [("sync", "token count gather"), ("mark", "step_begin")]
    for micro in range(micro_batches):
        last = micro == micro_batches - 1
        ops.append(("mark", "micro_begin"))
        for _ in range(layers):  # forward
            if engine in ("zero3", "fsdp"):
                ops.append(("sync", "all-gather weights"))
            ops += [("mark", "linear_begin"), ("work", matmul, True), ("mark", "linear_end"), ("work", other, False)]
        for layer in range(layers):  # backward
            if engine in ("zero3", "fsdp"):
                ops.append(("sync", "all-gather weights"))
            ops += [("work", 2 * matmul, True), ("work", 2 * other, False)]
            if engine == "zero3" or (engine == "zero2" and (layer + 1) % bucket == 0):
                ops.append(("sync", "reduce-scatter gradients"))
        if engine == "ddp" and last:
            ops += [("mark", "bucket_ready"), ("sync", "all-reduce finalize")]
        if engine == "fsdp" and last:  # earlier micro-batches run under no_sync: nothing to wait for
            ops.append(("sync", "wait for reduce-scatters"))
        if engine in ("zero1", "zero2", "zero3") and last:  # DeepSpeed's step runs inside training_step
            ops += [("sync", "reduce gradients")] if engine == "zero1" else []
            ops.append(("work", OPTIMIZER_S, False))
            ops += [("sync", "all-gather weights")] if engine != "zero3" else []
        ops.append(("mark", "micro_end"))
    if engine in ("ddp", "fsdp"):
        ops.append(("work", OPTIMIZER_S, False))
    ops.append(("mark", "step_end"))
    return ops


def simulate(engine: str, slowdown: list[float], jitter: float = 0.0, seed: int = 0, **shape) -> list[dict]:
    """One step per rank: {mark name: [clock at each occurrence]}; `slowdown[r]` divides rank r's SM clock."""
    rng = random.Random(seed)
    clocks = [0.0] * len(slowdown)
    marks: list[dict[str, list[float]]] = [{} for _ in slowdown]
    for op in operations(engine, **shape):
        if op[0] == "work":
            _, seconds, clock_bound = op
            for r, factor in enumerate(slowdown):
                noise = 1 + rng.uniform(-jitter, jitter)
                clocks[r] += seconds * (factor if clock_bound else 1.0) * noise
        elif op[0] == "sync":
            clocks = [max(clocks)] * len(clocks)
        else:
            for r in range(len(slowdown)):
                marks[r].setdefault(op[1], []).append(clocks[r])
    return marks


def rows(engine: str, slowdown: list[float], jitter: float = 0.0, seed: int = 0, **shape) -> list[dict]:
    """The rows StragglerCallback would gather: its measures from the marks, sensors unavailable (-1)."""
    out = []
    for m in simulate(engine, slowdown, jitter, seed, **shape):
        step = m["step_end"][0] - m["step_begin"][0]
        ends = m["micro_end"][:]
        if "bucket_ready" in m:  # DDP: the sync micro-batch's compute ends at its last bucket
            ends[-1] = m["bucket_ready"][0]
        compute = sum(e - b for b, e in zip(m["micro_begin"], ends))
        local = sum(e - b for b, e in zip(m["linear_begin"], m["linear_end"]))
        out.append(
            dict(
                compute_s=compute,
                local_s=local,
                wait_s=step - compute,
                data_wait_s=0.0,
                step_s=step,
                sm_clock_mhz=-1.0,
                sm_clock_max_mhz=-1.0,
                power_w=-1.0,
                utilization_pct=-1.0,
                memory_gib=-1.0,
                reasons=-1.0,
                wait_free=1.0 if engine == "ddp" else 0.0,
                steps=1.0,
            )
        )
    return out
