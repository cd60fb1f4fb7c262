"""The data chain: every stage a datatrove pipeline step, run by datatrove's local, Slurm or Ray executor.

`run_pipeline(config)` (what `hf-pretrain data prepare`, `examples/pretrain.py` and the precision trial run)
splits the input into `tasks` shards and runs the stages of `stages.py` on the executor of the config's
`executor` section (`executors.py`); without one, on the local executor in this process with one task, or
`num_proc` tasks at once. The global MinHash dedup is sharded by band and key range (`dedup_shards.py`). The
result does not depend on the executor or the number of tasks: the same documents kept (the shards are
contiguous parts of the input, so dedup keeps the same copy), the same tokenizer when the sample holds every
training document, each shard packed on its own (`05-pack/train/SHARD`), and `prepared.load_packed` reads the
shards as one dataset. Counters are ours, merged over the tasks into `OUTPUT/stats.json` and the summary table;
`OUTPUT/tasks.json` has each stage's tasks (run or reused), seconds, peak memory and the memory its block added.

Reuse: each stage's key (`NN-stage/stage.json`) hashes its settings and the key of the stage before it (the
documents stage's: the input files' names, sizes and modification times, and the number of shards). A relaunch
runs only the tasks without datatrove's completion mark; a stage whose key changed is removed, with every later
one, and runs again (a new `pack` section re-packs; an edited input file reruns everything). Two launches into
one folder: with the same config they share the work (a task's lock, `stages.task_lock`); a launch that would
remove a stage while another launch runs is refused.

Under an executor a task is one process (datatrove's local pool workers are daemonic and may not start
`datasets`' pools of their own): the tasks run their blocks in their own process, the executor's `tasks` and
`workers` are the parallelism, and on the local executor `num_proc`, when `workers` is not given, is how many
tasks run at once. That is datatrove's own model (a task is the unit of work, of completion marks and of logs),
and what a datatrove user sets; the alternative, `datasets` pools inside non-daemonic task processes, would mean
replacing datatrove's pool and would run `workers` x `num_proc` processes on the cores the workers already fill. A shard whose files hold no document keeps none; the run fails, with the read's error, only
when the whole input yields nothing (`check_something_read`).

Why datatrove: its three executors run one pipeline unchanged, mark completed tasks so that a relaunch reruns
only the others, and keep a log per task (FineWeb was built with it).

Output at an fsspec URL (`output_dir: "s3://bucket/prefix"`): object stores have no rename, no `flock` and no
cheap listing, and the chain's coordination needs them (stage keys, task locks, datatrove's completion marks,
temporary names renamed into place, the dedup intermediates: band files, pairs, verdicts, the documents between
stages). So the chain works in a local folder, `work_dir` (default: `cache_root()/chain/<hash of the URL>`; on
Slurm or Ray it must be given, on a filesystem every node shares), exactly as it works in a local output_dir,
and publishes to the URL only what a reader needs, at the same relative paths: the tokenizer
(`04-tokenizer/tokenizer/`, by its task), each shard's documents and packed splits (`05-pack/documents/...`,
`05-pack/{train,heldout}/SHARD/`, by the pack task that made them, before its completion mark), then, when every
task is done, `tasks.json`, each published stage's `stats.json` and the top `stats.json` last (a JSON only when
its bytes changed: a relaunch that reuses everything uploads only `tasks.json`, whose ran/reused columns are the
relaunch's). A stage's `stats.json` at the URL is its completion mark there, as in a local folder, so
`load_packed(url)` never reads a half-published stage. A stage removed from the work folder (its key changed, or
the folder was lost) is removed from the URL too, and one whose `stats.json` the URL lost is redone. Writing
straight to the URL would need a second coordination protocol on the store (conditional writes, listing for
marks); working locally keeps one, at the price of the work folder's disk (the intermediates a local run keeps).
"""

from __future__ import annotations

import contextlib
import copy
import fcntl
import json
import shutil
import sys
from pathlib import Path

from ..blocks import BlockStats
from ..executor_config import ExecutorConfig
from ..pipeline_config import PipelineConfig
from ..prepared import files_signature, summary_table, tokenizer_folder
from ..storage import check_output, config_key, exists, is_url, join, one_listing_per_url, publish_text, remove
from .dedup_shards import write_json

