"""`memory_estimate`: one fp32 training step of the 1.4b preset against `estimate_memory`, which prices the loss
the model really runs (chunked only where torch's op or Liger is there: modeling/loss.py)."""

from __future__ import annotations

import torch

from .common import Context, free_memory, old_transformers, require, timed_steps

GOAL = "estimate within +-10 % of max_memory_allocated"


def run(ctx: Context) -> dict:
    require(old_transformers())
    from hf_pretrain import PretrainForCausalLM, get_preset
    from hf_pretrain.distributed.memory import estimate_memory

    s = ctx.sizes
    config = get_preset(s.memory_preset, max_position_embeddings=s.memory_seq)
    free_memory()
    baseline = torch.cuda.memory_allocated(ctx.device) if ctx.cuda else 0
    torch.manual_seed(0)
    model = PretrainForCausalLM(config).to(ctx.device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=ctx.cuda)
    small = torch.randint(3, config.vocab_size, (1, 8), device=ctx.device)
    timed_steps(model, optimizer, small, 1, torch.float32, ctx.device)  # gradients and Adam's states now exist
    ids = torch.randint(3, config.vocab_size, (s.memory_batch, s.memory_seq), device=ctx.device)
    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats(ctx.device)
    timed_steps(model, optimizer, ids, 1, torch.float32, ctx.device)
    peak = torch.cuda.max_memory_allocated(ctx.device) - baseline if ctx.cuda else None
    kernels = {kind: choice.backend for kind, choice in (model.attention_plan or {}).items()}
    flash = all(backend != "eager" for backend in kernels.values())  # sdpa / flex / FA keep no s x s scores
    estimate = estimate_memory(config, 0, 1, "fp32", s.memory_seq, s.memory_batch, flash_attention=flash)
    del model, optimizer
    free_memory()
    loss = "chunked loss" if estimate.chunked_loss else "full logits"
    shape = f"{s.memory_preset} fp32 seq {s.memory_seq} x {s.memory_batch} ({loss})"
    if peak is None:
        text = f"{shape}: estimate {estimate.total / 2**30:.2f} GiB; no CUDA allocator to measure on a CPU"
        return {"result": text, "value": None, "pass": None, "details": estimate.to_dict()}
    ratio = estimate.total / peak
    text = (
        f"{shape}: estimate {estimate.total / 2**30:.2f} GiB, "
        f"max_memory_allocated {peak / 2**30:.2f} GiB ({ratio - 1:+.1%})"
    )
    return {"result": text, "value": ratio, "pass": ctx.judge(abs(ratio - 1) <= 0.10), "details": estimate.to_dict()}
