"""`packed_equality`: packed rows of several documents give each document the logits it gets alone, on `sdpa` and
`flex_attention`, in the device dtype; the same rows without restarting positions must differ."""

from __future__ import annotations

import torch

from .common import EOS, Context, Skip, collator_module, free_memory, old_transformers, require

GOAL = "packed = alone (sdpa, flex)"


def run(ctx: Context) -> dict:
    require(old_transformers())
    from hf_pretrain import PretrainForCausalLM, get_preset

    document_position_ids = collator_module().document_position_ids
    # boundaries differ in every row, but only two document lengths: flex compiles one kernel per shape
    lengths = ((16, 32, 16), (32, 16, 16), (16, 16, 16, 16))
    g = torch.Generator().manual_seed(0)
    rows = [[torch.randint(3, 128, (n - 1,), generator=g).tolist() + [EOS] for n in row] for row in lengths]
    width = max(sum(map(len, docs)) for docs in rows)
    ids = torch.full((len(rows), width), EOS)
    for r, docs in enumerate(rows):
        flat = [t for doc in docs for t in doc]
        ids[r, : len(flat)] = torch.tensor(flat)
    positions = document_position_ids(ids, EOS)
    results, worst = {}, 0.0
    for backend in ctx.sizes.packed_backends:
        torch.manual_seed(0)
        config = get_preset(
            "tiny",
            vocab_size=128,
            num_hidden_layers=4,
            window_pattern="SL",
            sliding_window=5,
            attention_backend=backend,
        )
        model = PretrainForCausalLM(config).to(device=ctx.device, dtype=ctx.dtype).eval()
        with torch.no_grad():
            try:
                packed = model(input_ids=ids.to(ctx.device), position_ids=positions.to(ctx.device)).logits.float()
            except Exception as err:  # a backend this device cannot run: say which and why
                results[backend] = f"did not run: {type(err).__name__}: {str(err)[:120]}"
                continue
            scale = packed.abs().max().item()
            diff = 0.0
            for r, docs in enumerate(rows):
                start = 0
                for doc in docs:
                    alone = model(input_ids=torch.tensor([doc], device=ctx.device)).logits[0].float()
                    diff = max(diff, (packed[r, start : start + len(doc)] - alone).abs().max().item())
                    start += len(doc)
            # without restarting positions the later documents see the earlier ones: the check can fail
            leaky = model(input_ids=ids.to(ctx.device)).logits.float()
            leak = (leaky - packed).abs().max().item()
        tolerance = 0.02 * scale if ctx.dtype == torch.bfloat16 else 1e-4
        results[backend] = {"max_abs_diff": diff, "tolerance": tolerance, "leak_without_positions": leak}
        worst = max(worst, diff / tolerance)
        del model
    free_memory()
    ran = {b: r for b, r in results.items() if isinstance(r, dict)}
    if not ran:
        raise Skip("; ".join(f"{b} {r}" for b, r in results.items()))
    ok = all(r["max_abs_diff"] <= r["tolerance"] < r["leak_without_positions"] for r in ran.values())
    text = ", ".join(
        f"{b}: max diff {r['max_abs_diff']:.2e} (tol {r['tolerance']:.1e})" if isinstance(r, dict) else f"{b} {r}"
        for b, r in results.items()
    )
    judged = bool(ok) if ctx.cuda and not ctx.dry_run else None
    if ctx.dry_run and not ok:
        judged = False  # equality is a correctness property: it holds on a CPU too
    return {"result": text, "value": worst, "pass": judged, "details": results}
