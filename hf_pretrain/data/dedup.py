"""Duplicate removal as data blocks: `ExactDedup` (content hash) and `MinHashDedup` (exact, then MinHash LSH).

Dedup is global: a document is a duplicate of another anywhere in the data, so unlike the other
blocks these need a first pass over all of it before any row can be marked. `run()` does:

1. a first `Dataset.map(batched=True, num_proc=num_proc)` over the Arrow batches computing, per
   document, a 128-bit content hash of the normalised text (lower-cased, whitespace collapsed)
   and, for `MinHashDedup`, its MinHash signature;
2. in the main process: the first occurrence of each content hash is kept (`"exact_duplicate"`
   for the others), then LSH banding over the survivors' signatures, candidate pairs from bands
   sharing a bucket, an optional check of each pair by its estimated Jaccard similarity, and
   union-find clustering keeping the lowest row index of each cluster (`"near_duplicate"` for
   the others);
3. the base class's `run()` with a `process` that looks each row's reason up by its row index
   (carried in a helper column), so counting, sharding and filtering are the usual ones.

Everything is a function of the data alone: the same input gives the same output whatever
`num_proc` or the batch size (signatures are per document, clusters do not depend on the order
edges are found in, and the representative is the lowest index). With `world_size > 1` every rank
computes the same global result and keeps the surviving rows of its own shard, so the union over
ranks is the globally deduplicated data; `stats.dropped` counts this rank's shard, `stats.extra`
the whole data (every rank repeats the first pass: the price of not communicating).

MinHash: shingles are word `shingle_size`-grams (default 5) of the lower-cased text split on Unicode
whitespace (Arrow's `utf8_lower` / `utf8_split_whitespace`); a document with fewer words than
`shingle_size` is one shingle of all its words. Each distinct word of a batch is hashed once
(xxh3-64), a shingle's hash is a fixed random linear combination of its words' hashes, mixed
(splitmix64 finaliser) down to 32 bits; then all `num_perm` permutations are `(a * h + b) mod p`
with `p = 2**31 - 1` on numpy blocks of (shingles x permutations), reduced exactly mod the Mersenne
prime with shifts and masks, and the minimum over each document's slice of rows. No Python loop
over permutations or shingles; per document, Python only hashes the text and takes that minimum.

LSH: `lsh_params` picks (bands, rows), bands * rows <= num_perm, minimising the weighted areas
under the S-curve `P(candidate | s) = 1 - (1 - s**rows)**bands` below the threshold (false
positives) and above it (false negatives). The default weights (0.1, 0.9) favour recall because
`verify=True` removes false candidates afterwards (a pair is linked only if the fraction of equal
signature entries is >= threshold): 0.8 with 128 permutations gives 14 bands x 9 rows, P = 0.999
at J = 0.9 and 0.027 at J = 0.5. Trade-off: the estimate of J has a standard deviation of
sqrt(J(1-J)/num_perm) (0.03 at 0.85 with 128), so a pair at the threshold is linked about half of
the time and one 0.05 above it about 94% of the time, whatever the banding; raise `num_perm` to
sharpen the cut (and `verify=False` links every candidate: more recall, less precision). Within a
bucket every member is compared with its `bucket_window` predecessors (all pairs in buckets up to
that size), which bounds the work on huge buckets while still chaining their members together.

Memory: the first pass stores the signatures (4 * num_perm bytes a document) next to the data
(in the datasets cache for data on disk); the main process holds 8 bytes per band per document
of band keys and reads only the signatures of candidate pairs.

Streaming: a streaming `IterableDataset` is refused with a ValueError (dedup needs two passes over
data it can index by row): load the data without `streaming=True`, or write the previous step to
disk (`save_to_disk`, `Dataset.from_generator`) and load that.

Why by hand: datasketch's `MinHash` is built one document at a time in Python (SHA-1 per shingle,
one numpy call set per document) and `MinHashLSH` is a dict of Python lists; text-dedup and
datatrove run their own executors and document types rather than `datasets`, which the rest of
this package (packing, the Trainer) reads. `benchmarks/dedup.py` compares against datasketch.
"""

from __future__ import annotations

import functools
import time
from abc import abstractmethod
from collections.abc import Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import xxhash
from datasets import Dataset, IterableDataset

