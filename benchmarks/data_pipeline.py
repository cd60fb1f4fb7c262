"""Throughput of each step of the data chain on a corpus generated from the embedded one.

Writes `--mb` megabytes of JSON Lines made from the embedded corpus (each copy of a document has
half of its words replaced from the corpus vocabulary, so copies are distinct documents; 5 % of
the documents get a near-duplicate with 1 % of the words edited, 2 % get HTML and URLs mixed in),
then runs `hf-pretrain data prepare` on it and prints documents/s and MB/s per step and tokens/s
for packing, measured in this one run.

    python benchmarks/data_pipeline.py [--mb 300] [--num-proc 2] [--vocab-size 8192]
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

from hf_pretrain.data import embedded_documents
from hf_pretrain.data.chain import run_pipeline
from hf_pretrain.data.pipeline_config import PipelineConfig


def generate(path: Path, megabytes: float, seed: int = 0) -> int:
    """Write about `megabytes` MB of documents to `path`; returns the number of documents."""
    rng = random.Random(seed)
    docs = embedded_documents()
    vocabulary = sorted({w for d in docs for w in d.split()})
    written = count = 0
    with path.open("w", encoding="utf-8") as f:
        while written < megabytes * 1e6:
            source = rng.choice(docs).split("\n")  # keep the line structure (lists, code, paragraphs)
            lines_of_words = [
                [rng.choice(vocabulary) if rng.random() < 0.5 else w for w in line.split(" ")] for line in source
            ]
            text = "\n".join(" ".join(words) for words in lines_of_words)
            if rng.random() < 0.02:
                text = f"<div class='nav'>{text}</div> see https://example.com/p?id={count} &amp; more"
            lines = [text]
            if rng.random() < 0.05:  # a near-duplicate: 1 % of the words edited (5-gram Jaccard about 0.9)
                edited = [
                    [rng.choice(vocabulary) if rng.random() < 0.01 else w for w in words] for words in lines_of_words
                ]
                lines.append("\n".join(" ".join(words) for words in edited))
            for line in lines:
                record = json.dumps({"text": line}) + "\n"
                f.write(record)
                written += len(record)
                count += 1
    return count


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=300.0, help="size of the generated corpus")
    parser.add_argument("--num-proc", type=int, default=2)
    parser.add_argument("--vocab-size", type=int, default=8192)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--workdir", default=None, help="where to write (default: a temporary folder)")
    args = parser.parse_args(argv)
    work = Path(args.workdir or tempfile.mkdtemp(prefix="hf-pretrain-data-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    n = generate(work / "corpus.jsonl", args.mb)
    print(f"generated {n:,} documents, {args.mb:g} MB in {time.perf_counter() - start:.1f} s -> {work}")
    config = PipelineConfig(
        input=str(work / "corpus.jsonl"),
        output_dir=str(work / "out"),
        num_proc=args.num_proc,
        tokenizer={"vocab_size": args.vocab_size},
        pack={"seq_len": args.seq_len, "mode": "best_fit"},
    )
    rates = {}
    for s in run_pipeline(config):
        if s.seconds:
            rates[s.block] = s.documents_in / s.seconds
            tokens = f", {s.extra['tokens'] / s.seconds:,.0f} tokens/s" if "tokens" in s.extra else ""
            print(f"{s.block:<16} {rates[s.block]:>10,.0f} docs/s  {s.bytes_in / 1e6 / s.seconds:>8.1f} MB/s{tokens}")
    return rates


if __name__ == "__main__":
    main()
