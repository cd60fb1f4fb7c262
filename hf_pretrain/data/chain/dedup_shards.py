"""Global near-dedup in sharded stages: signatures -> buckets -> clusters -> verdicts, each task reading and writing files.

The verdicts of the one dedup driver (`dedup.py`) over the concatenation of the shards (shard 0's rows, then shard
1's, ...), whatever their number, without one process holding every document's band keys:

1. signatures (one task per shard): each document's content hash (`minhash.content_hashes`, exact duplicates) and
   MinHash signature (`minhash.minhash_signatures`), written as `hashes/S.npy`, `signatures/S.npy` and one file per
   band, `bands/BBB/S.npy`: (key, row) sorted by key (`lsh.band_keys`; the content hash's first 64 bits are one more
   band, so exact copies meet like near ones);
2. buckets (a task per band and range of keys, a task taking units `task`, `task + tasks`, ...): the rows of every
   shard whose key is in the range (a binary search in each sorted file), paired with up to `bucket_window`
   predecessors of equal key (`lsh.candidate_pairs`), ids global (shard offset + row); the task's pairs made
   distinct and sorted (first id, second id), saved column-major so that the first ids are one contiguous column of
   the memory-mapped file: `pairs/T.npy`;
3. clusters (one task): the pairs read in blocks of first ids (`pair_blocks`: a binary search in each file's first
   column, the same pair from two bands or two tasks counted once), each block's pairs linked when the content
   hashes are equal (exact) or, with `verify`, when the signatures' estimated Jaccard is >= threshold (signatures
   read for `_PAIRS_BLOCK` pairs at a time), and merged into the clusters found so far (`Forest`: every linked
   document and the lowest global id of its cluster, `lsh.union_find_roots` over the old forest and the new links),
   so the lowest global id of each cluster is kept: `verdicts/S.npy` per
   shard, (row, reason code, global id of the copy kept), and the counters;
4. the shard's task drops its listed rows with their reasons (`stages.py`, through the dedup blocks' own marking).

Memory: a signatures task holds its shard's batch; a buckets task the keys and pairs of its range (12 bytes a
document of 1/ranges of the corpus: more tasks, less each); the clusters task O(linked duplicate documents): the
forest (16 bytes per document linked to another), one block of pairs (at most `_CLUSTER_PAIRS` or the forest's size,
whichever is larger, bar one first id's pairs) and the sampled first ids (8 bytes per `_SAMPLE_STEP` pairs), never
every pair at once. Not bounded by a shard: a corpus with more duplicates has more to cluster (as datatrove's
MinhashDedupCluster). Why not datatrove's four steps: they read datatrove `Document`s, hash with their own shingles
and emit unverified pairs (precision below ours, see docs/data.md); these stages keep our signatures and the
verification.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ..dedup import EXACT, NEAR, REASONS, DedupConfig
from ..lsh import band_keys, candidate_pairs, estimated_jaccard, union_find_roots
from ..minhash import content_hashes, minhash_signatures

BAND = np.dtype([("key", "<u8"), ("row", "<u4")])
VERDICT = np.dtype([("row", "<u4"), ("code", "i1"), ("kept", "<i8")])  # code: dedup.REASONS; kept: the global id kept
_PAIRS_BLOCK = 1 << 16  # pairs whose signatures are read at once (2 x 64 K x 128 x 4 bytes: 64 MB)
_CLUSTER_PAIRS = 1 << 22  # pairs of a clusters block (at least; 16 bytes each) when the forest is smaller
_SAMPLE_STEP = 1024  # every how many pairs of a file a first id is sampled to cut the blocks


def save_array(path: Path, array: np.ndarray) -> None:
    """`np.save` into a temporary file renamed into place: a killed task never leaves a half-written array."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        np.save(f, array)
    os.replace(tmp, path)


def load_array(path: Path, mmap: bool = False) -> np.ndarray:
    """An array a stage wrote; a missing or damaged one is an error naming the file and the fix."""
    try:
        return np.load(path, mmap_mode="r" if mmap else None)
    except (OSError, ValueError, EOFError) as err:
        raise ValueError(
            f"{path} cannot be read ({err}); its stage did not complete: relaunch `hf-pretrain data prepare`."
        ) from None


