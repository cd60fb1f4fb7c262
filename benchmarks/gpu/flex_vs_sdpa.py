"""`flex_vs_sdpa`: one sliding-window attention layer, forward + backward, flex's block-sparse window against SDPA
with the dense window mask."""

from __future__ import annotations

import torch

from .common import Context, Skip, free_memory, median_seconds, old_transformers, require

GOAL = "dense-mask SDPA / flex time >= 2 (window layer)"


def run(ctx: Context) -> dict:
    require(old_transformers())
    from benchmarks.attention import window_pair
    from hf_pretrain import PretrainForCausalLM
    from hf_pretrain.modeling.attention import (
        SLIDING,
        Environment,
        LayerNeed,
        attention_forward,
        build_attention_masks,
        config_for_backend,
        unavailable_reason,
    )

    s = ctx.sizes
    config = window_pair(s.attn_window, s.attn_heads, s.attn_head_dim, s.attn_seq)
    model = PretrainForCausalLM(config).to(ctx.device)
    env = Environment.detect(ctx.device, ctx.dtype, training=True)
    need = LayerNeed(SLIDING, s.attn_window, packed=False)
    for backend in ("flex_attention", "sdpa"):
        why_not = unavailable_reason(backend, need, env, requested=True)
        if why_not:
            raise Skip(f"{backend} cannot train a window layer here: {why_not}")
    shape = (s.attn_batch, s.attn_heads, s.attn_seq, s.attn_head_dim)
    embeds = torch.empty(s.attn_batch, s.attn_seq, 1, device=ctx.device, dtype=ctx.dtype)
    attn = model.model.layers[0].self_attn
    seconds = {}
    for backend in ("flex_attention", "sdpa"):
        attn.config = config_for_backend(config, backend)
        mask = build_attention_masks({SLIDING: attn.config}, embeds, None, None, None)[SLIDING]
        q, k, v = (torch.randn(shape, device=ctx.device, dtype=ctx.dtype, requires_grad=True) for _ in range(3))

        def step(mask=mask, q=q, k=k, v=v):
            out, _ = attention_forward(attn, q, k, v, mask)
            out.float().sum().backward()

        seconds[backend] = median_seconds(step, ctx.device, repeats=5)
    del model
    free_memory()
    ratio = seconds["sdpa"] / seconds["flex_attention"]
    text = (
        f"window {s.attn_window} at seq {s.attn_seq}, fwd+bwd: flex {seconds['flex_attention'] * 1e3:.2f} ms, "
        f"SDPA dense mask {seconds['sdpa'] * 1e3:.2f} ms: {ratio:.2f}x"
    )
    return {"result": text, "value": ratio, "pass": ctx.judge(ratio >= 2.0), "details": seconds}
