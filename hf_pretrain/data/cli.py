"""`hf-pretrain data ...`: each step of the chain on its own, and `prepare CONFIG` for all of them.

hf-pretrain data clean --input raw/ --output clean/ [--num-proc 8] [--rank 0 --world-size 1]
hf-pretrain data filter --input clean/ --output filtered/ --model runs/small --threshold 1500
hf-pretrain data dedup --input filtered/ --output dedup/ [--threshold 0.8 --num-perm 128]
hf-pretrain data train-tokenizer --input dedup/ --output tok/ --vocab-size 32768
hf-pretrain data pack --input dedup/ --tokenizer tok/ --output packed/ --seq-len 4096 --mode best_fit
hf-pretrain data prepare pipeline.json [--executor local|slurm|ray --tasks 64 --workers 8]

Inputs: jsonl / json / txt / md files (also compressed: .gz .bz2 .xz .zst), parquet / arrow files,
folders of them, or `save_to_disk` folders (the output of an earlier step). Each step writes an
Arrow folder (or the tokenizer), its `stats.json`, and prints one line per block; `prepare` prints
the summary table.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from .workers import children_die_with_parent  # the standard library only: each command imports what it runs

if TYPE_CHECKING:
    from .blocks import BlockStats


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input", required=True, help="files, a folder of them, or a save_to_disk folder")
    parser.add_argument("--output", required=True, help="output folder")
    parser.add_argument("--text-column", default="text")
    parser.add_argument("--num-proc", type=int, default=None, help="worker processes")
    parser.add_argument("--rank", type=int, default=0, help="this process's shard (several machines)")
    parser.add_argument("--world-size", type=int, default=1, help="number of shards")


def _run_blocks(args, blocks: list) -> list[BlockStats]:
    from .read import ReadFiles

    reader = ReadFiles(args.text_column)
    data = reader.run(args.input, args.rank, args.world_size, args.num_proc)
    stats = [reader.stats]
    for block in blocks:
        data = block.run(data, num_proc=args.num_proc)
        stats.append(block.stats)
    data.save_to_disk(args.output)
    return _finish(args.output, stats)


def _finish(output: str, stats: list[BlockStats]) -> list[BlockStats]:
    Path(output).mkdir(parents=True, exist_ok=True)
    Path(output, "stats.json").write_text(json.dumps([s.to_dict() for s in stats], indent=2) + "\n")
    for s in stats:
        print(s.summary())
    print(f"wrote {output} (stats.json beside the data)")
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
    config = CleanConfig(**check_section("--config", values, settable_keys(CleanConfig)))
    return _run_blocks(args, [Clean(config, text_column=args.text_column)])


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

    block = PerplexityFilter(
        args.model, args.threshold, args.text_column, None, args.max_length, args.batch_size, args.keep_scores
    )
    return _run_blocks(args, [block])


def dedup(argv: list[str]) -> list[BlockStats]:
    parser = argparse.ArgumentParser(prog="hf-pretrain data dedup", description="Exact, then MinHash-LSH near-dedup.")
    _common(parser)
    parser.add_argument("--threshold", type=float, default=0.8, help="Jaccard similarity of near-duplicates")
    parser.add_argument("--num-perm", type=int, default=128)
    parser.add_argument("--shingle-size", type=int, default=5, help="words per shingle")
    parser.add_argument("--no-exact", action="store_true", help="skip the exact (content hash) pass")
    args = parser.parse_args(argv)
    from .dedup import ExactDedup, MinHashDedup

    blocks = [] if args.no_exact else [ExactDedup(text_column=args.text_column)]
    blocks.append(
        MinHashDedup(
            text_column=args.text_column,
            threshold=args.threshold,
            num_perm=args.num_perm,
            shingle_size=args.shingle_size,
        )
    )
    return _run_blocks(args, blocks)


def train_tokenizer_cli(argv: list[str]) -> list[BlockStats]:
    parser = argparse.ArgumentParser(prog="hf-pretrain data train-tokenizer", description="Train a byte-level BPE.")
    _common(parser)
    parser.add_argument("--vocab-size", type=int, required=True, help="e.g. 100000 for real runs, 4096 on a CPU")
    parser.add_argument("--heldout-fraction", type=float, default=0.01, help="documents measured, not trained on")
    parser.add_argument("--min-frequency", type=int, default=2)
    args = parser.parse_args(argv)
    from .read import ReadFiles
    from .split import check_fraction, split_by_hash
    from .tokenizer import check_vocab_size, train_tokenizer

    check_vocab_size(args.vocab_size)  # before any data is read
    check_fraction(args.heldout_fraction, "--heldout-fraction")
    reader = ReadFiles(args.text_column)
    data = reader.run(args.input, args.rank, args.world_size, args.num_proc)
    splits = split_by_hash(data, args.heldout_fraction, args.text_column, args.num_proc)
    heldout = list(splits["heldout"][args.text_column])
    tokenizer, stats = train_tokenizer(
        splits["train"], args.output, args.vocab_size, args.text_column, heldout, args.min_frequency
    )
    result = _finish(args.output, [reader.stats, stats])
    print(
        f"{len(tokenizer)} tokens; {stats.extra['bytes_per_token']} bytes/token on {stats.extra['bytes_per_token_on']} text"
    )
    return result


def pack(argv: list[str]) -> list[BlockStats]:
    parser = argparse.ArgumentParser(prog="hf-pretrain data pack", description="Tokenize and pack into blocks.")
    _common(parser)
    parser.add_argument("--tokenizer", required=True, help="a tokenizer folder (AutoTokenizer)")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--mode", default="best_fit", help="best_fit (default) or concat (packing.MODES)")
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer

    from .blocks import from_pretrained
    from .packing import Pack

    tokenizer = from_pretrained(AutoTokenizer, args.tokenizer, "--tokenizer")
    return _run_blocks(args, [Pack(tokenizer, args.seq_len, args.mode, args.text_column)])


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