from .blocks import DROP, Block, BlockStats, shard
from .workers import children_die_with_parent

EXACT = "exact_duplicate"
NEAR = "near_duplicate"
REASONS = ("", EXACT, NEAR)  # by code: 0 keeps the row
ROW = "_dedup_row"
HASH = "_dedup_hash"  # 16 bytes of xxh3-128 as two uint64
SIG = "_dedup_minhash"
SIMILARITIES = (0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95)

PRIME = (1 << 31) - 1  # Mersenne prime: signature values are < PRIME and fit uint32
EMPTY = np.uint32(0xFFFFFFFF)  # signature of a document without shingles (never a real value)
_P = np.uint64(PRIME)
_S31 = np.uint64(31)
_BLOCK = 512  # shingles per numpy block: (512, num_perm) uint64 stays in cache
_PAIRS_BLOCK = 1 << 16  # candidate pairs verified at a time


# ---- hashing -------------------------------------------------------------------------------------


def _mix64(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser on a uint64 array (wrapping arithmetic)."""
    x = x ^ (x >> np.uint64(30))
    x = x * np.uint64(0xBF58476D1CE4E5B9)
    x = x ^ (x >> np.uint64(27))
    x = x * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def _odd_constants(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng([seed, 0x5EED]).integers(0, 1 << 63, n, dtype=np.uint64) * np.uint64(2) + np.uint64(1)


def _as_array(texts: Sequence[str | None] | pa.Array | pa.ChunkedArray) -> pa.Array:
    if isinstance(texts, pa.ChunkedArray):
        texts = texts.combine_chunks() if texts.num_chunks else pa.array([], pa.large_string())
    elif not isinstance(texts, pa.Array):
        texts = pa.array(list(texts), pa.large_string())
    return texts.cast(pa.large_string())


def split_words(texts: Sequence[str | None] | pa.Array | pa.ChunkedArray) -> pa.ListArray:
    """Each text lower-cased and split on Unicode whitespace (a blank or missing text is one empty word)."""
    texts = pc.fill_null(_as_array(texts), "")
    return pc.utf8_split_whitespace(pc.utf8_lower(pc.utf8_trim_whitespace(texts)))


def _join(words: pa.ListArray) -> pa.Array:
    return pc.binary_join(words, pa.scalar(" ", words.type.value_type))


def _word_hashes(words: pa.ListArray) -> tuple[np.ndarray, np.ndarray]:
    """(xxh3-64 of every word, offsets [n + 1] of each document's words): each distinct word hashed once."""
    offsets = words.offsets.to_numpy().astype(np.int64)
    if len(words) == 0:
        return np.zeros(0, np.uint64), np.zeros(1, np.int64)
    flat = words.flatten()
    encoded = pc.dictionary_encode(flat)
    distinct = encoded.dictionary.cast(pa.large_binary()).to_pylist()
    table = np.fromiter(map(xxhash.xxh3_64_intdigest, distinct), np.uint64, len(distinct))
    indices = encoded.indices.to_numpy(zero_copy_only=False)
    return table[indices] if len(indices) else np.zeros(0, np.uint64), offsets - offsets[0]


def content_hashes(texts: Sequence[str | None] | pa.Array | pa.ChunkedArray, normalise: bool = True) -> np.ndarray:
    """xxh3-128 of each text as [n, 2] uint64; `normalise` lower-cases and collapses whitespace first."""
    if normalise:
        texts = _join(split_words(texts))
    values = pc.fill_null(_as_array(texts), "").cast(pa.large_binary()).to_pylist()
    digests = b"".join(map(xxhash.xxh3_128_digest, values))
    return np.frombuffer(digests, np.uint64).reshape(len(values), 2)


def shingle_hashes(
    word_hashes: np.ndarray, offsets: np.ndarray, shingle_size: int, seed: int
) -> tuple[np.ndarray, np.ndarray]:
    """32-bit hashes of every word `shingle_size`-gram (a shorter document: one shingle of all its words).

    Returns (hashes uint64 [S], document index int64 [S]), sorted by document.
    """
    lengths = np.diff(offsets)
    doc = np.repeat(np.arange(len(lengths)), lengths)
    position = np.arange(len(word_hashes))
    remaining = offsets[1:][doc] - position  # words from here to the end of the document
    starts = position[(remaining >= shingle_size) | ((position == offsets[:-1][doc]) & (remaining < shingle_size))]
    width = np.minimum(remaining[starts], shingle_size)
    coefficients = _odd_constants(shingle_size, seed)
    combined = np.zeros(len(starts), np.uint64)
    for j in range(shingle_size):  # shingle_size vector operations
        inside = width > j
        combined[inside] += word_hashes[starts[inside] + j] * coefficients[j]
    return _mix64(combined) >> np.uint64(32), doc[starts]


# ---- MinHash -------------------------------------------------------------------------------------


def permutations(num_perm: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """The (a, b) of the `num_perm` hash functions `(a * h + b) mod PRIME`, a in [1, PRIME), b in [0, PRIME)."""
    rng = np.random.default_rng(seed)
    return rng.integers(1, PRIME, num_perm, dtype=np.uint64), rng.integers(0, PRIME, num_perm, dtype=np.uint64)


def _permute(h: np.ndarray, a: np.ndarray, b: np.ndarray, out: np.ndarray, tmp: np.ndarray) -> np.ndarray:
    """(a * h + b) mod PRIME for every (shingle, permutation), exactly, in `out` (h < 2**32 so a * h + b < 2**63)."""
    np.multiply.outer(h, a, out=out)
    out += b
    for _ in range(2):  # x == (x & p) + (x >> 31) mod p (2**31 == 1 mod p); twice: < 2 * PRIME
        np.right_shift(out, _S31, out=tmp)
        out &= _P
        out += tmp
    np.subtract(out, _P, out=tmp)  # where out < PRIME this wraps past 2**64 - PRIME: the minimum keeps out
    return np.minimum(out, tmp, out=out)


def _min_per_document(h: np.ndarray, doc: np.ndarray, n: int, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Per document, the minimum over its shingles of every permutation: blocks of shingles, a slice per document."""
    signatures = np.full((n, len(a)), EMPTY, np.uint64)
    bounds = np.searchsorted(doc, np.arange(n + 1))  # document d's shingles: h[bounds[d]:bounds[d + 1]]
    out = np.empty((_BLOCK, len(a)), np.uint64)
    tmp = np.empty_like(out)
    for start in range(0, len(h), _BLOCK):
        stop = min(start + _BLOCK, len(h))
        values = _permute(h[start:stop], a, b, out[: stop - start], tmp[: stop - start])
        for d in range(doc[start], doc[stop - 1] + 1):
            first, last = max(bounds[d], start) - start, min(bounds[d + 1], stop) - start
            if last > first:
                np.minimum(signatures[d], values[first:last].min(axis=0), out=signatures[d])
    return signatures.astype(np.uint32)


def minhash_signatures(
    texts: Sequence[str | None] | pa.Array | pa.ChunkedArray, num_perm: int = 128, shingle_size: int = 5, seed: int = 1
) -> np.ndarray:
    """MinHash signatures [n, num_perm] uint32 of word `shingle_size`-gram shingles (see the module docstring)."""
    words = split_words(texts)
    return _signatures_of_words(words, num_perm, shingle_size, seed)


def _signatures_of_words(words: pa.ListArray, num_perm: int, shingle_size: int, seed: int) -> np.ndarray:
    word_hashes, offsets = _word_hashes(words)
    h, doc = shingle_hashes(word_hashes, offsets, shingle_size, seed)
    a, b = permutations(num_perm, seed)
    return _min_per_document(h, doc, len(words), a, b)


# ---- LSH parameters ------------------------------------------------------------------------------


def candidate_probability(similarity: float | np.ndarray, bands: int, rows: int) -> float | np.ndarray:
    """The S-curve: probability that a pair of Jaccard `similarity` shares at least one band."""
    return 1.0 - (1.0 - np.asarray(similarity, np.float64) ** rows) ** bands


def _area(y: np.ndarray, x: np.ndarray) -> np.ndarray:
    return ((y[..., 1:] + y[..., :-1]) * np.diff(x) / 2).sum(axis=-1)


def _error_areas(threshold: float, bands: np.ndarray, rows: np.ndarray, points: int = 1001):
    """(false-positive area below the threshold, false-negative area above it) for each (bands, rows)."""
    below, above = np.linspace(0.0, threshold, points), np.linspace(threshold, 1.0, points)
    b, r = np.asarray(bands)[..., None], np.asarray(rows)[..., None]
    return _area(candidate_probability(below, b, r), below), _area(1.0 - candidate_probability(above, b, r), above)


def lsh_params(
    threshold: float = 0.8, num_perm: int = 128, false_positive_weight: float = 0.1, false_negative_weight: float = 0.9
) -> tuple[int, int]:
    """(bands, rows), bands * rows <= num_perm, minimising the weighted false-positive + false-negative areas."""
    if not 0.0 < threshold < 1.0:
        raise ValueError(f"threshold={threshold} must be in (0, 1).")
    if num_perm < 1:
        raise ValueError(f"num_perm={num_perm} must be >= 1.")
    pairs = np.array([(b, r) for b in range(1, num_perm + 1) for r in range(1, num_perm // b + 1)])
    fp, fn = _error_areas(threshold, pairs[:, 0], pairs[:, 1])
    best = int(np.argmin(false_positive_weight * fp + false_negative_weight * fn))  # ties: fewest bands
    return int(pairs[best, 0]), int(pairs[best, 1])


def s_curve_table(
    threshold: float = 0.8,
    num_perm: int = 128,
    bands: int | None = None,
    rows: int | None = None,
    similarities: Sequence[float] = SIMILARITIES,
) -> dict:
    """P(candidate) at each Jaccard similarity and the integrated error areas; (bands, rows) from `lsh_params` if None."""
    if bands is None or rows is None:
        bands, rows = lsh_params(threshold, num_perm)
    fp, fn = _error_areas(threshold, np.array(bands), np.array(rows))
    return {
        "threshold": threshold,
        "num_perm": num_perm,
        "bands": bands,
        "rows": rows,
        "candidate_probability": {s: float(candidate_probability(s, bands, rows)) for s in similarities},
        "false_positive_area": float(fp),
        "false_negative_area": float(fn),
    }


def format_s_curve(table: dict) -> str:
    probabilities = table["candidate_probability"]
    return "\n".join(
        [
            f"LSH {table['bands']} bands x {table['rows']} rows of {table['num_perm']} permutations, "
            f"threshold {table['threshold']}: false-positive area {table['false_positive_area']:.4f}, "
            f"false-negative area {table['false_negative_area']:.4f}",
            "  Jaccard      " + " ".join(f"{s:>6.2f}" for s in probabilities),
            "  P(candidate) " + " ".join(f"{p:>6.3f}" for p in probabilities.values()),
        ]
    )


# ---- candidates and clusters ---------------------------------------------------------------------


def band_keys(signatures: np.ndarray, bands: int, rows: int, seed: int = 1) -> np.ndarray:
    """A 64-bit key [n, bands] per band of `rows` signature entries (equal bands, equal keys)."""
    used = signatures[:, : bands * rows].astype(np.uint64).reshape(len(signatures), bands, rows)
    return _mix64((used * _odd_constants(rows, seed)).sum(axis=2, dtype=np.uint64))


def candidate_pairs(keys: np.ndarray, bucket_window: int = 64) -> np.ndarray:
    """Distinct pairs (i < j) [m, 2] sharing a band key; each bucket member pairs with its `bucket_window` predecessors."""
    found = []
    for band in keys.T:
        order = np.argsort(band, kind="stable")  # equal keys stay in index order, so i < j below
        ordered = band[order]
        for gap in range(1, min(bucket_window, len(band) - 1) + 1):
            same = ordered[gap:] == ordered[:-gap]
            if not same.any():
                break
            found.append(np.stack([order[:-gap][same], order[gap:][same]], axis=1))
    if not found:
        return np.zeros((0, 2), np.int64)
    codes = np.unique(np.concatenate(found).astype(np.int64) @ np.array([len(keys), 1], np.int64))
    return np.stack([codes // len(keys), codes % len(keys)], axis=1)


def estimated_jaccard(left: np.ndarray, right: np.ndarray) -> np.ndarray:
    """Fraction of equal entries of paired signature rows: the MinHash estimate of their Jaccard similarity."""
    return (left == right).mean(axis=1)


def union_find_roots(n: int, pairs: np.ndarray) -> np.ndarray:
    """The lowest index of each item's connected component under `pairs`."""
    parent = list(range(n))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    for i, j in pairs.tolist():
        ri, rj = find(i), find(j)
        if ri != rj:
            parent[max(ri, rj)] = min(ri, rj)
    return np.array([find(i) for i in range(n)], np.int64)


class _Signatures:
    """Signature rows from a numpy array or an Arrow fixed-size-list column, read by blocks or by index."""

    def __init__(self, source: np.ndarray | pa.ChunkedArray):
        self.source = source

    def __len__(self) -> int:
        return len(self.source)

    @property
    def width(self) -> int:
        return self.source.shape[1] if isinstance(self.source, np.ndarray) else self.source.type.list_size

    def blocks(self) -> Iterator[np.ndarray]:
        if isinstance(self.source, np.ndarray):
            yield self.source
            return
        for chunk in self.source.chunks:
            yield self._to_numpy(chunk)

    def take(self, indices: np.ndarray) -> np.ndarray:
        if isinstance(self.source, np.ndarray):
            return self.source[indices]
        return self._to_numpy(self.source.take(pa.array(indices, pa.int64())).combine_chunks())

    @staticmethod
    def _to_numpy(chunk: pa.FixedSizeListArray) -> np.ndarray:
        values = chunk.flatten().to_numpy(zero_copy_only=False)
        return values.reshape(len(chunk), chunk.type.list_size)


def _verified(sig: _Signatures, pairs: np.ndarray, threshold: float) -> np.ndarray:
    """Which pairs of rows have an estimated Jaccard similarity >= threshold (signatures read a block at a time)."""
    keep = [
        estimated_jaccard(sig.take(block[:, 0]), sig.take(block[:, 1])) >= threshold
        for block in np.array_split(pairs, max(1, -(-len(pairs) // _PAIRS_BLOCK)))
    ]
    return np.concatenate(keep) if len(pairs) else np.zeros(0, bool)


def near_duplicate_roots(
    signatures: np.ndarray | pa.ChunkedArray,
    threshold: float = 0.8,
    bands: int | None = None,
    rows: int | None = None,
    verify: bool = True,
    bucket_window: int = 64,
    subset: np.ndarray | None = None,
) -> tuple[np.ndarray, dict]:
    """Cluster the rows `subset` (default: all) of `signatures`; returns (root per member of subset, counters).

    A root is the lowest row number (of `signatures`) in the member's cluster; counters: candidate_pairs,
    verified_pairs (linked), clusters (with more than one member), near_duplicates (members that are not roots).
    """
    sig = _Signatures(signatures)
    members = np.arange(len(sig)) if subset is None else np.asarray(subset, np.int64)
    if np.any(members[1:] <= members[:-1]):
        raise ValueError("subset must hold distinct row numbers in increasing order.")
    if bands is None or rows is None:
        bands, rows = lsh_params(threshold, sig.width)
    keys = np.concatenate([band_keys(block, bands, rows) for block in sig.blocks()] or [np.zeros((0, bands))])
    pairs = candidate_pairs(keys[members], bucket_window)  # positions in members
    linked = pairs[_verified(sig, members[pairs], threshold)] if verify else pairs
    local_roots = union_find_roots(len(members), linked)
    sizes = np.bincount(local_roots, minlength=len(members))
    counters = {
        "candidate_pairs": int(len(pairs)),
        "verified_pairs": int(len(linked)),
        "clusters": int((sizes > 1).sum()),
        "near_duplicates": int((local_roots != np.arange(len(members))).sum()),
    }
    return members[local_roots], counters


def first_occurrences(hashes: np.ndarray) -> np.ndarray:
    """For each row of [n, 2] content hashes, the index of the first row with the same hash."""
    order = np.lexsort((hashes[:, 1], hashes[:, 0]))  # stable: equal hashes in index order
    ordered = hashes[order]
    new = np.ones(len(hashes), bool)  # the first row of each group of equal hashes
    new[1:] = (ordered[1:] != ordered[:-1]).any(axis=1)
    group_first = order[np.flatnonzero(new)][np.cumsum(new) - 1]
    first = np.empty(len(hashes), np.int64)
    first[order] = group_first
    return first


# ---- the blocks ----------------------------------------------------------------------------------


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


class _GlobalDedup(Block):
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
