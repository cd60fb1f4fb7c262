"""`step_time_events`: `ThroughputCallback`'s `step_time_s` (CUDA events, read without a sync) around bf16 steps,
against the synchronised wall time and the host's enqueue time."""

from __future__ import annotations

import statistics
import time
from types import SimpleNamespace

import torch

from .common import Context, free_memory, model_optimizer_batch, old_transformers, require, sync, timed_steps

GOAL = "event step time within 5 % of synced wall"


def run(ctx: Context) -> dict:
    require(old_transformers())
    from transformers import TrainerControl, TrainerState

    from hf_pretrain.telemetry.throughput import ThroughputCallback

    s = ctx.sizes
    model, optimizer, ids = model_optimizer_batch(ctx, s.events_preset, s.events_seq, s.events_batch, 1e-4)
    timed_steps(model, optimizer, ids, 2, ctx.dtype, ctx.device)  # warm-up
    args = SimpleNamespace(device=ctx.device, world_size=1, bf16=ctx.cuda, fp16=False, precision=None)
    state, control = TrainerState(), TrainerControl()
    state.max_steps = s.events_steps
    callback = ThroughputCallback(seq_len=s.events_seq, measure_ceiling=False)
    callback.on_train_begin(args, state, control, model=model)
    enqueue, wall = [], []
    for step in range(1, s.events_steps + 1):
        sync(ctx.device)
        start = time.perf_counter()
        callback.on_step_begin(args, state, control)
        with torch.autocast(ctx.device.type, dtype=ctx.dtype, enabled=ctx.cuda):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        state.global_step = step
        callback.on_step_end(args, state, control)
        enqueue.append(time.perf_counter() - start)  # what a host clock without a sync would log
        sync(ctx.device)
        wall.append(time.perf_counter() - start)
    events = callback.metrics_for_log(state)["step_time_s"]
    del model, optimizer
    free_memory()
    host, queued = statistics.fmean(wall), statistics.fmean(enqueue)
    text = (
        f"step_time_s (events) {events * 1e3:.1f} ms, synchronised wall {host * 1e3:.1f} ms "
        f"({events / host - 1:+.1%}), host enqueue only {queued * 1e3:.1f} ms ({queued / host:.0%} of the wall)"
    )
    return {
        "result": text,
        "value": events / host,
        "pass": ctx.judge(abs(events / host - 1) <= 0.05),
        "details": {"events": events, "wall": host, "enqueue": queued},
    }
