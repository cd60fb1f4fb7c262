"""The data chain on a distributed engine: datatrove's local, Slurm and Ray executors run the same stages.

`run_engine(config)` (what `hf-pretrain data prepare` runs when the config has an `executor` section, or with
`--executor local|slurm|ray`) splits the input into `tasks` shards and runs the chain as the stages of
`stages.py`, each a datatrove pipeline step run by the chosen executor (`executors.py`); the global MinHash dedup
is sharded by band and key range (`dedup_shards.py`). The result is the one-machine chain's: the same documents
kept (the shards are contiguous parts of the input, so dedup keeps the same copy), the same tokenizer when the
sample holds every training document, each shard packed on its own (`05-pack/train/SHARD`), and `load_packed`
reads the shards as one dataset. Counters are ours, merged over the tasks into `OUTPUT/stats.json` and the same
summary table; `OUTPUT/tasks.json` has each task's seconds, peak memory and the memory its block added.

`num_proc` is the one-machine chain's worker processes per step. Under an executor a task is one process (datatrove's
local pool workers are daemonic and may not start `datasets`' pools of their own): the tasks run their blocks in
their own process, the executor's `tasks` and `workers` are the parallelism, and on the local executor `num_proc`,
when `workers` is not given, is how many tasks run at once. A shard whose files hold no document keeps none; the run
fails, with the one-machine read's error, only when the whole input yields nothing (`check_something_read`).

Why datatrove: its three executors run one pipeline unchanged, mark completed tasks so that a relaunch reruns
only the others, and keep a log per task (FineWeb was built with it); the blocks and their rules stay ours.
A relaunch with another config, input or number of tasks into the same folder is refused (`engine.json`).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import sys
from pathlib import Path

from ..blocks import BlockStats
from ..pipeline import _key, files_signature, summary_table
from ..pipeline_config import PipelineConfig
from .config import ExecutorConfig
from .dedup_shards import write_json

CONSTANT = {"mode", "seq_len", "bands", "rows", "num_perm", "threshold", "heldout_fraction", "vocab_size"}
MAXIMUM = {"peak_rss_bytes"}


def count_shards(config: PipelineConfig, tasks: int) -> int:
    """How many shards: `tasks`, at most one per input file (line files) or row (typed inputs)."""
    from datasets import DatasetDict, load_from_disk

    from ..read import TypedFiles, list_files
    from ..split import own_heldout

    kind, files = list_files(config.input)
    if kind == "disk":
        loaded = load_from_disk(str(files[0]))
        if isinstance(loaded, DatasetDict):
            if own_heldout(loaded):
                raise ValueError(
                    f"input={config.input!r} brings its own held-out split ({own_heldout(loaded)!r}): the executors "
                    "read one dataset; run prepare without an executor, or save the train split alone."
                )
            loaded = loaded["train"] if "train" in loaded else next(iter(loaded.values()))
        rows = len(loaded)
    elif kind in ("parquet", "arrow"):
        rows = sum(TypedFiles.check(kind, files, [str(p) for p in files]).rows) or 1  # the read names the corrupt
    else:
        rows = len(files)
    return max(1, min(tasks, rows))


def chain(plan, config: ExecutorConfig) -> list[tuple]:
    """The stages to run and their numbers of tasks."""
    from . import stages as s

    c = plan.config
    steps = [(s.Documents(plan), plan.shards)]
    if plan.dedup is not None:
        steps += [(s.Buckets(plan), plan.bucket_tasks()), (s.Clusters(plan), 1)]
    if c.tokenizer is not None:
        steps.append((s.Tokenizer(plan), 1))
    return [*steps, (s.Pack(plan), plan.shards)]


def check_key(out: Path, key: str) -> None:
    """The folder holds this run (or nothing yet); another config's run is refused, not mixed with this one.

    Checked and written under a lock (`locks/engine.lock`): of two launches with different configs started at
    once, the second sees the first's `engine.json` and is refused."""
    from .stages import task_lock

    path = out / "engine.json"
    with task_lock(out / "locks" / "engine.lock"):
        if path.exists() and json.loads(path.read_text()) != key:
            raise ValueError(
                f"output_dir={str(out)!r} holds the run of another config, input or number of tasks (engine.json): "
                "pass a new output_dir, or delete that folder to start over."
            )
        write_json(path, key)


def merge(records: list[list[dict]]) -> list[BlockStats]:
    """Each block's stats summed over the tasks (counters summed, settings kept, peaks the maximum), in order."""
    merged: dict[str, BlockStats] = {}
    for stats in records:
        for s in stats:
            total = merged.setdefault(s["block"], BlockStats(s["block"]))
            total.documents_in += s["documents_in"]
            total.documents_out += s["documents_out"]
            total.bytes_in += s["bytes_in"]
            total.bytes_out += s["bytes_out"]
            total.seconds += s["seconds"]
            for reason, n in s["dropped"].items():
                total.dropped[reason] = total.dropped.get(reason, 0) + n
            for key, value in s["extra"].items():
                before = total.extra.get(key)
                if before is None or key in CONSTANT or isinstance(value, (str, bool)):
                    total.extra.setdefault(key, value)
                elif key in MAXIMUM:
                    total.extra[key] = max(before, value)
                elif isinstance(value, (int, float, list)):
                    total.extra[key] = before + value
    return list(merged.values())


