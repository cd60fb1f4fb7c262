"""`mfu_bf16`: `PretrainTrainer` in bf16 on a ~1B preset, eager and compiled, read back from its telemetry.jsonl.

MFU, tokens/s and step time are what the run's own `ThroughputCallback` logged, read from
`telemetry.jsonl` (`state.log_history` does not keep measured values). The compiled run is the
package's regional compilation (`torch_compile_scope="blocks"`, each decoder layer compiled in place);
the goal is judged on it. A figure the run should have measured but did not fails the row.

On a CPU (the dry run) the chip table has no peak, so the runs are given one (`peak_tflops`, the fp32 matmul
ceiling this CPU measures, `dry_run_peak`): `mfu_spec` is then logged, written to telemetry.jsonl and read back
by the very path the H200 is judged on, and the row says that its peak is this CPU's, not a chip-table one.
"""

from __future__ import annotations

import torch

from .common import (
    EOS,
    Context,
    free_memory,
    median_of,
    old_transformers,
    packed_rows,
    require,
    train_args,
    trainer_missing,
    training_logs,
)

GOAL = "compiled mfu_spec >= 0.50 (bf16, ~1B, seq 2048 packed)"
FIGURES = ("mfu_spec", "mfu_measured", "tokens_per_second", "step_time_s")


def dry_run_peak(ctx: Context) -> float | None:
    """The `peak_tflops` the runs are given: None on a GPU (the chip table's peak decides), on a CPU this CPU's
    measured fp32 matmul ceiling (the one the run's `mfu_measured` divides by: measured once per process), so
    that `mfu_spec` is logged and read back on the dry run too."""
    if ctx.cuda:
        return None
    from hf_pretrain.telemetry.peaks import matmul_ceiling

    return matmul_ceiling(ctx.device, torch.float32)


def expected(ctx: Context, peak_tflops: float | None = None) -> tuple[str, ...]:
    """The figures this device must give: mfu_spec where the chip table has its peak or the runs were given one
    (`peak_tflops`), the others always."""
    from hf_pretrain.chips import spec_tflops
    from hf_pretrain.telemetry.peaks import device_name

    spec = peak_tflops or spec_tflops(device_name(ctx.device), "bf16" if ctx.cuda else "fp32")
    return FIGURES if spec is not None else FIGURES[1:]


def train(ctx: Context, compiled: bool, peak_tflops: float | None = None) -> tuple[dict, dict]:
    """One run; its figures (medians over the steps after warm-up) and the attention kernels it used."""
    from transformers import PrinterCallback

    from hf_pretrain import PretrainForCausalLM, PretrainTrainer, get_preset
    from hf_pretrain.data.collator import PackedDocumentCollator

    s = ctx.sizes
    out = ctx.workdir / ("mfu_compiled" if compiled else "mfu_eager")
    config = get_preset(s.mfu_preset, max_position_embeddings=s.mfu_seq)
    compile_args = dict(torch_compile_scope="blocks", torch_compile_backend=s.compile_backend) if compiled else {}
    args = train_args(
        ctx,
        out,
        max_steps=s.mfu_steps,
        per_device_train_batch_size=s.mfu_batch,
        torch_compile=compiled,
        peak_tflops=peak_tflops,
        **compile_args,
    )
    data = packed_rows(config.vocab_size, s.mfu_seq, s.mfu_batch * (s.mfu_steps + 1))
    trainer = PretrainTrainer(
        model=PretrainForCausalLM(config), args=args, train_dataset=data, data_collator=PackedDocumentCollator(EOS)
    )
    trainer.remove_callback(PrinterCallback)  # the table is the output, not one dict per step
    trainer.train()
    kernels = {kind: choice.backend for kind, choice in (trainer.model.attention_plan or {}).items()}
    del trainer
    free_memory()
    logs = training_logs(out, after_step=s.warmup)
    figures = {key: median_of(logs, key) for key in FIGURES}
    figures["peak_tflops_measured"] = median_of(training_logs(out), "peak_tflops_measured")  # logged once, step 1
    return figures, kernels


def describe(figures: dict, spec_known: bool, peak_tflops: float | None = None) -> str:
    """One run's figures; `peak_tflops`: the stand-in peak a CPU run was given, named as not the chip table's."""

    def show(key: str, form: str) -> str:
        return form.format(figures[key]) if figures[key] is not None else f"{key} MISSING"

    spec = show("mfu_spec", "mfu_spec {:.3f}") if spec_known else "mfu_spec unavailable (no spec peak for this chip)"
    if peak_tflops is not None:
        spec += f" (of peak_tflops {peak_tflops:.3g}: this CPU's fp32 matmul ceiling, not a chip-table peak)"
    rest = [show("mfu_measured", "mfu_measured {:.3f}"), show("tokens_per_second", "{:,.0f} tokens/s")]
    return ", ".join([spec, *rest, show("step_time_s", "{:.3f} s/step")])


def run(ctx: Context) -> dict:
    require(old_transformers(), trainer_missing())
    peak = dry_run_peak(ctx)
    need = expected(ctx, peak)
    runs = {}
    for compiled in (False, True):
        runs["compiled" if compiled else "eager"], kernels = train(ctx, compiled, peak)
    absent = [f"{name} {key}" for name, figures in runs.items() for key in need if figures[key] is None]
    label = f"compiled (blocks, {ctx.sizes.compile_backend})"
    text = f"eager: {describe(runs['eager'], 'mfu_spec' in need, peak)}; "
    text += f"{label}: {describe(runs['compiled'], 'mfu_spec' in need)}; attention {kernels}"
    value = runs["compiled"]["mfu_spec"]
    if absent:  # the run did not log what it should have: the read-back is broken, on any device
        text += f"; missing: {', '.join(absent)}"
        judged = False
    else:
        judged = None if value is None else ctx.judge(value >= 0.5)  # on a CPU: printed, never judged
    details = {**runs, "kernels": kernels, "missing": absent, "peak_tflops_given": peak}
    return {"result": text, "value": value, "pass": judged, "details": details}