CONSTANT = {"mode", "seq_len", "bands", "rows", "num_perm", "threshold", "heldout_fraction", "vocab_size"}
MAXIMUM = {"peak_rss_bytes"}


def count_shards(config: PipelineConfig, tasks: int) -> int:
    """How many shards: `tasks`, at most one per input file (line files) or row (typed inputs)."""
    from datasets import DatasetDict

    from ..read import TypedFiles, list_files, load_saved
    from ..split import own_heldout

    kind, files = list_files(config.input)
    if kind == "disk":
        loaded = load_saved(files[0])
        if isinstance(loaded, DatasetDict):
            if "train" not in loaded and own_heldout(loaded):
                raise ValueError(f"input={config.input!r} has splits {list(loaded)}, no 'train'; save one named train.")
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


def stage_settings(plan, stage) -> list:
    """What a stage's output depends on, beside the stages before it."""
    c = plan.config
    if stage.folder == "01-documents":
        return [files_signature(c.input), c.text_column, c.max_bytes, c.clean, c.perplexity, c.dedup, plan.shards]
    if stage.folder == "04-tokenizer":
        path = c.tokenizer.get("path")
        signature = files_signature(tokenizer_folder(path)) if path else None
        return [c.tokenizer, signature, c.heldout_fraction, plan.tokenizer_sample_documents]
    if stage.folder == "05-pack":
        return [c.pack, c.heldout_fraction]
    return [c.dedup]


def stage_keys(plan, steps: list[tuple]) -> dict[str, str]:
    """Each stage's key: its settings and the key of the stage before it (module docstring)."""
    keys, key = {}, ""
    for stage, _ in steps:
        key = keys[stage.folder] = config_key(key, stage.folder, stage_settings(plan, stage))
    return keys


