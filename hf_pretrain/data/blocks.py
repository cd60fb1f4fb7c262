"""The data chain's building block: a step over `datasets` with counters (datatrove-style).

A `Block` rewrites batches of documents and marks the ones to drop with a reason; `run(data,
rank, world_size, num_proc)` applies it to a `datasets.Dataset` (in `num_proc` worker processes)
or a streaming `IterableDataset` (lazily), keeps this rank's shard when `world_size > 1`, drops
the marked rows and counts everything in `block.stats` (`BlockStats`): documents in and out,
dropped by reason, bytes in and out, seconds. Nothing is dropped without a reason in the counts.

How a block marks rows: `process(batch)` returns the batch (same columns, any number of rows:
a block may split a document) plus a `DROP` column, `""` to keep a row or the reason to drop it.
Every column rides along (a piece of a split document copies its document's columns), so the
fields and `doc_id` of the reader (`read.py`) survive the chain; the helper column names are
reserved (data that has one is refused with the fix).
Counting reads that column after the map, so counts are right with worker processes (their own
counters would stay in the workers); for a streaming dataset they are complete once the data has
been consumed (`stats` fills up as it is iterated).

`run` is written once, here: `mark` -> `keep` -> `finish` (see `Block`). The reader (`ReadFiles`,
whose input is a path) and `Pack` (whose rows are blocks of tokens) are blocks too: they replace
`mark` (and `Pack` its counting, `keep`), not `run`.

The chain runs these blocks inside datatrove's executors (`chain/stages.py`: each stage a datatrove step whose
task runs our blocks on its shard). A block works on a `datasets` table rather than datatrove's `Document` stream
because packing and the Trainer read Arrow tables, and a task's shard is one. Which of our rule blocks datatrove's
own (Gopher, C4, FineWeb filters; its MinHash stages) should replace is measured in
`benchmarks/datatrove_parts.py` (docs/data.md).
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import pyarrow.compute as pc
from datasets import Dataset, IterableDataset
from datasets.distributed import split_dataset_by_node

from .workers import children_die_with_parent

DROP = "_drop"  # reason to drop a row; "" keeps it
FIRST = "_first"  # True on the first output row of each input document (blocks that split set it)
BYTES_IN = "_bytes_in"  # the batch's input bytes, carried on its first row
BYTES_OUT = "_bytes_out"  # UTF-8 bytes of the row's text after the block
HELPER_COLUMNS = [DROP, FIRST, BYTES_IN, BYTES_OUT]
# A row that stands for nothing, never counted: a generator that found no line yields one, because datasets
# cannot build a dataset from a generator that yields no row (the "No document could be read" error follows).
PLACEHOLDER = "_placeholder"


@dataclass
class BlockStats:
    block: str
    documents_in: int = 0
    documents_out: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    bytes_in: int = 0
    bytes_out: int = 0
    seconds: float = 0.0
    extra: dict = field(default_factory=dict)  # block-specific counters (tokens, clusters, splits, ...)

    def to_dict(self) -> dict:
        return asdict(self)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")

    def summary(self) -> str:
        dropped = ", ".join(f"{reason} {n:,}" for reason, n in sorted(self.dropped.items(), key=lambda x: -x[1]))
        rate = self.documents_in / self.seconds if self.seconds else 0.0
        return (
            f"{self.block:<16} {self.documents_in:>10,} -> {self.documents_out:>10,} docs"
            f"  {self.bytes_in / 1e6:9.1f} -> {self.bytes_out / 1e6:9.1f} MB  {rate:9,.0f} docs/s"
            + (f"  dropped: {dropped}" if dropped else "")
        )


def text_bytes(texts: list) -> list[int]:
    """UTF-8 bytes of each text; 0 for what is not a string (None, a number: the blocks drop it as `not_text`)."""
    return [len(t.encode("utf-8", "surrogatepass")) if isinstance(t, str) else 0 for t in texts]


def check_rank(rank: int, world_size: int) -> None:
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is invalid for world_size={world_size}: use 0 <= rank < world_size.")


def from_pretrained(loader, path, field: str, **kwargs):
    """`loader.from_pretrained(path)` (AutoTokenizer, AutoConfig, ...); a path it cannot load is one line naming
    `field` and the fix instead of transformers' traceback (which reads a missing folder as a bad hub id)."""
    try:
        return loader.from_pretrained(str(path), **kwargs)
    except (OSError, ValueError) as err:
        reason = "no such folder" if not Path(path).exists() else (str(err).strip().splitlines() or [""])[0][:200]
        raise ValueError(
            f"{field}={str(path)!r} cannot be loaded ({reason}); give a folder that save_pretrained wrote "
            "(e.g. the output of `hf-pretrain data train-tokenizer`, or a trained run's checkpoint)."
        ) from None