def collect(plan, steps: list[tuple]) -> tuple[list[BlockStats], list[dict]]:
    """The chain's stats in the one-machine order, and each stage's tasks (seconds, peak memory)."""
    from . import stages as s

    by_stage, tasks = {}, []
    for stage, count in steps:
        records = [plan.task_stats(stage.folder, rank) for rank in range(count)]
        by_stage[stage.folder] = records
        tasks.append(
            {
                "stage": stage.folder,
                "tasks": count,
                "seconds": [r["seconds"] for r in records],
                "peak_rss_bytes": [r["peak_rss_bytes"] for r in records],
                "rss_growth_bytes": [r.get("rss_growth_bytes") for r in records],  # None: a task of an older version
            }
        )
    stats = merge([r["stats"] for r in by_stage[s.DOCUMENTS]])
    shards = merge([r["stats"] for r in by_stage[s.PACK]])
    dedup = [b for b in shards if not b.block.startswith("pack")]
    if s.CLUSTERS in by_stage:
        counters = dict(by_stage[s.CLUSTERS][0]["counters"])
        blocks = {b.block: b for b in dedup}
        if "exact_dedup" in blocks:
            blocks["exact_dedup"].extra["exact_duplicates"] = counters["exact_duplicates"]
            if "minhash_dedup" in blocks:
                counters["exact_duplicates"] = 0  # counted by the exact block before it, as on one machine
        if "minhash_dedup" in blocks:
            blocks["minhash_dedup"].extra.update(counters)
    stats += dedup
    if s.TOKENIZER in by_stage:
        stats += merge([r["stats"] for r in by_stage[s.TOKENIZER]])
    return stats + [b for b in shards if b.block.startswith("pack")], tasks


def tasks_table(report: list[dict], tasks: list[dict], kind: str) -> str:
    lines = [
        f"{'stage':<14} {'tasks':>6} {'ran':>5} {'reused':>7} {'task s (sum)':>13} {'(max)':>7} {'peak task RSS':>14}"
    ]
    for run, task in zip(report, tasks):
        lines.append(
            f"{run['stage']:<14} {run['tasks']:>6} {run['ran']:>5} {run['reused']:>7} {sum(task['seconds']):>13.1f}"
            f" {max(task['seconds']):>7.1f} {max(task['peak_rss_bytes']) / 2**20:>11.0f} MB"
        )
    lines.append(f"(executor {kind}; a task's log: logs/STAGE/logs/task_NNNNN.log)")
    return "\n".join(lines)


def check_something_read(plan) -> None:
    """After the documents stage: the one-machine read's error (every file named, the drops of every shard summed)
    when no shard kept a document. A shard alone may keep none (its files held only bad lines)."""
    from ..read import ReadFiles, list_files
    from ..records import LINE_SUFFIXES
    from .stages import DOCUMENTS

    read = merge([plan.task_stats(DOCUMENTS, rank)["stats"][:1] for rank in range(plan.shards)])[0]
    if read.documents_out:
        return
    c = plan.config
    kind, files = list_files(c.input)
    reader = ReadFiles(c.text_column, c.max_bytes)
    reader.stats = read
    reader.check_something_read([], [str(p) for p in files], "line" if kind in LINE_SUFFIXES.values() else "row")


def task_config(config: PipelineConfig, executor: ExecutorConfig) -> PipelineConfig:
    """The config the tasks run: each task's blocks in its own process (`num_proc` None; module docstring). On the
    local executor `num_proc` is the default of `workers`; elsewhere it is not used, and a line on stderr says so."""
    if config.num_proc is not None:
        if executor.kind == "local" and "workers" not in (config.executor or {}):
            executor.workers = config.num_proc
        elif executor.kind != "local":
            print(
                f"note: num_proc={config.num_proc} is not used by executor {executor.kind!r}: each task runs in one "
                "process; set tasks (and cpus_per_task) in the executor section instead.",
                file=sys.stderr,
            )
    in_task = copy.copy(config)
    in_task.num_proc = None
    return in_task


def run_engine(config: PipelineConfig, verbose: bool = True) -> list[BlockStats]:
    from . import stages as s
    from .executors import check_ray, check_slurm, runner_for

    executor = ExecutorConfig(**config.executor)
    executor.check_installed()
    if executor.kind == "slurm":
        check_slurm(executor)
    if executor.kind == "ray":
        check_ray(executor)
    if config.rank != 0 or config.world_size != 1:
        raise ValueError(
            f"rank={config.rank}, world_size={config.world_size} with an executor: the executor shards the data "
            "itself (executor tasks); leave rank 0 and world_size 1."
        )
    shards = count_shards(config, executor.tasks)
    plan = s.Plan(task_config(config, executor), shards, executor.tokenizer_sample_documents)
    out = plan.out
    out.mkdir(parents=True, exist_ok=True)
    settings = {k: v for k, v in dataclasses.asdict(config).items() if k not in ("executor", "num_proc")}
    check_key(out, _key(settings, files_signature(config.input), shards))
    steps = chain(plan, executor)
    after = lambda stage: check_something_read(plan) if stage.folder == s.DOCUMENTS else None  # noqa: E731
    report = runner_for(executor, out / "logs").run(steps, after)
    if report is None:  # Slurm jobs submitted, not waited for
        return []
    stats, tasks = collect(plan, steps)
    write_json(out / "tasks.json", tasks)
    for folder in (s.TOKENIZER, s.PACK):  # what tokenizer_path / load_packed read
        if (out / folder).exists():
            name = folder.split("-", 1)[1]
            mine = [b for b in stats if b.block.split()[0] == name]
            write_json(out / folder / "stats.json", [b.to_dict() for b in mine])
    write_json(out / "stats.json", [b.to_dict() for b in stats])
    if verbose:
        print(summary_table(stats))
        print(tasks_table(report, tasks, executor.kind))
        for b in stats:
            broken = ", ".join(b.extra.get("corrupt_files", []))
            if broken and b.dropped.get("corrupt_compression"):
                print(f"corrupt input, read up to the break and counted as corrupt_compression: {broken}")
            elif broken:
                print(f"corrupt input, left out and counted as corrupt_file: {broken}")
    return stats
