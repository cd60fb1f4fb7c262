"""MinHash signatures and content hashes of documents, in numpy over Arrow batches.

Shingles are word `shingle_size`-grams (default 5) of the lower-cased text split on Unicode
whitespace (Arrow's `utf8_lower` / `utf8_split_whitespace`); a document with fewer words than
`shingle_size` is one shingle of all its words. Each distinct word of a batch is hashed once
(xxh3-64), a shingle's hash is a fixed random linear combination of its words' hashes, mixed
(splitmix64 finaliser) down to 32 bits; then all `num_perm` permutations are `(a * h + b) mod p`
with `p = 2**31 - 1` on numpy blocks of (shingles x permutations), reduced exactly mod the Mersenne
prime with shifts and masks, and the minimum over each document's slice of rows. No Python loop
over permutations or shingles; per document, Python only hashes the text and takes that minimum.

Content hashes (exact duplicates) are xxh3-128 of the normalised text (lower-cased, whitespace
collapsed).

Why by hand: datasketch's `MinHash` is built one document at a time in Python (SHA-1 per shingle,
one numpy call set per document); `benchmarks/dedup.py` compares against it. The banding and
clustering that use these signatures are in `lsh.py`, the blocks in `dedup.py`.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import xxhash

PRIME = (1 << 31) - 1  # Mersenne prime: signature values are < PRIME and fit uint32
EMPTY = np.uint32(0xFFFFFFFF)  # signature of a document without shingles (never a real value)
_P = np.uint64(PRIME)
_S31 = np.uint64(31)
_BLOCK = 512  # shingles per numpy block: (512, num_perm) uint64 stays in cache

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