def shard_range(num_rows: int, rank: int, world_size: int) -> tuple[int, int]:
    """[start, stop) of this rank's contiguous rows: the first `num_rows % world_size` ranks get one row more."""
    check_rank(rank, world_size)
    size, extra = divmod(num_rows, world_size)
    start = rank * size + min(rank, extra)
    return start, start + size + (rank < extra)


def shard(data: Dataset | IterableDataset, rank: int, world_size: int) -> Dataset | IterableDataset:
    """This rank's part of `data` (contiguous for a Dataset, so the order within a shard is kept)."""
    check_rank(rank, world_size)
    if world_size == 1:
        return data
    if isinstance(data, IterableDataset):
        return split_dataset_by_node(data, rank=rank, world_size=world_size)
    return data.select(range(*shard_range(len(data), rank, world_size)))


def count_and_keep(marked: Dataset, stats: BlockStats, num_proc: int | None = None) -> Dataset:
    """Fill `stats` from the helper columns of `marked` (fresh from a map or a generator) and keep the "" rows."""
    table = marked.data  # no indices mapping yet, so the Arrow columns are the rows
    drop = table.column(DROP)
    keep = pc.equal(drop, "")
    stats.documents_in = pc.sum(table.column(FIRST)).as_py() or 0
    stats.bytes_in = pc.sum(table.column(BYTES_IN)).as_py() or 0
    stats.bytes_out = pc.sum(pc.if_else(keep, table.column(BYTES_OUT), 0)).as_py() or 0
    counts = pc.value_counts(drop).to_pylist()
    stats.dropped = {c["values"]: c["counts"] for c in counts if c["values"] not in ("", PLACEHOLDER)}
    kept = marked.filter(lambda d: [x == "" for x in d], input_columns=[DROP], batched=True, num_proc=num_proc)
    kept = kept.remove_columns(HELPER_COLUMNS)
    stats.documents_out = len(kept)
    return kept


def count_and_keep_streaming(marked: IterableDataset, stats: BlockStats, start: float) -> IterableDataset:
    """The streaming twin of `count_and_keep`: `stats` fill up as the kept rows are consumed."""

    def count(row: dict) -> bool:
        stats.documents_in += bool(row[FIRST])
        stats.bytes_in += row[BYTES_IN]
        stats.seconds = time.perf_counter() - start
        if row[DROP] == PLACEHOLDER:
            return False
        if row[DROP]:
            stats.dropped[row[DROP]] = stats.dropped.get(row[DROP], 0) + 1
            return False
        stats.documents_out += 1
        stats.bytes_out += row[BYTES_OUT]
        return True

    return marked.filter(count).remove_columns(HELPER_COLUMNS)


def check_text_column(name: str, data: Dataset | IterableDataset, text_column: str) -> None:
    """The one error for data without the text column (a stream may not know its columns: then nothing to check)."""
    if data.column_names is not None and text_column not in data.column_names:
        raise ValueError(f"{name}: text_column={text_column!r} is not in the data; columns are {data.column_names}.")


