"""The chain's stages as datatrove pipeline steps: each task runs our blocks on its shard and writes files.

A `Stage` is a datatrove `PipelineStep` whose `run(data, rank, world_size)` does one task of one stage:

  01-documents  (a task per shard)  read (a contiguous part of the input's files or rows) -> clean -> perplexity
                                    filter; the documents saved, with their hashes and MinHash band files; task 0
                                    also reads, cleans and filters the input's own held-out split, if it has one
  02-buckets    (a task per units)  distinct candidate pairs of bands' key ranges (`dedup_shards.py`)
  03-clusters   (one task)          linked pairs, a block at a time -> clusters -> each shard's verdicts
  04-tokenizer  (one task)          trained once on the first training documents of the shards, or copied
  05-pack       (a task per shard)  the verdicts applied by our dedup blocks (reasons `exact_duplicate`,
                                    `near_duplicate`), the held-out split (`split.py`, or the input's own: it is
                                    cleaned and filtered like train, not deduplicated), the documents saved
                                    (`05-pack/documents/{train,heldout}/SHARD`) and packed by `Pack` into
                                    `05-pack/{train,heldout}/SHARD`, which `load_packed` reads as one dataset

The blocks' counters and drop reasons are ours (`BlockStats` of every block, per task, in
`NN-stage/tasks/RANK.json`, written last: the task's own completion mark), also given to datatrove's stats
(`stat_update`). A task holds a lock (`locks/`, `fcntl.flock`) while it works, so two launches at once never
write the same files (the second waits, then finds the task done); every output is written to a temporary
name and renamed into place, so a killed task leaves nothing a relaunch would take for complete.

With an output_dir URL (`run.py`), the folder is the work folder, and the tasks that make what a reader needs
publish it (`Plan.publish`) before their completion mark: the tokenizer task its tokenizer, each pack task its
shard's documents and packed splits. A task killed while it uploads has no mark: a relaunch runs it, and its
upload, again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import functools
import json
import shutil
import threading
import time
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
from datatrove.pipeline.base import PipelineStep

from ..blocks import DROP, BlockStats, from_pretrained, shard_range
from ..dedup import DedupConfig, verdict_blocks
from ..pipeline_config import PipelineConfig
from ..prepared import tokenizer_folder
from ..read import ReadFiles, list_files, load_saved
from ..records import DOC_ID, RECORD
from ..split import own_heldout
from ..storage import is_url, join, one_listing_per_url, publish
from . import dedup_shards
from .dedup_shards import write_json

DOCUMENTS, BUCKETS, CLUSTERS, TOKENIZER, PACK = "01-documents", "02-buckets", "03-clusters", "04-tokenizer", "05-pack"


@dataclasses.dataclass
class Plan:
    """What every task needs to know: the chain's config, the number of shards and of bucket tasks."""

    config: PipelineConfig
    shards: int
    tokenizer_sample_documents: int = 1_000_000

    @property
    def out(self) -> Path:
        """The folder the tasks work in (`PipelineConfig.work_folder`)."""
        return self.config.work_folder()

    @property
    def url(self) -> str | None:
        """Where the results are published: the output_dir URL; None for a local output_dir."""
        return self.config.output_dir if is_url(self.config.output_dir) else None

    def publish(self, local: Path) -> None:
        """`local`, a folder in the work folder, uploaded to the same place under the output URL (if any)."""
        if self.url is not None:
            publish(local, str(join(self.url, local.relative_to(self.out).as_posix())))

    @functools.cached_property
    def own_heldout(self) -> str | None:
        """The name of the held-out split a `save_to_disk` DatasetDict input brings (`split.own_heldout`), or None."""
        from datasets import DatasetDict

        if is_url(self.config.input):  # a save_to_disk folder is read from a local path only (storage.py)
            return None
        kind, files = list_files(self.config.input)
        loaded = load_saved(files[0]) if kind == "disk" else None
        return own_heldout(loaded) if isinstance(loaded, DatasetDict) else None

    @property
    def dedup(self) -> DedupConfig | None:
        section = self.config.dedup
        if section is None or not (section.get("exact", True) or section.get("minhash", True)):
            return None
        return DedupConfig(**section)

    def bucket_units(self) -> tuple[int, int]:
        return dedup_shards.bucket_units(self.dedup, self.shards)

    def bucket_tasks(self) -> int:
        """Tasks of the buckets stage: one per unit (band x key range), at most one per shard."""
        return min(self.shards, self.bucket_units()[1])

    def task_stats(self, stage: str, rank: int) -> dict:
        path = self.out / stage / "tasks" / f"{rank:05d}.json"
        return json.loads(path.read_text())

    def offsets(self) -> np.ndarray:
        """Global id of each shard's first document (and the total): the documents stage's row counts summed."""
        rows = [self.task_stats(DOCUMENTS, rank)["rows"] for rank in range(self.shards)]
        return np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)


