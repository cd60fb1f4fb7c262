"""`telemetry_overhead`: step time with all of hf_pretrain's callbacks on against extras off, on the GPU in bf16
(benchmarks/telemetry_overhead.py's rounds, ABBA): the per-linear events and hooks of the straggler callback,
the throughput events and the sensors, at a size where the step is short (gpt2-124m).

As on the CPU, the figure is the mean step over whole straggler windows and logging intervals (total time of
the timed steps / their number): the linears are timed on 3 steps of each window and the JSONL and sensors
are written at logging steps, costs a median step would leave out."""

from __future__ import annotations

from .common import Context, free_memory, old_transformers, packed_rows, require, trainer_missing

GOAL = "step time with callbacks / without <= 1.01"


def run(ctx: Context) -> dict:
    require(old_transformers(), trainer_missing())
    from benchmarks.telemetry_overhead import describe, overhead, rows_needed, time_steps
    from hf_pretrain import get_preset

    s = ctx.sizes
    config = get_preset(s.overhead_preset)
    data = packed_rows(config.vocab_size, s.overhead_seq, rows_needed(s.overhead_steps, s.overhead_batch))
    windows = dict(straggler_every=s.overhead_straggler_every, logging_steps=s.overhead_logging_steps)
    arguments = dict(bf16=ctx.cuda, use_cpu=not ctx.cuda, dataloader_num_workers=0, **windows)

    def steps(extras: bool) -> dict[str, list[float]]:
        times = time_steps(extras, data, s.overhead_steps, s.overhead_preset, s.overhead_batch, **arguments)
        free_memory()
        return {"wall": times["wall"]}  # synchronised steps: the device's time and the host's work in it

    result = overhead(s.overhead_rounds, steps)["wall"]
    every = f"straggler every {s.overhead_straggler_every}, logging every {s.overhead_logging_steps}"
    text = f"{s.overhead_preset} seq {s.overhead_seq} x {s.overhead_batch}, {every}, {describe(result)}"
    return {"result": text, "value": result["ratio"], "pass": ctx.judge(result["ratio"] <= 1.01), "details": result}
