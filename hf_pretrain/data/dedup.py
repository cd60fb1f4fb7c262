"""Duplicate removal as data blocks: `ExactDedup` (content hash) and `MinHashDedup` (exact, then MinHash LSH).

Dedup is global: a document is a duplicate of another anywhere in the data, so unlike the other
blocks these need a first pass over all of it before any row can be marked. `run()` does:

1. a first `Dataset.map(batched=True, num_proc=num_proc)` over the Arrow batches computing, per
   document, a 128-bit content hash of the normalised text (lower-cased, whitespace collapsed)
   and, for `MinHashDedup`, its MinHash signature (`minhash.py`);
2. in the main process: the first occurrence of each content hash is kept (`"exact_duplicate"`
   for the others), then LSH banding over the survivors' signatures, candidate pairs from bands
   sharing a bucket, an optional check of each pair by its estimated Jaccard similarity, and
   union-find clustering keeping the lowest row index of each cluster (`"near_duplicate"` for
   the others; `lsh.py`);
3. the base class's `run()` with a `process` that looks each row's reason up by its row index
   (carried in a helper column), so counting, sharding and filtering are the usual ones.

Everything is a function of the data alone: the same input gives the same output whatever
`num_proc` or the batch size (signatures are per document, clusters do not depend on the order
edges are found in, and the representative is the lowest index). With `world_size > 1` every rank
computes the same global result and keeps the surviving rows of its own shard, so the union over
ranks is the globally deduplicated data; `stats.dropped` counts this rank's shard, `stats.extra`
the whole data (every rank repeats the first pass: the price of not communicating).

Memory: the first pass stores the signatures (4 * num_perm bytes a document) next to the data
(in the datasets cache for data on disk); the main process holds the band keys (`lsh.py`).

Streaming: a streaming `IterableDataset` is refused with a ValueError (dedup needs two passes over
data it can index by row): load the data without `streaming=True`, or write the previous step to
disk (`save_to_disk`, `Dataset.from_generator`) and load that.

Where it runs: `hf-pretrain data dedup` (one step, one process) runs `MinHashDedup` as it is; the chain
(`chain/`) decides the verdicts with the sharded driver (`chain/dedup_shards.py`: the same signatures, bands
and clusters, split into datatrove tasks) and applies them with `_GlobalDedup`'s marking, so both keep the same
rows (tests/data/test_chain.py). datasketch builds its signatures one document at a time (see `minhash.py`).
"""

from __future__ import annotations

import functools
import time
from abc import ABC, abstractmethod

import numpy as np
import pyarrow as pa
from datasets import Dataset, IterableDataset

from .blocks import DROP, Block, BlockStats, shard
from .lsh import (
    _Signatures,
    format_s_curve,
    lsh_params,
    near_duplicate_roots,
    s_curve_table,
)
from .minhash import (
    _join,
    _signatures_of_words,
    content_hashes,
    first_occurrences,
    split_words,
)
from .workers import children_die_with_parent

EXACT = "exact_duplicate"
NEAR = "near_duplicate"
REASONS = ("", EXACT, NEAR)  # by code: 0 keeps the row
ROW = "_dedup_row"
HASH = "_dedup_hash"  # 16 bytes of xxh3-128 as two uint64
SIG = "_dedup_minhash"


def _hash_batch(texts: pa.ChunkedArray, normalise: bool) -> pa.Table:
    return _hash_table(content_hashes(texts, normalise))


def _hash_table(hashes: np.ndarray) -> pa.Table:
    return pa.table({HASH: pa.FixedSizeListArray.from_arrays(pa.array(hashes.reshape(-1)), 2)})


def _minhash_batch(texts: pa.ChunkedArray, num_perm: int, shingle_size: int, seed: int) -> pa.Table:
    words = split_words(texts)
    hashes = content_hashes(_join(words), normalise=False)
    signatures = _signatures_of_words(words, num_perm, shingle_size, seed)
    table = _hash_table(hashes)
    return table.append_column(SIG, pa.FixedSizeListArray.from_arrays(pa.array(signatures.reshape(-1)), num_perm))


def _fixed_list_numpy(column: pa.ChunkedArray) -> np.ndarray:
    return np.concatenate([np.zeros((0, column.type.list_size), np.uint64), *_Signatures(column).blocks()])


class _GlobalDedup(Block, ABC):
    """A block that decides every row's reason from one pass over all the data, then marks rows by index."""

    def __init__(self, text_column: str = "text"):
        super().__init__()
        self.text_column = text_column
        self.codes = np.zeros(0, np.int8)  # per row of the last run's data: index into REASONS
        self.roots = np.zeros(0, np.int64)  # per row: the row kept for its cluster (itself if kept)

    @abstractmethod
    def first_pass(self, data: Dataset, num_proc: int | None) -> dict:
        """Set `self.codes` and `self.roots` for `data`; returns counters for `stats.extra`."""

    def process(self, batch: dict[str, list]) -> dict[str, list]:
        out = {name: values for name, values in batch.items() if name != ROW}
        out[DROP] = [REASONS[code] for code in self.codes[np.asarray(batch[ROW], np.int64)]]
        return out

    @children_die_with_parent()
    def run(
        self, data: Dataset | IterableDataset, rank: int = 0, world_size: int = 1, num_proc: int | None = None
    ) -> Dataset:
        """This rank's shard of the globally deduplicated `data`; counters in `self.stats` (see the module docstring)."""
        if isinstance(data, IterableDataset):
            raise ValueError(
                f"{self.name} needs a materialised datasets.Dataset (two passes over rows it can index), not a "
                "streaming IterableDataset: load the data without streaming=True, or write the previous step to "
                "disk (save_to_disk / Dataset.from_generator) and load that."
            )
        if self.text_column not in data.column_names:
            raise ValueError(
                f"{self.name}: text_column={self.text_column!r} is not in the data; columns are {data.column_names}."
            )
        start = time.perf_counter()
        self.stats = BlockStats(self.name)
        extra = self.first_pass(data, num_proc)
        if len(data) == 0:  # nothing to mark (and Block.run's map would not create its helper columns)
            kept = shard(data, rank, world_size)
        else:
            kept = super().run(data.add_column(ROW, np.arange(len(data), dtype=np.int64)), rank, world_size, num_proc)
        self.stats.extra.update(extra)
        self.stats.seconds = time.perf_counter() - start
        return kept

    def _map_first_pass(self, data: Dataset, function, num_proc: int | None) -> pa.Table:
        if len(data) == 0:  # map would not call the function, so the columns would be missing
            return function(pa.chunked_array([], pa.large_string()))
        mapped = data.with_format("arrow").map(
            function,
            batched=True,
            batch_size=self.batch_size,
            num_proc=num_proc,
            input_columns=[self.text_column],
            remove_columns=data.column_names,
            desc=f"{self.name} first pass",
        )
        return mapped.data.table  # fresh from map: no indices mapping, so the Arrow rows are the rows

    def _exact(self, hashes: pa.ChunkedArray) -> np.ndarray:
        first = first_occurrences(_fixed_list_numpy(hashes))
        self.codes = np.where(first == np.arange(len(first)), 0, REASONS.index(EXACT)).astype(np.int8)
        self.roots = first
        return first


