"""Peak memory and time of a training step: the loss without the full logits against plain Llama.

Three variants of one model and one batch (same weights, same tokens), each in a fresh process:
plain `LlamaForCausalLM` (transformers), `PretrainForCausalLM` with the chunked loss (the default,
`modeling/loss.py`) and with `chunked_loss=False` (the full logits, as Llama). Memory is measured as
tests/distributed/test_memory.py measures it: a warm-up step on a tiny batch allocates the gradients
(kept, as gradient accumulation and DDP keep them), then the RSS before the step is the baseline and
the process's max RSS after one forward + backward of the full batch is its peak; growth = peak -
baseline. glibc's mmap threshold is fixed at 1 MiB so that RSS follows the live tensors. Step time is
the median of the next `--repeats` forward + backward passes. `--rounds` runs every variant that many
times, the order reversed each round (ABBA: load from other jobs hits all alike), and reports the
medians. Prints each variant's loss, growth and time, and the ratios to plain Llama (goal for the
chunked loss: memory <= 0.6x, same loss).

    python benchmarks/chunked_ce.py                     # vocab 32,768, seq 1024, batch 4, hidden 256, 4 layers
    python benchmarks/chunked_ce.py --vocab 65536 --seq 2048 --device cuda    # on a GPU (peak from torch.cuda)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

MEASURE = r"""
import gc, json, resource, sys, time
import psutil, torch
spec = json.loads(sys.argv[1])
torch.set_num_threads(spec["threads"])
from transformers import LlamaForCausalLM
from hf_pretrain import PretrainForCausalLM
device = torch.device(spec["device"])
if spec["variant"] == "llama":
    model = LlamaForCausalLM.from_pretrained(spec["llama_dir"])
else:
    model = PretrainForCausalLM.from_pretrained(spec["ours_dir"], chunked_loss=spec["variant"] == "chunked")
model.to(device).train()
def step(ids):
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss.item()
step(torch.randint(0, 100, (1, 8), device=device))  # allocates the gradients; kernels' first use
gc.collect()
ids = torch.load(spec["ids"]).to(device)
if device.type == "cuda":
    torch.cuda.synchronize()
    baseline = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
else:
    baseline, before = psutil.Process().memory_info().rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
loss = step(ids)
if device.type == "cuda":
    peak = torch.cuda.max_memory_allocated()
else:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert peak > before, "the step did not raise the process's peak: the growth would be a floor, not a measure"
times = []
for _ in range(spec["repeats"]):
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    step(ids)
    if device.type == "cuda":
        torch.cuda.synchronize()
    times.append(time.perf_counter() - start)
print(json.dumps({"loss": loss, "growth": peak - baseline, "times": times}))
"""

VARIANTS = ("llama", "chunked", "unchunked")


def prepare(args, out: Path) -> dict:
    """Save one set of weights as ours and as a Llama checkpoint, and the batch, for the child processes."""
    import torch

    from hf_pretrain import PretrainForCausalLM, get_preset
    from hf_pretrain.modeling.export import export_hf

    torch.manual_seed(0)
    config = get_preset(
        "tiny",
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=3 * args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 64,
        num_key_value_heads=max(1, args.hidden // 128),
        max_position_embeddings=args.seq,
    )
    model = PretrainForCausalLM(config)
    model.save_pretrained(out / "ours")
    export_hf(model, out / "llama")
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=torch.Generator().manual_seed(1))
    torch.save(ids, out / "ids.pt")
    params = sum(p.numel() for p in model.parameters())
    return {
        "ours_dir": str(out / "ours"),
        "llama_dir": str(out / "llama"),
        "ids": str(out / "ids.pt"),
        "params": params,
    }


def measure(variant: str, paths: dict, args) -> dict:
    spec = {**paths, "variant": variant, "threads": args.threads, "repeats": args.repeats, "device": args.device}
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="1048576")
    run = subprocess.run(
        [sys.executable, "-c", MEASURE, json.dumps(spec)], capture_output=True, text=True, env=env, timeout=1800
    )
    if run.returncode != 0:
        raise RuntimeError(f"{variant} failed:\n{run.stderr[-3000:]}")
    return json.loads(run.stdout.strip().splitlines()[-1])


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per child (1: steadiest on shared cores)")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per variant after the measured one")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each variant, order reversed each round")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args(argv)
    import torch

    from hf_pretrain.modeling.loss import implementation

    with tempfile.TemporaryDirectory() as tmp:
        paths = prepare(args, Path(tmp))
        print(
            f"torch {torch.__version__}, fp32, {args.device}, {args.threads} thread(s): vocab {args.vocab}, "
            f"seq {args.seq}, batch {args.batch}, hidden {args.hidden}, {args.layers} layers, "
            f"{paths['params'] / 1e6:.1f} M parameters; chunked loss by {implementation(torch.device(args.device))!r}; "
            f"{args.rounds} rounds x {args.repeats} timed steps"
        )
        runs = {variant: [] for variant in VARIANTS}
        for round_index in range(args.rounds):
            for variant in VARIANTS if round_index % 2 == 0 else VARIANTS[::-1]:
                runs[variant].append(measure(variant, paths, args))
    results = {
        variant: {
            "loss": r[0]["loss"],
            "growth": statistics.median(x["growth"] for x in r),
            "step_s": statistics.median(t for x in r for t in x["times"]),
        }
        for variant, r in runs.items()
    }
    llama = results["llama"]
    print(f"{'variant':<28}{'loss':>10}{'peak growth':>14}{'x llama':>9}{'step':>10}{'x llama':>9}")
    names = {"llama": "LlamaForCausalLM", "chunked": "ours, chunked loss", "unchunked": "ours, chunked_loss=False"}
    for variant, r in results.items():
        r["memory_ratio"], r["time_ratio"] = r["growth"] / llama["growth"], r["step_s"] / llama["step_s"]
        r["loss_rel_diff"] = abs(r["loss"] - llama["loss"]) / llama["loss"]
        print(
            f"{names[variant]:<28}{r['loss']:>10.5f}{r['growth'] / 2**30:>10.2f} GiB{r['memory_ratio']:>9.2f}"
            f"{r['step_s']:>8.2f} s{r['time_ratio']:>9.2f}"
        )
    print(f"largest loss difference to Llama: {max(r['loss_rel_diff'] for r in results.values()):.1e} (relative)")
    return results


if __name__ == "__main__":
    main()
