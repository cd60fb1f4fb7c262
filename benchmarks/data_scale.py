"""The data chain on datatrove's executors at 1x, 4x and 16x a corpus: documents/s per core, peak memory per task,
and the sharded dedup's recall and precision against the same driver over the whole corpus as one shard.

Corpus: `benchmarks/dedup.py`'s planted corpus (`--docs` documents x scale, 30 % planted copies edited to target
Jaccard 1.0 ... 0.5), in 2 JSON Lines files per `--docs`; the tasks grow with the corpus (`--tasks` x scale), so a
shard is the same size at every scale. Chain: read -> dedup -> split -> tokenizer (trained on `--docs` documents at
every scale) -> pack; clean is off so that the rows are the planted corpus's (its pairs are known).

Printed per executor and scale: wall seconds, documents per second per core (documents / the tasks' seconds summed
over every stage: each task runs on one core), each stage's peak task RSS (sampled by the task itself, psutil) and
that peak above the task's RSS when its block began (what the block added, torch and transformers not in it); as a
control, what the dedup driver over the whole corpus as one shard adds to one process at each scale (it should grow);
then recall / precision of the planted pairs (`dedup.py`'s definitions) for that one shard and for the sharded stages
at each scale. Slurm uses the cluster `sinfo` answers, else (as root) the one-node Slurm that the
tests use too (benchmarks/engine_clusters.py); Ray starts a local one.

    python benchmarks/data_scale.py [--docs 4000] [--scales 1 4 16] [--tasks 2] [--executors local ray slurm]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dedup import ExactJaccard, evaluate, planted_corpus  # noqa: E402

from hf_pretrain.data.chain import run_pipeline  # noqa: E402
from hf_pretrain.data.pipeline_config import PipelineConfig  # noqa: E402


def write_corpus(texts: list[str], folder: Path, files: int) -> None:
    folder.mkdir(parents=True)
    bounds = np.linspace(0, len(texts), files + 1).astype(int)
    for i in range(files):
        lines = (json.dumps({"text": t}) + "\n" for t in texts[bounds[i] : bounds[i + 1]])
        (folder / f"part-{i:04d}.jsonl").write_text("".join(lines))


@contextlib.contextmanager
def cluster_for(kind: str):
    """Environment changes the executor needs (Slurm: SLURM_CONF of the tests' one-node cluster when none answers)."""
    if kind != "slurm" or subprocess.run(["sinfo"], capture_output=True).returncode == 0:
        yield {}
        return
    from engine_clusters import slurm_cluster

    with slurm_cluster() as env:
        yield {"SLURM_CONF": env["SLURM_CONF"]}


def run(kind: str, texts: list[str], scale: int, args, root: Path) -> dict:
    folder = root / f"{kind}-{scale}"
    write_corpus(texts, folder / "raw", 2 * scale)
    executor = {"kind": kind, "tasks": args.tasks * scale, "workers": args.workers, "mem_per_cpu_gb": 1}
    executor["tokenizer_sample_documents"] = args.docs
    config = PipelineConfig(
        input=str(folder / "raw"),
        output_dir=str(folder / "out"),
        clean=None,
        heldout_fraction=0.01,
        tokenizer={"vocab_size": 1024},
        pack={"seq_len": 512, "mode": "best_fit"},
        executor=executor,
    )
    start = time.perf_counter()
    run_pipeline(config, verbose=False)
    wall = time.perf_counter() - start
    tasks = json.loads((folder / "out" / "tasks.json").read_text())
    task_seconds = sum(sum(t["seconds"]) for t in tasks)
    peaks = {t["stage"]: max(t["peak_rss_bytes"]) / 2**20 for t in tasks}
    growth = {t["stage"]: max(t["rss_growth_bytes"]) / 2**20 for t in tasks}
    return {
        "docs": len(texts),
        "wall": wall,
        "per_core": len(texts) / task_seconds,
        "peaks": peaks,
        "growth": growth,
        "out": folder,
    }


def one_process_growth(texts: list[str]) -> float:
    """The control: MB that the dedup driver over the whole corpus as one shard adds to this process's memory."""
    from hf_pretrain.data.chain.dedup_shards import deduplicate
    from hf_pretrain.data.chain.stages import PeakMemory
    from hf_pretrain.data.dedup import DedupConfig

    with tempfile.TemporaryDirectory() as folder, PeakMemory() as memory:
        deduplicate(texts, DedupConfig(), Path(folder))
    return (memory.peak - memory.start) / 2**20


def sharded_roots(out: Path) -> np.ndarray:
    from hf_pretrain.data.chain.dedup_shards import global_roots

    rows = [json.loads(p.read_text())["rows"] for p in sorted((out / "01-documents" / "tasks").glob("*.json"))]
    offsets = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)
    return global_roots(out / "03-clusters" / "verdicts", offsets)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=4000, help="documents at scale 1")
    parser.add_argument("--scales", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--tasks", type=int, default=2, help="tasks (shards) at scale 1")
    parser.add_argument("--workers", type=int, default=2, help="tasks at once")
    parser.add_argument("--executors", nargs="+", default=["local"], choices=["local", "ray", "slurm"])
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    import datasets

    datasets.disable_progress_bars()
    root = Path(tempfile.mkdtemp(prefix="data_scale"))
    corpora = {s: planted_corpus(args.docs * s, args.seed + s) for s in args.scales}
    results: dict = {}
    try:
        for kind in args.executors:
            with cluster_for(kind) as env:
                os.environ.update(env)
                for scale in args.scales:
                    results[(kind, scale)] = run(kind, corpora[scale][0], scale, args, root)
        stages = list(next(iter(results.values()))["peaks"])
        print(
            f"{'executor':<8} {'scale':>5} {'docs':>8} {'wall s':>7} {'docs/s/core':>12}  peak task RSS (MB): "
            + ", ".join(stages)
        )
        for (kind, scale), r in results.items():
            peaks = "  ".join(f"{r['peaks'][s]:>6.0f}" for s in stages)
            print(f"{kind:<8} {scale:>5} {r['docs']:>8,} {r['wall']:>7.1f} {r['per_core']:>12,.0f}  {peaks}")
        print(f"\n{'executor':<8} {'scale':>5} {'docs':>8}  peak RSS above the task's start (MB): " + ", ".join(stages))
        for (kind, scale), r in results.items():
            growth = "  ".join(f"{r['growth'][s]:>6.1f}" for s in stages)
            print(f"{kind:<8} {scale:>5} {r['docs']:>8,}  {growth}")
        print("control, one process: the whole corpus as one dedup shard adds (MB), smallest scale first:")
        for scale in sorted(args.scales):  # ascending: memory freed after a smaller run is reused, not counted
            results[("one_process", scale)] = one_process_growth(corpora[scale][0])
            print(f"  scale {scale:>2} ({len(corpora[scale][0]):,} docs): {results[('one_process', scale)]:.1f}")
        from dedup import ours

        print("dedup of the planted pairs (exact Jaccard of 5-word shingle sets >= 0.8):")
        for scale in args.scales:
            texts, planted = corpora[scale]
            jaccard = ExactJaccard(texts, 5)
            one = evaluate(
                ours(texts, argparse.Namespace(threshold=0.8, num_perm=128, shingle_size=5, seed=1), 1)[0],
                planted,
                jaccard,
                0.8,
            )
            kind = args.executors[0]
            sharded = evaluate(sharded_roots(results[(kind, scale)]["out"] / "out"), planted, jaccard, 0.8)
            results[("quality", scale)] = {"one": one, "sharded": sharded}
            print(
                f"  scale {scale:>2}: one shard recall {one['recall']:.3f} precision {one['precision']:.3f} | "
                f"sharded ({args.tasks * scale} shards, {kind}) recall {sharded['recall']:.3f} "
                f"precision {sharded['precision']:.3f}"
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return results


if __name__ == "__main__":
    main()