class PeakMemory:
    """The peak resident memory of this process while the block runs (psutil, sampled every 20 ms), and `start`, its
    resident memory when the block began: `peak - start` is what the block itself added (torch and transformers,
    imported before, are not in it; memory an earlier task of the same worker process left allocated is)."""

    def __enter__(self):
        import psutil

        self.process, self._stop = psutil.Process(), threading.Event()
        self.start = self.peak = self.process.memory_info().rss
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self) -> None:
        while True:
            self.peak = max(self.peak, self.process.memory_info().rss)
            if self._stop.wait(0.02):
                return

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.process.memory_info().rss)


@contextlib.contextmanager
def task_lock(path: Path):
    """An exclusive lock on `path` (released by the kernel when the process dies)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


@contextlib.contextmanager
def quiet_datasets():
    """`datasets`' progress bars off while a task works (a bar for each map, filter and save would bury datatrove's
    line per task), then as they were."""
    import datasets

    were_off = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not were_off:
            datasets.enable_progress_bars()


def replace_folder(tmp: Path, final: Path) -> None:
    """`tmp` renamed to `final` (an earlier, interrupted attempt's `final` removed first)."""
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)


def save(data, path: Path) -> None:
    """`data.save_to_disk(path)`, loadable when empty too (a shard that kept nothing): for a table of no rows
    `datasets` writes no data file, and `load_from_disk` then fails."""
    data.save_to_disk(str(path), num_shards=1 if len(data) == 0 else None)


def fresh(path: Path) -> Path:
    if path.exists():
        shutil.rmtree(path)
    return path


class Stage(PipelineStep):
    """One stage of the chain; `work(rank, world_size)` returns the task's `BlockStats` and other facts to keep."""

    type = "hf_pretrain"
    folder = ""

    def __init__(self, plan: Plan):
        super().__init__()
        self.plan = plan
        self.name = self.folder

    def run(self, data=None, rank: int = 0, world_size: int = 1):
        out = self.plan.out / self.folder
        done = out / "tasks" / f"{rank:05d}.json"
        with task_lock(self.plan.out / "locks" / f"{self.folder}-{rank:05d}.lock"):
            if not done.exists():  # else a launch running at the same time did this task while we waited
                start = time.perf_counter()
                with PeakMemory() as memory, quiet_datasets(), one_listing_per_url():
                    stats, facts = self.work(out, rank, world_size)
                record = {
                    "stats": [s.to_dict() for s in stats],
                    "seconds": time.perf_counter() - start,
                    "peak_rss_bytes": memory.peak,
                    "rss_growth_bytes": memory.peak - memory.start,
                    **facts,
                }
                write_json(done, record)
        for s in json.loads(done.read_text())["stats"]:
            self.stat_update(f"{s['block']}/documents_in", value=s["documents_in"])
            self.stat_update(f"{s['block']}/documents_out", value=s["documents_out"])
            for reason, n in s["dropped"].items():
                self.stat_update(f"{s['block']}/dropped_{reason}", value=n)

    def work(self, out: Path, rank: int, world_size: int) -> tuple[list[BlockStats], dict]:
        raise NotImplementedError


class ShardFiles(ReadFiles):
    """`ReadFiles` with a contiguous part of the files per shard (shard 0's, then 1's, ... is the input's order,
    so dedup keeps the same copies as on one machine); names the compressed files whose stream broke. A shard whose
    lines are all dropped keeps no document, counted like any other: the run fails only when no shard kept one
    (`run.check_something_read`, after this stage), so the result does not depend on the number of tasks."""

    def _mark_lines(self, files, names, rank, world_size, num_proc):
        start, stop = shard_range(len(files), rank, world_size)
        return super()._mark_lines(files[start:stop], names[start:stop], 0, 1, num_proc)

    def keep(self, marked, num_proc):
        table = marked.data
        if DOC_ID in table.column_names:
            broken = table.filter(pc.equal(table.column(DROP), "corrupt_compression")).column(DOC_ID).to_pylist()
        else:
            broken = []
        kept = super().keep(marked, num_proc)
        if broken:
            self.stats.extra["corrupt_files"] = broken
        return kept

    def finish(self, kept):
        if len(kept) or self._source["unit"] != "line":
            return super().finish(kept)
        return kept.remove_columns(RECORD)  # nothing to keep here: the text and doc_id columns, no row