@contextlib.contextmanager
def claimed(out: Path, keys: dict[str, str], url: str | None = None):
    """The folder for this run while it lasts: stages of other keys (and every later one) removed first, from the
    output URL too (if any); a stage whose stats.json the URL lost counts as changed.

    Two locks: `locks/engine.lock`, held while the keys are checked and written, and `locks/run.lock`, shared by
    every launch while it runs. Removing stages needs `run.lock` alone: a launch that would remove a stage while
    another runs is one error. The kernel releases both when a launch dies."""
    from .stages import task_lock

    (out / "locks").mkdir(parents=True, exist_ok=True)
    with open(out / "locks" / "run.lock", "a") as run:
        with task_lock(out / "locks" / "engine.lock"):
            found = {folder: stage_key(out / folder) for folder in keys}
            if url is not None:
                found.update({folder: "" for folder in keys if unpublished(out, url, folder)})
            changed = [folder for folder, key in keys.items() if found[folder] not in (key, None)]
            stale = list(keys)[list(keys).index(changed[0]) :] if changed else []
            if stale:
                try:
                    fcntl.flock(run, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    raise ValueError(
                        f"output_dir={str(out)!r}: another launch with another config, input or number of tasks is "
                        "running in it; wait for it to end, or pass a new output_dir."
                    ) from None
            redo = [folder for folder in keys if folder in stale or found[folder] is None]
            for folder in redo:  # a changed stage, or completion marks left without their stage's folder
                for path in (out / folder, out / "logs" / folder):
                    if path.exists():
                        shutil.rmtree(path)
            if url is not None and redo:  # the top counters describe what is removed
                for name in ["stats.json", *redo]:
                    remove(str(join(url, name)))
            fcntl.flock(run, fcntl.LOCK_SH)  # exclusive -> shared (engine.lock held): launches of this config join
            for folder, key in keys.items():
                (out / folder).mkdir(parents=True, exist_ok=True)
                write_json(out / folder / "stage.json", key)
        yield


def unpublished(out: Path, url: str, folder: str) -> bool:
    """Whether the work folder holds a complete published stage (its stats.json) that the URL lost."""
    return (out / folder / "stats.json").exists() and not exists(str(join(url, folder, "stats.json")))


def publish_results(out: Path, url: str, folders: list[str]) -> list[str]:
    """The run's JSONs published (module docstring): tasks.json, each stage's stats.json, the top stats.json last;
    the names of those whose bytes changed."""
    names = ["tasks.json", *(f"{folder}/stats.json" for folder in folders), "stats.json"]
    return [name for name in names if publish_text(str(join(url, name)), (out / name).read_text())]


def stage_key(folder: Path) -> str | None:
    """The key a stage folder was made under; None when there is no such folder. A folder of an older version
    without one is stale (its key is not this run's)."""
    if not folder.exists():
        return None
    path = folder / "stage.json"
    return json.loads(path.read_text()) if path.exists() else ""


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
    in_task.work_dir = str(config.work_folder()) if is_url(config.output_dir) else None  # resolved once, here
    return in_task


def executor_of(config: PipelineConfig) -> ExecutorConfig:
    """The config's executor section; without one, the local executor: one task in this process (datatrove runs a
    single worker's tasks in a loop), or `num_proc` tasks at once."""
    if config.executor is not None:
        return ExecutorConfig(**config.executor)
    tasks = config.num_proc or 1
    return ExecutorConfig(kind="local", tasks=tasks, workers=tasks)


def run_pipeline(config: PipelineConfig, verbose: bool = True) -> list[BlockStats]:
    """Run the chain (module docstring); returns every block's counters, summed over the tasks, in chain order."""
    from .executors import check_ray, check_slurm

    executor = executor_of(config)
    executor.check_installed()
    if executor.kind == "slurm":
        check_slurm(executor)
    if executor.kind == "ray":
        check_ray(executor)
    if config.rank != 0 or config.world_size != 1:
        raise ValueError(
            f"rank={config.rank}, world_size={config.world_size}: the chain shards the data itself (executor "
            "tasks); leave rank 0 and world_size 1 and set tasks in the executor section."
        )
    if is_url(config.output_dir):
        check_output(config.output_dir)
    with one_listing_per_url():  # an input URL listed once for the shards and the stage key (storage.py)
        return _run_chain(config, executor, verbose)


def _run_chain(config: PipelineConfig, executor, verbose: bool) -> list[BlockStats]:
    from . import stages as s
    from .executors import runner_for

    shards = count_shards(config, executor.tasks)
    plan = s.Plan(task_config(config, executor), shards, executor.tokenizer_sample_documents)
    out = plan.out
    out.mkdir(parents=True, exist_ok=True)
    if verbose and plan.url:
        print(f"working in {out} (work_dir); publishing to {plan.url} as each task ends", flush=True)
    steps = chain(plan, executor)
    after = lambda stage: check_something_read(plan) if stage.folder == s.DOCUMENTS else None  # noqa: E731
    with claimed(out, stage_keys(plan, steps), plan.url):
        report = runner_for(executor, out / "logs").run(steps, after)
        if report is None:  # Slurm jobs submitted, not waited for
            return []
        stats, tasks = collect(plan, steps)
        for task, run in zip(tasks, report):
            task.update(ran=run["ran"], reused=run["reused"])
        write_json(out / "tasks.json", tasks)
        for folder in (s.TOKENIZER, s.PACK):  # what tokenizer_path / load_packed read
            if (out / folder).exists():
                name = folder.split("-", 1)[1]
                mine = [b for b in stats if b.block.split()[0] == name]
                write_json(out / folder / "stats.json", [b.to_dict() for b in mine])
        write_json(out / "stats.json", [b.to_dict() for b in stats])
        published = [folder for folder in (s.TOKENIZER, s.PACK) if (out / folder / "stats.json").exists()]
        changed = publish_results(out, plan.url, published) if plan.url else []
    if verbose and plan.url:
        print(f"published {plan.url} ({', '.join(published)}; JSONs changed: {', '.join(changed) or 'none'})")
    if verbose:
        print(summary_table(stats, reused_stages(out)))
        print(tasks_table(report, tasks, executor.kind))
        if plan.dedup is not None and plan.dedup.minhash and plan.dedup.verbose:
            print(f"minhash_dedup: {plan.dedup.s_curve()}")
        for b in stats:
            broken = ", ".join(b.extra.get("corrupt_files", []))
            if broken and b.dropped.get("corrupt_compression"):
                print(f"corrupt input, read up to the break and counted as corrupt_compression: {broken}")
            elif broken:
                print(f"corrupt input, left out and counted as corrupt_file: {broken}")
    return stats


def reused_stages(output_dir: str | Path) -> list[str]:
    """The stages of the last run in `output_dir` whose every task was complete from an earlier launch."""
    tasks = json.loads((Path(output_dir) / "tasks.json").read_text())
    return [t["stage"] for t in tasks if t.get("ran") == 0]