def write_signatures(folder: Path, shard: int, texts, settings: DedupConfig, batch_size: int = 10_000) -> int:
    """Stage 1 for one shard: hashes, signatures and the sorted band files of `texts` (an Arrow column)."""
    hashes, signatures = [], []
    for start in range(0, len(texts), batch_size):
        batch = texts.slice(start, batch_size)
        hashes.append(content_hashes(batch, normalise=True))
        if settings.minhash:
            signatures.append(minhash_signatures(batch, settings.num_perm, settings.shingle_size, settings.seed))
    hashes = np.concatenate(hashes) if hashes else np.zeros((0, 2), np.uint64)
    keys = []
    if settings.minhash:
        signatures = np.concatenate(signatures) if signatures else np.zeros((0, settings.num_perm), np.uint32)
        save_array(folder / "signatures" / f"{shard:05d}.npy", signatures)
        keys = list(band_keys(signatures, settings.bands, settings.rows).T)
    keys.append(hashes[:, 0])
    save_array(folder / "hashes" / f"{shard:05d}.npy", hashes)
    for band, band_key in enumerate(keys):
        table = np.empty(len(band_key), BAND)
        table["key"], table["row"] = band_key, np.arange(len(band_key), dtype=np.uint32)
        table.sort(order=["key", "row"])
        save_array(folder / "bands" / f"{band:03d}" / f"{shard:05d}.npy", table)
    return len(hashes)