def document_blocks(config: PipelineConfig) -> list:
    """The blocks each document goes through before dedup, in order: clean, then the perplexity filter."""
    from ..clean import Clean, CleanConfig
    from ..perplexity import PerplexityFilter

    blocks = []
    if config.clean is not None:
        blocks.append(Clean(CleanConfig(**config.clean), text_column=config.text_column))
    if config.perplexity is not None:
        blocks.append(PerplexityFilter(text_column=config.text_column, **config.perplexity))
    return blocks


class Documents(Stage):
    folder = DOCUMENTS

    def work(self, out, rank, world_size):
        from datasets import load_from_disk

        c = self.plan.config
        reader = ShardFiles(c.text_column, c.max_bytes)
        splits = {"data": reader.run(c.input, rank, world_size, c.num_proc)}
        stats = [reader.stats]
        own = self.plan.own_heldout
        if own and rank == 0:  # the input's own held-out split: small, read whole by the first task
            held = ReadFiles(c.text_column, c.max_bytes)
            loaded = load_saved(c.input)[own]
            splits["heldout"] = held.read_dataset(loaded, f"{Path(c.input).name}/{own}", num_proc=c.num_proc)
            stats.append(dataclasses.replace(held.stats, block="read heldout"))
        for split, data in splits.items():
            for block in document_blocks(c):
                data = block.run(data, num_proc=c.num_proc)
                stats.append(
                    dataclasses.replace(block.stats, block=block.name + ("" if split == "data" else " heldout"))
                )
            tmp = fresh(out / split / f".{rank:05d}.tmp")
            save(data, tmp)
            replace_folder(tmp, out / split / f"{rank:05d}")
        if self.plan.dedup is not None:
            texts = load_from_disk(str(out / "data" / f"{rank:05d}")).data.column(c.text_column)
            dedup_shards.write_signatures(out / "dedup", rank, texts, self.plan.dedup)
        return stats, {"rows": len(splits["data"])}


class Buckets(Stage):
    folder = BUCKETS

    def work(self, out, rank, world_size):
        settings, offsets = self.plan.dedup, self.plan.offsets()
        found = dedup_shards.task_pairs(self.plan.out / DOCUMENTS / "dedup", rank, world_size, settings, offsets)
        dedup_shards.save_pairs(out / "pairs" / f"{rank:05d}.npy", found)
        return [BlockStats("buckets", documents_in=int(offsets[-1]), extra={"pairs": len(found)})], {}


class Clusters(Stage):
    folder = CLUSTERS

    def work(self, out, rank, world_size):
        settings, offsets = self.plan.dedup, self.plan.offsets()
        pairs = [self.plan.out / BUCKETS / "pairs" / f"{task:05d}.npy" for task in range(self.plan.bucket_tasks())]
        counters = dedup_shards.cluster(self.plan.out / DOCUMENTS / "dedup", pairs, offsets, settings, out / "verdicts")
        return [BlockStats("clusters", documents_in=int(offsets[-1]), extra=counters)], {"counters": counters}


def kept_splits(plan: Plan, rank: int) -> tuple[dict, list[BlockStats]]:
    """Shard `rank`'s documents with the clusters stage's verdicts applied by the dedup blocks, split into train and
    heldout (`split.py`; or the input's own held-out split, all of it in shard 0); and the blocks' stats."""
    from datasets import load_from_disk

    from ..split import split_by_hash

    c = plan.config
    data = load_from_disk(str(plan.out / DOCUMENTS / "data" / f"{rank:05d}"))
    stats = []
    if plan.dedup is not None:
        codes = dedup_shards.shard_codes(plan.out / CLUSTERS / "verdicts", rank, len(data))
        for block in verdict_blocks(plan.dedup, codes, c.text_column):
            data = block.run(data, num_proc=c.num_proc)
            stats.append(block.stats)
    if plan.own_heldout:
        held = plan.out / DOCUMENTS / "heldout" / f"{rank:05d}"
        heldout = load_from_disk(str(held)) if held.exists() else data.select([])
        splits, fraction = {"train": data, "heldout": heldout}, None
    else:
        splits, fraction = split_by_hash(data, c.heldout_fraction, c.text_column, c.num_proc), c.heldout_fraction
    train, heldout = len(splits["train"]), len(splits["heldout"])
    split = BlockStats("split", documents_in=train + heldout, documents_out=train)
    split.extra.update(train=train, heldout=heldout, heldout_fraction=fraction)
    return splits, [*stats, split]


