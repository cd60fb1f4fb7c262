"""Step time and compile time of a training step: eager against torch.compile of the whole model and per block.

One model and one batch (same weights, same tokens), three variants, each in a fresh process with an empty
Inductor cache (`TORCHINDUCTOR_CACHE_DIR` in a new temporary folder: the compile is cold, as on a new machine):
`eager`, `model` (`torch.compile(model)`, what `--torch_compile` does) and `blocks` (each decoder layer compiled
in place, `--torch_compile_scope blocks`; `hf_pretrain/training/compile.py`). A step is forward + backward of
the batch. The compile time is the first step minus the median of the `--steps` steps after it; the step time is
that median. Run at every depth in `--layers` to show how the compile time grows with depth (a whole-model
compile traces every block; a per-block compile traces one block per kind). Prints, per depth, each variant's
loss, step time and compile time, and the ratios to eager (step time) and to the shallowest depth (compile time).

    python benchmarks/compile.py                                  # hidden 256, 2 and 8 layers, seq 256, batch 4
    python benchmarks/compile.py --layers 4 --moe --window 64     # an MoE model with sliding windows
    python benchmarks/compile.py --device cuda --seq 2048 --hidden 1024 --layers 4 16
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

MEASURE = r"""
import json, sys, time
import torch
spec = json.loads(sys.argv[1])
torch.set_num_threads(spec["threads"])
from hf_pretrain import PretrainForCausalLM, PretrainConfig
from hf_pretrain.training.compile import compile_blocks, prepare_compile
device = torch.device(spec["device"])
torch.manual_seed(0)
model = PretrainForCausalLM(PretrainConfig(**spec["config"])).to(device).train()
ids = torch.randint(0, spec["config"]["vocab_size"], (spec["batch"], spec["seq"]), generator=torch.Generator().manual_seed(1)).to(device)
def sync():
    if device.type == "cuda":
        torch.cuda.synchronize()
model(input_ids=ids[:1, :8], labels=ids[:1, :8]).loss.backward()  # plans attention, allocates gradients (eager)
model.zero_grad(set_to_none=False)
runner = model
if spec["variant"] == "model":
    prepare_compile(model)
    runner = torch.compile(model, backend=spec["backend"])
elif spec["variant"] == "blocks":
    compile_blocks(model, backend=spec["backend"])
times, loss = [], None
for _ in range(spec["steps"] + 1):
    sync(); start = time.perf_counter()
    out = runner(input_ids=ids, labels=ids)
    out.loss.backward()
    model.zero_grad(set_to_none=False)
    sync(); times.append(time.perf_counter() - start)
    loss = out.loss.item() if loss is None else loss
from torch._dynamo.utils import counters
print(json.dumps({"loss": loss, "times": times, "graphs": counters["stats"]["unique_graphs"],
                  "breaks": sum(counters["graph_break"].values())}))
"""

VARIANTS = ("eager", "model", "blocks")


def config(args, layers: int) -> dict:
    shape = dict(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=3 * args.hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(1, args.hidden // 64),
        num_key_value_heads=max(1, args.hidden // 128),
        max_position_embeddings=args.seq,
    )
    if args.window:
        shape.update(window_pattern="SL", sliding_window=args.window)
    if args.moe:
        shape.update(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=args.hidden)
    return shape


def measure(variant: str, layers: int, args) -> dict:
    spec = dict(
        variant=variant,
        config=config(args, layers),
        batch=args.batch,
        seq=args.seq,
        steps=args.steps,
        threads=args.threads,
        device=args.device,
        backend=args.backend,
    )
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=cache, TRITON_CACHE_DIR=cache)
        run = subprocess.run(
            [sys.executable, "-c", MEASURE, json.dumps(spec)], capture_output=True, text=True, env=env, timeout=3600
        )
    if run.returncode != 0:
        raise RuntimeError(f"{variant} at {layers} layers failed:\n{run.stderr[-3000:]}")
    result = json.loads(run.stdout.strip().splitlines()[-1])
    steady = statistics.median(result["times"][1:])
    return {**result, "step_s": steady, "compile_s": max(0.0, result["times"][0] - steady)}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--window", type=int, default=0, help="sliding window on every other layer (0: none)")
    parser.add_argument("--moe", action="store_true", help="8 experts, top-2, on every layer")
    parser.add_argument("--steps", type=int, default=5, help="timed steps after the first (compiling) one")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per child (1: steadiest on shared cores)")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    import torch

    print(
        f"torch {torch.__version__}, fp32, {args.device}, {args.threads} thread(s), backend {args.backend}: hidden "
        f"{args.hidden}, vocab {args.vocab}, seq {args.seq}, batch {args.batch}, window {args.window or 'none'}, "
        f"{'MoE' if args.moe else 'dense'}; cold Inductor cache per variant; {args.steps} timed steps"
    )
    results: dict = {}
    print(
        f"{'layers':>6} {'variant':<8}{'loss':>10}{'step':>10}{'x eager':>9}{'compile':>10}{'x shallowest':>14}{'graphs':>8}"
    )
    for layers in args.layers:
        results[layers] = {v: measure(v, layers, args) for v in VARIANTS}
        eager = results[layers]["eager"]
        for variant, r in results[layers].items():
            r["step_vs_eager"] = r["step_s"] / eager["step_s"]
            first = results[args.layers[0]][variant]["compile_s"]
            r["compile_vs_shallowest"] = r["compile_s"] / first if variant != "eager" and first > 0 else None
            growth = f"{r['compile_vs_shallowest']:.2f}" if r["compile_vs_shallowest"] is not None else "-"
            compile_s = f"{r['compile_s']:.1f} s" if variant != "eager" else "-"
            print(
                f"{layers:>6} {variant:<8}{r['loss']:>10.5f}{r['step_s']:>8.3f} s{r['step_vs_eager']:>9.2f}"
                f"{compile_s:>10}{growth:>14}{r['graphs']:>8}"
            )
    return results


if __name__ == "__main__":
    main()