class ExactDedup(_GlobalDedup):
    """Drop documents whose (normalised) text was seen earlier in the data: reason `"exact_duplicate"`.

    `normalise=True` compares texts lower-cased with whitespace collapsed; the first occurrence is kept.
    """

    name = "exact_dedup"

    def __init__(self, text_column: str = "text", normalise: bool = True):
        super().__init__(text_column)
        self.normalise = normalise

    def first_pass(self, data: Dataset, num_proc: int | None) -> dict:
        table = self._map_first_pass(data, functools.partial(_hash_batch, normalise=self.normalise), num_proc)
        first = self._exact(table.column(HASH))
        return {"exact_duplicates": int((first != np.arange(len(first))).sum())}


class MinHashDedup(_GlobalDedup):
    """Exact duplicates, then near duplicates (MinHash LSH, Jaccard >= `threshold` on word shingles) out.

    Knobs: `threshold` (Jaccard similarity of the shingle sets), `num_perm` (signature length),
    `shingle_size` (words a shingle), `seed`, `verify` (link a candidate pair only if its estimated
    Jaccard >= threshold), `bands`/`rows` (default: `lsh_params(threshold, num_perm)`), `bucket_window`
    (pairs per bucket member), `verbose` (print the S-curve at each run). Drop reasons:
    `"exact_duplicate"`, `"near_duplicate"`. `stats.extra`: exact_duplicates, near_duplicates,
    clusters (near-duplicate clusters with more than one member, after exact dedup), candidate_pairs,
    verified_pairs, bands, rows, num_perm, threshold, false_positive_area, false_negative_area.
    After a run, `roots[i]` is the row kept for row i (i itself if kept) and `codes[i]` indexes REASONS.
    """

    name = "minhash_dedup"

    def __init__(
        self,
        text_column: str = "text",
        threshold: float = 0.8,
        num_perm: int = 128,
        shingle_size: int = 5,
        seed: int = 1,
        verify: bool = True,
        bands: int | None = None,
        rows: int | None = None,
        bucket_window: int = 64,
        verbose: bool = True,
    ):
        super().__init__(text_column)
        if not 0.0 < threshold < 1.0 or shingle_size < 1 or bucket_window < 1:
            raise ValueError(
                f"threshold={threshold} must be in (0, 1); shingle_size={shingle_size} and "
                f"bucket_window={bucket_window} must be >= 1."
            )
        if (bands is None) != (rows is None):
            raise ValueError(f"bands={bands} and rows={rows}: give both or neither.")
        if bands is None:
            bands, rows = lsh_params(threshold, num_perm)
        if bands * rows > num_perm:
            raise ValueError(f"bands * rows = {bands * rows} exceeds num_perm={num_perm}.")
        self.threshold = threshold
        self.num_perm = num_perm
        self.shingle_size = shingle_size
        self.seed = seed
        self.verify = verify
        self.bands = bands
        self.rows = rows
        self.bucket_window = bucket_window
        self.verbose = verbose

    def first_pass(self, data: Dataset, num_proc: int | None) -> dict:
        function = functools.partial(
            _minhash_batch, num_perm=self.num_perm, shingle_size=self.shingle_size, seed=self.seed
        )
        table = self._map_first_pass(data, function, num_proc)
        first = self._exact(table.column(HASH))
        unique = np.flatnonzero(first == np.arange(len(first)))
        roots, counters = near_duplicate_roots(
            table.column(SIG),
            threshold=self.threshold,
            bands=self.bands,
            rows=self.rows,
            verify=self.verify,
            bucket_window=self.bucket_window,
            subset=unique,
        )
        self.codes[unique[roots != unique]] = REASONS.index(NEAR)
        self.roots[unique] = roots
        self.roots = self.roots[self.roots]  # an exact copy of a near duplicate points at the kept row
        curve = s_curve_table(self.threshold, self.num_perm, self.bands, self.rows)
        if self.verbose:
            print(f"{self.name}: {format_s_curve(curve)}")
        return {
            "exact_duplicates": int(len(first) - len(unique)),
            **counters,
            "bands": self.bands,
            "rows": self.rows,
            "num_perm": self.num_perm,
            "threshold": self.threshold,
            "false_positive_area": curve["false_positive_area"],
            "false_negative_area": curve["false_negative_area"],
        }
