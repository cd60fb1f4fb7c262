"""`hf-pretrain data ...`: each step of the chain on its own, and `prepare CONFIG` for all of them.

hf-pretrain data clean --input raw/ --output clean/ [--num-proc 8]
hf-pretrain data filter --input clean/ --output filtered/ --model runs/small --threshold 1500
hf-pretrain data dedup --input filtered/ --output dedup/ [--threshold 0.8 --num-perm 128]
hf-pretrain data train-tokenizer --input dedup/ --output tok/ --vocab-size 32768
hf-pretrain data pack --input dedup/ --tokenizer tok/ --output packed/ --seq-len 4096 --mode best_fit
hf-pretrain data prepare pipeline.json [--executor local|slurm|ray --tasks 64 --workers 8]

Inputs: jsonl / json / txt / md files (also compressed: .gz .bz2 .xz .zst), parquet / arrow files,
folders of them, `save_to_disk` folders, or the output folder of an earlier step. Each step is the
chain (`run_pipeline`) with that one section on: it writes the chain's folders, `stats.json` and the
summary table, and the next step reads its output folder.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from .workers import children_die_with_parent  # the standard library only: each command imports what it runs

if TYPE_CHECKING:
    from .blocks import BlockStats

STEPS_OFF = {"clean": None, "perplexity": None, "dedup": None, "tokenizer": None, "pack": None}


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--input", required=True, help="files, a folder of them, a save_to_disk folder or a step's output"
    )
    parser.add_argument("--output", required=True, help="output folder")
    parser.add_argument("--text-column", default="text")
    parser.add_argument("--num-proc", type=int, default=None, help="tasks at once (the input's files are the shards)")


def _run_step(args, heldout_fraction: float = 0.0, **sections) -> list[BlockStats]:
    """The chain with `sections` on and every other step off (held out: none, unless given)."""
    from .chain import run_pipeline
    from .pipeline_config import PipelineConfig
    from .storage import is_url

    if args.num_proc is not None and args.num_proc < 1:
        raise ValueError(
            f"--num-proc {args.num_proc} is invalid: use a number of tasks at once >= 1 (e.g. --num-proc 4)."
        )
    if is_url(args.output):
        raise ValueError(
            f"--output {args.output!r}: a step command writes a local folder (the next step's --input); an output "
            "URL is `hf-pretrain data prepare`'s output_dir."
        )
    config = PipelineConfig(
        input=args.input,
        output_dir=args.output,
        text_column=args.text_column,
        num_proc=args.num_proc,
        heldout_fraction=heldout_fraction,
        **{**STEPS_OFF, **sections},
    )
    stats = run_pipeline(config)
    print(f"wrote {args.output} (the next step reads it: --input {args.output})")
    return stats


def clean(argv: list[str]) -> list[BlockStats]:
    parser = argparse.ArgumentParser(prog="hf-pretrain data clean", description="Clean and quality-filter documents.")
    _common(parser)
    parser.add_argument("--config", default=None, help="CleanConfig fields as JSON, e.g. '{\"min_tokens\": 16}'")
    args = parser.parse_args(argv)
    from .clean import Clean, CleanConfig
    from .pipeline_config import check_section, settable_keys

    try:
        values = json.loads(args.config or "{}")
    except json.JSONDecodeError as err:
        raise ValueError(f"--config is not valid JSON ({err}); e.g. --config '{{\"min_tokens\": 16}}'.") from None
    Clean(CleanConfig(**check_section("--config", values, settable_keys(CleanConfig))))  # the flag's error first
    return _run_step(args, clean=values)


def perplexity_filter(argv: list[str]) -> list[BlockStats]:
    parser = argparse.ArgumentParser(prog="hf-pretrain data filter", description="Drop documents by LM perplexity.")
    _common(parser)
    parser.add_argument("--model", required=True, help="a causal LM from_pretrained loads (tokenizer beside it)")
    parser.add_argument("--threshold", type=float, default=1500.0)
    parser.add_argument("--max-length", type=int, default=512, help="tokens scored per document")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--keep-scores", action="store_true", help="keep a perplexity column")
    args = parser.parse_args(argv)
    from .perplexity import PerplexityFilter

    section = {
        "model_path": args.model,
        "threshold": args.threshold,
        "max_length": args.max_length,
        "batch_size": args.batch_size,
        "keep_scores": args.keep_scores,
    }
    PerplexityFilter(**section)  # a model that cannot be loaded: the flag's error, before any data work
    return _run_step(args, perplexity=section)


def dedup(argv: list[str]) -> list[BlockStats]:
    parser = argparse.ArgumentParser(prog="hf-pretrain data dedup", description="Exact, then MinHash-LSH near-dedup.")
    _common(parser)
    parser.add_argument("--threshold", type=float, default=0.8, help="Jaccard similarity of near-duplicates")
    parser.add_argument("--num-perm", type=int, default=128)
    parser.add_argument("--shingle-size", type=int, default=5, help="words per shingle")
    parser.add_argument("--no-exact", action="store_true", help="skip the exact (content hash) pass")
    args = parser.parse_args(argv)
    section = {"exact": not args.no_exact, "threshold": args.threshold, "num_perm": args.num_perm}
    return _run_step(args, dedup={**section, "shingle_size": args.shingle_size, "verbose": False})


def train_tokenizer_cli(argv: list[str]) -> list[BlockStats]:
    parser = argparse.ArgumentParser(
        prog="hf-pretrain data train-tokenizer",
        description="Train a byte-level BPE; OUTPUT holds it as save_pretrained writes it (AutoTokenizer loads it).",
    )
    _common(parser)
    parser.add_argument("--vocab-size", type=int, required=True, help="e.g. 100000 for real runs, 4096 on a CPU")
    parser.add_argument("--heldout-fraction", type=float, default=0.01, help="documents measured, not trained on")
    parser.add_argument("--min-frequency", type=int, default=2)
    args = parser.parse_args(argv)
    from .prepared import tokenizer_path
    from .split import check_fraction
    from .tokenizer import check_vocab_size

    check_vocab_size(args.vocab_size)  # before any data is read
    check_fraction(args.heldout_fraction, "--heldout-fraction")
    tokenizer = {"vocab_size": args.vocab_size, "min_frequency": args.min_frequency}
    stats = _run_step(args, args.heldout_fraction, tokenizer=tokenizer)
    for path in tokenizer_path(args.output).iterdir():  # OUTPUT is the tokenizer too: AutoTokenizer loads it
        shutil.copy2(path, Path(args.output) / path.name)
    extra = next(s for s in stats if s.block == "tokenizer").extra
    print(f"{extra['vocab_size']} tokens; {extra['bytes_per_token']} bytes/token on {extra['bytes_per_token_on']} text")
    return stats


def pack(argv: list[str]) -> list[BlockStats]:
    parser = argparse.ArgumentParser(prog="hf-pretrain data pack", description="Tokenize and pack into blocks.")
    _common(parser)
    parser.add_argument("--tokenizer", required=True, help="a tokenizer folder (AutoTokenizer)")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--mode", default="best_fit", help="best_fit (default) or concat (packing.MODES)")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    from .blocks import from_pretrained
    from .packing import MODES, check_seq_len
    from .prepared import tokenizer_folder

    from_pretrained(AutoTokenizer, tokenizer_folder(args.tokenizer), "--tokenizer")  # before any data is read
    check_seq_len(args.seq_len)
    if args.mode not in MODES:
        raise ValueError(f"--mode {args.mode!r} is invalid; use one of {list(MODES)}.")
    return _run_step(args, tokenizer={"path": args.tokenizer}, pack={"seq_len": args.seq_len, "mode": args.mode})


def prepare(argv: list[str]) -> list[BlockStats]:
    parser = argparse.ArgumentParser(prog="hf-pretrain data prepare", description="Run the whole chain from a config.")
    parser.add_argument("config", help="a JSON file with PipelineConfig fields (see docs/data.md)")
    parser.add_argument("--executor", choices=("local", "slurm", "ray"), help="run as tasks on datatrove's executor")
    parser.add_argument("--tasks", type=int, help="with --executor: number of shards (tasks)")
    parser.add_argument("--workers", type=int, help="with --executor: tasks running at once")
    args = parser.parse_args(argv)
    from .chain import run_pipeline
    from .pipeline_config import PipelineConfig

    if args.tasks is not None and args.tasks < 1:
        raise ValueError(f"--tasks {args.tasks} is invalid: use a number of shards >= 1 (e.g. --tasks 8).")
    if args.workers is not None and args.workers < 1 and args.workers != -1:
        raise ValueError(f"--workers {args.workers} is invalid: use a number of tasks at once >= 1, or -1 for all.")
    config = PipelineConfig.from_file(args.config)
    given = (("kind", args.executor), ("tasks", args.tasks), ("workers", args.workers))
    flags = {k: v for k, v in given if v is not None}
    if flags:
        if config.executor is None and "kind" not in flags:
            raise ValueError("--tasks / --workers need --executor local|slurm|ray (or an executor section).")
        config = dataclasses.replace(config, executor={**(config.executor or {}), **flags})
    return run_pipeline(config)


COMMANDS = {
    "clean": clean,
    "filter": perplexity_filter,
    "dedup": dedup,
    "train-tokenizer": train_tokenizer_cli,
    "pack": pack,
    "prepare": prepare,
}


def main(argv: list[str]) -> int:
    """Run one command; bad input (a missing path, a bad config, nothing to read) is one line on stderr, exit 2.
    `hf-pretrain data --help` prints the commands (exit 0); `COMMAND --help` a command's options."""
    usage = f"usage: hf-pretrain data {{{','.join(COMMANDS)}}} [options]   (hf-pretrain data COMMAND --help)"
    if argv[:1] in (["--help"], ["-h"]):
        print(usage + "\n\n" + __doc__.split("\n\n", 1)[1].strip().removesuffix('"""').strip())
        return 0
    if not argv or argv[0] not in COMMANDS:
        print(usage, file=sys.stderr)
        return 2
    try:
        with children_die_with_parent():
            COMMANDS[argv[0]](argv[1:])
    except (ValueError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0