def make_tokenizer(train, heldout: list[str], options: dict, folder: Path, text_column: str) -> list[BlockStats]:
    """The tokenizer into `folder/tokenizer`: trained on `train`, or `options["path"]` copied; bytes per token
    measured on the `heldout` texts."""
    from ..tokenizer import measure_bytes_per_token, train_tokenizer

    options = dict(options)
    if "path" in options:  # an existing tokenizer: copy it, measure it
        from transformers import AutoTokenizer

        tokenizer = from_pretrained(AutoTokenizer, tokenizer_folder(options["path"]), "path")
        tokenizer.save_pretrained(str(folder / "tokenizer"))
        extra = {"reused": options["path"], "vocab_size": len(tokenizer)}
        extra.update(measure_bytes_per_token(tokenizer, heldout, train, text_column))
        return [BlockStats("tokenizer", extra=extra)]
    _, stats = train_tokenizer(train, folder / "tokenizer", text_column=text_column, heldout_texts=heldout, **options)
    return [stats]


def pack_splits(splits, tokenizer, text_column: str, options: dict, output) -> list[BlockStats]:
    """Pack the train and heldout splits into `output(split)`; a split that cannot fill one block is left unpacked,
    with the reason in its stats (`skipped`)."""
    from ..packing import Pack

    out = []
    for split in ("train", "heldout"):
        if len(splits[split]) == 0:
            continue
        pack = Pack(tokenizer, text_column=text_column, **options)
        pack.name = f"pack {split}"
        try:
            pack.run(splits[split]).save_to_disk(str(output(split)))
        except ValueError as err:
            skipped = {"skipped": str(err)}  # too little text for one block: no data of this split
            out.append(BlockStats(pack.name, documents_in=len(splits[split]), extra=skipped))
            continue
        pack.stats.block = pack.name
        out.append(pack.stats)
    return out


class Tokenizer(Stage):
    """One task: the tokenizer trained on the first training documents of the shards, in order, or copied."""

    folder = TOKENIZER

    def work(self, out, rank, world_size):
        from datasets import concatenate_datasets

        c, plan = self.plan.config, self.plan
        train, heldout, wanted = [], [], plan.tokenizer_sample_documents
        for shard in range(plan.shards):
            if wanted <= 0:
                break
            splits, _ = kept_splits(plan, shard)
            if len(splits["train"]):  # a shard that kept nothing has no fields to concatenate with the others'
                train.append(splits["train"].select(range(min(wanted, len(splits["train"])))))
                wanted -= len(train[-1])
            heldout += splits["heldout"][c.text_column][: 1000 - len(heldout)]
        sample = concatenate_datasets(train)
        tmp = fresh(out / ".tmp")
        stats = make_tokenizer(sample, heldout, c.tokenizer, tmp, c.text_column)
        replace_folder(tmp / "tokenizer", fresh(out / "tokenizer"))
        shutil.rmtree(tmp)
        plan.publish(out / "tokenizer")
        stats[0].extra["sample_documents"] = len(sample)
        return stats, {}


class Pack(Stage):
    """Each shard deduplicated and split (`05-pack/documents/{train,heldout}/SHARD`), then packed into
    `05-pack/{train,heldout}/SHARD` when the chain has a tokenizer and a pack section (a shard too small for one
    block: skipped, with the reason in its stats)."""

    folder = PACK

    def work(self, out, rank, world_size):
        from transformers import AutoTokenizer

        c = self.plan.config
        splits, stats = kept_splits(self.plan, rank)
        for name, part in splits.items():
            tmp = fresh(out / "documents" / name / f".{rank:05d}.tmp")
            save(part, tmp)
            replace_folder(tmp, out / "documents" / name / f"{rank:05d}")
            self.plan.publish(out / "documents" / name / f"{rank:05d}")
        if c.tokenizer is None or c.pack is None:
            return stats, {}
        tokenizer = AutoTokenizer.from_pretrained(str(self.plan.out / TOKENIZER / "tokenizer"))
        for name in splits:
            fresh(out / name / f".{rank:05d}.tmp")
        temporary = lambda name: out / name / f".{rank:05d}.tmp"  # noqa: E731
        stats += pack_splits(splits, tokenizer, c.text_column, c.pack, temporary)
        for name in splits:
            if temporary(name).exists():
                replace_folder(temporary(name), out / name / f"{rank:05d}")
                self.plan.publish(out / name / f"{rank:05d}")
        return stats, {}