class Block:
    """A step of the chain: `run` is the same for every block, the block says how it marks rows.

    `run(data, rank, world_size, num_proc)` = `mark` (this rank's rows with the helper columns:
    the default shards `data`, checks its columns and maps `process` over batches) -> `keep` (fill
    `stats` from the helper columns and keep the "" rows: `count_and_keep`) -> `finish` (the block's
    own counters in `stats.extra`, its helper columns removed). A stream goes through `mark`, the
    streaming count and `finish_stream`. Row-wise blocks implement `process` only; the reader
    (`ReadFiles`: marks lines of files) and `Pack` (marks blocks of tokens) implement `mark`.
    """

    name = "block"
    text_column = "text"
    batch_size = 1000

    def __init__(self):
        self.stats = BlockStats(self.name)

    def process(self, batch: dict[str, list]) -> dict[str, list]:
        """The batch rewritten, with `DROP` (and `FIRST` when the number of rows changes)."""
        raise NotImplementedError(f"{type(self).__name__} implements neither process() nor mark().")

    def _process(self, batch: dict[str, list]) -> dict[str, list]:
        n_in = len(batch[self.text_column])
        bytes_in = sum(text_bytes(batch[self.text_column]))
        out = self.process(batch)
        n_out = len(out[self.text_column])
        if FIRST not in out:
            if n_out != n_in:
                raise RuntimeError(f"{self.name}.process changed the number of rows: it must return {FIRST!r}.")
            out[FIRST] = [True] * n_out
        out.setdefault(DROP, [""] * n_out)
        out[BYTES_IN] = [bytes_in if i == 0 else 0 for i in range(n_out)]
        out[BYTES_OUT] = text_bytes(out[self.text_column])
        return out

    @children_die_with_parent()
    def run(
        self, data: Dataset | IterableDataset, rank: int = 0, world_size: int = 1, num_proc: int | None = None
    ) -> Dataset | IterableDataset:
        """This rank's shard of `data` through the block: kept rows only; counters in `self.stats`."""
        self.stats = BlockStats(self.name)
        start = time.perf_counter()
        marked = self.mark(data, rank, world_size, num_proc)
        if isinstance(marked, IterableDataset):
            return self.finish_stream(count_and_keep_streaming(marked, self.stats, start))
        if len(marked) == 0:  # no row to mark or count (map never calls process on zero rows)
            return marked
        kept = self.finish(self.keep(marked, num_proc))
        self.stats.seconds = time.perf_counter() - start
        return kept

    def mark(
        self, data: Dataset | IterableDataset, rank: int, world_size: int, num_proc: int | None
    ) -> Dataset | IterableDataset:
        """This rank's rows of `data` with the helper columns (`process` over batches)."""
        data = shard(data, rank, world_size)
        check_text_column(self.name, data, self.text_column)
        taken = sorted(set(HELPER_COLUMNS) & set(data.column_names or ()))
        if taken:
            raise ValueError(
                f"{self.name}: the data has column(s) {taken}, names the blocks use themselves; rename them."
            )
        if isinstance(data, IterableDataset):
            return data.map(self._process, batched=True, batch_size=self.batch_size, remove_columns=data.column_names)
        if len(data) == 0:
            return data
        return data.map(
            self._process,
            batched=True,
            batch_size=self.batch_size,
            num_proc=num_proc,
            remove_columns=data.column_names,
            desc=self.name,
        )

    def keep(self, marked: Dataset, num_proc: int | None) -> Dataset:
        """`stats` from the helper columns of `marked`, and its kept rows."""
        return count_and_keep(marked, self.stats, num_proc)

    def finish(self, kept: Dataset) -> Dataset:
        """Hook after a (non-streaming) run: the block's own counters in `self.stats.extra`; returns the data."""
        return kept

    def finish_stream(self, kept: IterableDataset) -> IterableDataset:
        """Hook on a stream's kept rows (counters fill up as it is consumed); returns the stream."""
        return kept
