"""Locality-sensitive hashing over MinHash signatures: banding, candidate pairs, clusters.

`lsh_params` picks (bands, rows), bands * rows <= num_perm, minimising the weighted areas under
the S-curve `P(candidate | s) = 1 - (1 - s**rows)**bands` below the threshold (false positives)
and above it (false negatives). The default weights (0.1, 0.9) favour recall because `verify=True`
removes false candidates afterwards (a pair is linked only if the fraction of equal signature
entries is >= threshold): 0.8 with 128 permutations gives 14 bands x 9 rows, P = 0.999 at J = 0.9
and 0.027 at J = 0.5. Trade-off: the estimate of J has a standard deviation of sqrt(J(1-J)/num_perm)
(0.03 at 0.85 with 128), so a pair at the threshold is linked about half of the time and one 0.05
above it about 94% of the time, whatever the banding; raise `num_perm` to sharpen the cut (and
`verify=False` links every candidate: more recall, less precision). Within a bucket every member
is compared with its `bucket_window` predecessors (all pairs in buckets up to that size), which
bounds the work on huge buckets while still chaining their members together.

Clusters are the connected components of the linked pairs (union-find); each keeps its lowest row
index, so the result depends neither on the order edges are found in nor on batch sizes. The one
driver that puts these together over sharded files is `chain/dedup_shards.py`.

Why by hand: datasketch's `MinHashLSH` is a dict of Python lists.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .minhash import _mix64, _odd_constants

SIMILARITIES = (0.5, 0.6, 0.7, 0.75, 0.8, 0.85, 0.9, 0.95)

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
    """The lowest index of each item's connected component under `pairs` [m, 2], in numpy (no Python loop per pair).

    Rounds of hooking and pointer jumping: every pair whose two roots differ hooks the higher root under the lower
    (`np.minimum.at`), then every item's label jumps to its root's until stable. A label never rises above the item,
    so the lowest item of a component stays its root; each round at least halves the roots still to merge of every
    component, so a few rounds (log2 of the largest component) suffice. Memory: the labels and the pairs."""
    labels = np.arange(n, dtype=np.int64)
    left, right = np.asarray(pairs, np.int64).reshape(-1, 2).T if len(pairs) else (labels[:0], labels[:0])
    while True:
        low, high = labels[left], labels[right]
        apart = low != high
        if not apart.any():
            return labels
        left, right, low, high = left[apart], right[apart], low[apart], high[apart]
        np.minimum.at(labels, np.maximum(low, high), np.minimum(low, high))
        while True:
            jumped = labels[labels]
            if np.array_equal(jumped, labels):
                break
            labels = jumped