def bucket_units(settings: DedupConfig, tasks: int) -> tuple[int, int]:
    """(key ranges per band, units = bands x ranges): about one unit per task, so a unit is about a shard's keys."""
    ranges = max(1, -(-tasks // settings.total_bands))
    return ranges, settings.total_bands * ranges


def _key_range(part: int, ranges: int) -> tuple[int, int | None]:
    low = (part << 64) // ranges
    return low, None if part == ranges - 1 else ((part + 1) << 64) // ranges


def unit_pairs(folder: Path, unit: int, ranges: int, offsets: np.ndarray, bucket_window: int) -> np.ndarray:
    """Stage 2 for one unit (band, key range): candidate pairs [m, 2] of global ids, first < second."""
    band, part = divmod(unit, ranges)
    low, high = _key_range(part, ranges)
    keys, ids = [], []
    for shard in range(len(offsets) - 1):
        table = load_array(folder / "bands" / f"{band:03d}" / f"{shard:05d}.npy", mmap=True)
        start = np.searchsorted(table["key"], np.uint64(low))
        stop = len(table) if high is None else np.searchsorted(table["key"], np.uint64(high))
        chunk = np.array(table[start:stop])
        keys.append(chunk["key"])
        ids.append(chunk["row"].astype(np.int64) + offsets[shard])
    keys, ids = np.concatenate(keys), np.concatenate(ids)
    order = np.argsort(ids, kind="stable")  # candidate_pairs pairs equal keys in this (global id) order
    keys, ids = keys[order], ids[order]
    return ids[candidate_pairs(keys[:, None], bucket_window)]


def distinct_pairs(pairs: np.ndarray) -> np.ndarray:
    """The distinct rows of `pairs` [m, 2], sorted by first then second id."""
    if not len(pairs):
        return np.zeros((0, 2), np.int64)
    ordered = pairs[np.lexsort((pairs[:, 1], pairs[:, 0]))]
    new = np.ones(len(ordered), bool)
    new[1:] = (ordered[1:] != ordered[:-1]).any(axis=1)
    return ordered[new]


def task_pairs(folder: Path, task: int, tasks: int, settings: DedupConfig, offsets: np.ndarray) -> np.ndarray:
    """Stage 2 for one task of `tasks`: the distinct candidate pairs of its units (`task`, `task + tasks`, ...)."""
    ranges, units = bucket_units(settings, len(offsets) - 1)
    bucket_window = settings.bucket_window
    found = [unit_pairs(folder, unit, ranges, offsets, bucket_window) for unit in range(task, units, tasks)]
    return distinct_pairs(np.concatenate(found) if found else np.zeros((0, 2), np.int64))


def save_pairs(path: Path, pairs: np.ndarray) -> None:
    """A pairs file, column-major: the first ids of its memory map are one contiguous (binary-searchable) column."""
    save_array(path, np.asfortranarray(pairs))


class ShardArrays:
    """Rows of a per-shard array (`hashes`, `signatures`) by global id, each shard's file memory-mapped only while read."""

    def __init__(self, folder: Path, name: str, offsets: np.ndarray):
        self.folder, self.name, self.offsets = folder / name, name, offsets

    def take(self, ids: np.ndarray) -> np.ndarray:
        shards = np.searchsorted(self.offsets, ids, side="right") - 1
        out = None
        for shard in np.unique(shards):
            where = np.flatnonzero(shards == shard)
            array = load_array(self.folder / f"{shard:05d}.npy", mmap=True)
            values = np.asarray(array[ids[where] - self.offsets[shard]])
            if out is None:
                out = np.empty((len(ids), *values.shape[1:]), values.dtype)
            out[where] = values
            del array
        return out if out is not None else np.zeros((0,), np.uint64)


def pair_blocks(files: list[np.ndarray], documents: int, budget) -> Iterator[np.ndarray]:
    """The distinct pairs of every (sorted) pairs file, a block of consecutive first ids at a time.

    A block holds every pair whose first id is in its range, so a pair found in several files falls in one block
    and is counted once. The ranges are cut at first ids sampled every `_SAMPLE_STEP` pairs of each file, and a
    block takes as many cut cells as fit in `budget()` pairs (at least one)."""
    samples = [np.asarray(f[::_SAMPLE_STEP, 0], np.int64) for f in files]
    cuts = np.unique(np.concatenate([np.array([0, documents], np.int64), *samples]))
    ends = np.zeros(len(cuts) - 1, np.int64)
    for f in files:
        ends += np.diff(np.searchsorted(f[:, 0], cuts))
    ends = np.cumsum(ends)  # pairs with first id < cuts[k + 1]
    start = 0
    while start < len(cuts) - 1:
        before = ends[start - 1] if start else 0
        stop = min(len(cuts) - 1, max(start + 1, int(np.searchsorted(ends, before + budget(), side="right"))))
        low, high = cuts[start], cuts[stop]
        parts = [np.asarray(f[np.searchsorted(f[:, 0], low) : np.searchsorted(f[:, 0], high)]) for f in files]
        yield distinct_pairs(np.concatenate([np.zeros((0, 2), np.int64), *parts]))
        start = stop


def link(pairs: np.ndarray, hashes: ShardArrays, signatures: ShardArrays | None, settings: DedupConfig):
    """(exact, linked) per pair: equal content hashes; linked: exact, or near (estimated Jaccard >= threshold, or
    every candidate without `verify`)."""
    exact = np.zeros(len(pairs), bool)
    linked = np.zeros(len(pairs), bool)
    for start in range(0, len(pairs), _PAIRS_BLOCK):
        block = pairs[start : start + _PAIRS_BLOCK]
        same = (hashes.take(block[:, 0]) == hashes.take(block[:, 1])).all(axis=1)
        near = np.zeros(len(block), bool)
        if signatures is not None:
            if settings.verify:
                near = estimated_jaccard(signatures.take(block[:, 0]), signatures.take(block[:, 1]))
                near = near >= settings.threshold
            else:
                near = np.ones(len(block), bool)
        exact[start : start + len(block)] = same
        linked[start : start + len(block)] = same | near
    return exact, linked


class Forest:
    """The clusters found so far: every linked document (sorted global ids) and the lowest global id of its cluster.

    New links are merged with the old as one graph, the forest's (document, root) edges and the new pairs, so what
    is held is the linked documents, not every pair seen."""

    def __init__(self):
        self.nodes = self.roots = np.zeros(0, np.int64)

    def __len__(self) -> int:
        return len(self.nodes)

    def add(self, edges: np.ndarray) -> None:
        if not len(edges):
            return
        edges = np.concatenate([np.stack([self.nodes, self.roots], axis=1), edges])
        self.nodes = np.unique(edges)
        self.roots = self.nodes[union_find_roots(len(self.nodes), np.searchsorted(self.nodes, edges))]


def cluster(folder: Path, pairs_files: list[Path], offsets: np.ndarray, settings: DedupConfig, verdicts: Path) -> dict:
    """Stage 3: link the candidate pairs (`folder` holds the signatures) block by block, cluster, write each shard's
    verdicts into `verdicts`; returns the counters."""
    files = [load_array(p, mmap=True) for p in pairs_files]
    hashes = ShardArrays(folder, "hashes", offsets)
    signatures = ShardArrays(folder, "signatures", offsets) if settings.minhash else None
    forest, copies, candidates, verified = Forest(), [np.zeros(0, np.int64)], 0, 0
    for pairs in pair_blocks(files, int(offsets[-1]), lambda: max(_CLUSTER_PAIRS, len(forest))):
        exact, linked = link(pairs, hashes, signatures, settings)
        copies.append(np.unique(pairs[exact][:, 1]))  # a lower document has the same content hash: an exact copy
        candidates += int((~exact).sum())
        verified += int((linked & ~exact).sum())
        forest.add(pairs[linked])
    del files
    nodes, roots, copies = forest.nodes, forest.roots, np.unique(np.concatenate(copies))
    dropped, kept = nodes[roots != nodes], roots[roots != nodes]
    is_exact = np.isin(dropped, copies)
    codes = np.where(is_exact, REASONS.index(EXACT), REASONS.index(NEAR)).astype(np.int8)
    unique_members = ~np.isin(nodes, copies)
    sizes = np.unique(roots[unique_members], return_counts=True)[1]
    shards = np.searchsorted(offsets, dropped, side="right") - 1
    for shard in range(len(offsets) - 1):
        mine = shards == shard
        table = np.empty(int(mine.sum()), VERDICT)
        table["row"], table["code"], table["kept"] = dropped[mine] - offsets[shard], codes[mine], kept[mine]
        save_array(verdicts / f"{shard:05d}.npy", table)
    return {
        "exact_duplicates": int(is_exact.sum()),
        "near_duplicates": int((~is_exact).sum()),
        "clusters": int((sizes > 1).sum()),
        "candidate_pairs": candidates,
        "verified_pairs": verified,
        "bands": settings.lsh_bands,
        "rows": settings.rows,
        "num_perm": settings.num_perm,
        "threshold": settings.threshold,
    }


def global_roots(folder: Path, offsets: np.ndarray) -> np.ndarray:
    """Per document (global id), the global id of the copy kept of it (itself when it is kept)."""
    roots = np.arange(offsets[-1], dtype=np.int64)
    for shard in range(len(offsets) - 1):
        verdicts = load_array(folder / f"{shard:05d}.npy")
        roots[verdicts["row"].astype(np.int64) + offsets[shard]] = verdicts["kept"]
    return roots


def shard_codes(folder: Path, shard: int, num_rows: int) -> np.ndarray:
    """Per row of the shard: its reason code (0 keeps it), from the clusters stage's verdicts in `folder`."""
    verdicts = load_array(folder / f"{shard:05d}.npy")
    codes = np.zeros(num_rows, np.int8)
    codes[verdicts["row"].astype(np.int64)] = verdicts["code"]
    return codes


def write_json(path: Path, value) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(value, indent=2) + "\n")
    os.replace(tmp, path)


def deduplicate(
    texts: list[str], config: DedupConfig, folder: Path, shards: int = 1
) -> tuple[np.ndarray, np.ndarray, dict]:
    """The four stages in this process over `texts` cut into `shards` contiguous shards, working in `folder`: each
    text's reason code (an index into `dedup.REASONS`), the index of the copy kept of it (itself when kept), and the
    counters. What the chain's tasks compute, for tests, benchmarks and a list of texts in a notebook."""
    import pyarrow as pa

    bounds = np.linspace(0, len(texts), shards + 1).astype(np.int64)
    for shard in range(shards):
        column = pa.chunked_array([pa.array(texts[bounds[shard] : bounds[shard + 1]], pa.large_string())])
        write_signatures(folder, shard, column, config)
    tasks = min(shards, bucket_units(config, shards)[1])  # as the chain's bucket tasks
    for task in range(tasks):
        save_pairs(folder / "pairs" / f"{task:05d}.npy", task_pairs(folder, task, tasks, config, bounds))
    pairs = [folder / "pairs" / f"{task:05d}.npy" for task in range(tasks)]
    counters = cluster(folder, pairs, bounds, config, folder / "verdicts")
    sizes = np.diff(bounds)
    codes = [shard_codes(folder / "verdicts", shard, int(sizes[shard])) for shard in range(shards)]
    return np.concatenate(codes), global_roots(folder / "verdicts", bounds), counters
