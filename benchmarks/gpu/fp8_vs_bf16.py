"""`fp8_vs_bf16`: tokens/s of torchao fp8 linears against bf16 autocast, decoder layers compiled, CUDA events."""

from __future__ import annotations

import statistics

import torch

from .common import Context, free_memory, missing, old_transformers, require, timed_steps

GOAL = "fp8 / bf16 tokens/s >= 1.25"


def run(ctx: Context) -> dict:
    require(old_transformers(), missing("torchao", "the fp8 recipe is torchao's float8 training"))
    from hf_pretrain import PretrainForCausalLM, get_preset
    from hf_pretrain.chips import spec_tflops
    from hf_pretrain.modeling.accounting import flops_per_token
    from hf_pretrain.precision import apply_precision
    from hf_pretrain.precision.recipes import emulated
    from hf_pretrain.telemetry.peaks import device_name

    s = ctx.sizes
    config = get_preset(s.fp8_preset, max_position_embeddings=s.fp8_seq)
    ids = torch.randint(3, config.vocab_size, (s.fp8_batch, s.fp8_seq), device=ctx.device)
    rates = {}
    for recipe in ("bf16", "fp8"):
        torch.manual_seed(0)
        model = PretrainForCausalLM(config).to(ctx.device).train()
        if recipe == "fp8":
            apply_precision(model, "fp8", device=ctx.device)
        if s.compile:
            for layer in model.model.layers:  # regional compilation: one block's graph, reused by every layer
                layer.compile()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=ctx.cuda)
        times = timed_steps(model, optimizer, ids, s.fp8_steps, ctx.dtype, ctx.device)[s.warmup :]
        rates[recipe] = s.fp8_batch * s.fp8_seq / statistics.median(times)
        del model, optimizer
        free_memory()
    ratio = rates["fp8"] / rates["bf16"]
    spec = spec_tflops(device_name(ctx.device), "bf16") if ctx.cuda else None
    mfu = flops_per_token(config, s.fp8_seq) * rates["bf16"] / 1e12 / spec if spec else None
    why = emulated("fp8", ctx.device)
    text = f"fp8 {rates['fp8']:,.0f} vs bf16 {rates['bf16']:,.0f} tokens/s: {ratio:.2f}x"
    text += f" ({'compiled' if s.compile else 'eager'}; bf16 mfu_spec {mfu:.3f})" if mfu else ""
    text += f"; fp8 emulated here ({why})" if why else ""
    return {"result": text, "value": ratio, "pass": None if why else ctx.judge(ratio >= 1.25), "details": rates}
