"""Near-duplicate removal: hf_pretrain's dedup driver against datasketch's MinHash + MinHashLSH.

Both run on the same corpus: `--docs` documents of words drawn with their frequencies in Python's
own reference text (pydoc topics), a `--copy-fraction` of them planted copies of other documents
edited by replacing words to target Jaccard similarities 1.0 (exact copy), 0.95, 0.9, 0.85, 0.7 and
0.5 on word 5-gram shingle sets, shuffled. Same threshold, num_perm and shingles (lower-cased words
split on whitespace); datasketch with its default LSH weights and, as a second row from the same
signatures, with hf_pretrain's recall-leaning weights (no verification step). Prints docs/s of each,
the throughput ratio ours / datasketch measured in this run, and recall / precision against exact
Jaccard of the shingle sets:

- recall: of the planted pairs with exact J >= threshold, the fraction put in one cluster
  (random pairs of this corpus have J ~ 0: a sample of them is measured and printed);
- precision: of all pairs within the found clusters, the fraction with exact J >= threshold
  (strict), and with J >= threshold - 0.1 (margin).

Timing: ours end to end (`dedup_shards.deduplicate` in this process over `--shards` shards: content
hashes, signatures and band files written, candidate pairs, verification, clusters, each shard's
verdicts); datasketch: a `MinHash` per document, then
`MinHashLSH` insert and query of every document and the same union-find. With `--repeats`, the
runs are interleaved and the fastest of each is kept (useful on a shared machine).

    python benchmarks/dedup.py [--docs 10000] [--threshold 0.8] [--num-perm 128] [--shards 1 4] [--repeats 3]
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np

from hf_pretrain.data.chain.dedup_shards import deduplicate
from hf_pretrain.data.dedup import DedupConfig
from hf_pretrain.data.lsh import format_s_curve, s_curve_table, union_find_roots

LEVELS = (1.0, 0.95, 0.9, 0.85, 0.7, 0.5)  # target Jaccard of planted copies to their source


def vocabulary() -> tuple[np.ndarray, np.ndarray]:
    """Lower-cased words of pydoc's topics and their frequencies (a Zipf-like real distribution)."""
    from pydoc_data.topics import topics

    counts = Counter(w for key in sorted(topics) for w in topics[key].lower().split())
    words = sorted(counts, key=lambda w: (-counts[w], w))
    weights = np.array([counts[w] for w in words], np.float64)
    return np.array(words, dtype=object), weights / weights.sum()


def replacements(length: int, target: float, shingle_size: int) -> int:
    """Words to replace, spaced >= shingle_size apart, for Jaccard ~ target: each kills k shingles, adds k."""
    shingles = max(length - shingle_size + 1, 1)
    return max(round(shingles * (1 - target) / (shingle_size * (1 + target))), 0 if target >= 1 else 1)


def edited_copy(words: list[str], target: float, shingle_size: int, rng, vocab: np.ndarray) -> list[str]:
    copy = list(words)
    m = min(replacements(len(words), target, shingle_size), len(words) // shingle_size)
    if m == 0:
        return copy
    segment = len(words) // m
    for s in range(m):  # one replacement per segment, at least shingle_size from the next one
        i = s * segment + int(rng.integers(0, segment - shingle_size + 1))
        new = vocab[rng.integers(len(vocab))]
        copy[i] = new if new != copy[i] else copy[i] + "x"
    return copy


def planted_corpus(
    docs: int,
    seed: int = 0,
    copy_fraction: float = 0.3,
    levels: tuple[float, ...] = LEVELS,
    words_per_doc: tuple[int, int] = (100, 400),
    shingle_size: int = 5,
) -> tuple[list[str], list[tuple[int, int, float]]]:
    """(texts, planted pairs (i, j, target Jaccard)) with row indices after a seeded shuffle."""
    rng = np.random.default_rng(seed)
    vocab, probs = vocabulary()
    n_copies = int(docs * copy_fraction)
    n_sources = docs - n_copies
    lengths = rng.integers(words_per_doc[0], words_per_doc[1] + 1, n_sources)
    drawn = vocab[rng.choice(len(vocab), size=int(lengths.sum()), p=probs)].tolist()
    bounds = np.concatenate(([0], np.cumsum(lengths)))
    texts = [drawn[bounds[i] : bounds[i + 1]] for i in range(n_sources)]
    sources = rng.choice(n_sources, size=n_copies, replace=n_copies > n_sources)
    planted = []
    for c, source in enumerate(sources.tolist()):
        level = levels[c % len(levels)]
        texts.append(edited_copy(texts[source], level, shingle_size, rng, vocab))
        planted.append((source, n_sources + c, level))
    order = rng.permutation(len(texts))
    position = np.empty_like(order)
    position[order] = np.arange(len(order))
    shuffled = [" ".join(texts[i]) for i in order.tolist()]
    pairs = [(int(min(position[i], position[j])), int(max(position[i], position[j])), level) for i, j, level in planted]
    return shuffled, pairs


def shingles(text: str, shingle_size: int = 5) -> list[str]:
    words = text.lower().split()
    if len(words) < shingle_size:
        return [" ".join(words)]
    return [" ".join(words[i : i + shingle_size]) for i in range(len(words) - shingle_size + 1)]


class ExactJaccard:
    """Exact Jaccard similarity of the shingle sets of `texts`, computed on demand and cached per document."""

    def __init__(self, texts: list[str], shingle_size: int):
        self.texts, self.shingle_size, self.sets = texts, shingle_size, {}

    def shingle_set(self, i: int) -> set[str]:
        if i not in self.sets:
            self.sets[i] = set(shingles(self.texts[i], self.shingle_size))
        return self.sets[i]

    def __call__(self, i: int, j: int) -> float:
        a, b = self.shingle_set(i), self.shingle_set(j)
        return len(a & b) / len(a | b) if a or b else 1.0


def found_pairs(roots: np.ndarray) -> list[tuple[int, int]]:
    """Every pair of rows in one cluster."""
    clusters: dict[int, list[int]] = {}
    for i, root in enumerate(roots.tolist()):
        clusters.setdefault(root, []).append(i)
    return [pair for rows in clusters.values() for pair in itertools.combinations(rows, 2)]


def evaluate(roots: np.ndarray, planted, jaccard: ExactJaccard, threshold: float, margin: float = 0.1) -> dict:
    truth = [(i, j) for i, j, _ in planted if jaccard(i, j) >= threshold]
    found = found_pairs(roots)
    similarities = np.array([jaccard(i, j) for i, j in found]) if found else np.zeros(0)
    return {
        "true_pairs": len(truth),
        "found_pairs": len(found),
        "recall": float(np.mean([roots[i] == roots[j] for i, j in truth])) if truth else 1.0,
        "precision": float(np.mean(similarities >= threshold)) if found else 1.0,
        "precision_margin": float(np.mean(similarities >= threshold - margin)) if found else 1.0,
        "dropped": int((roots != np.arange(len(roots))).sum()),
    }


def by_level(roots: np.ndarray, planted, jaccard: ExactJaccard) -> dict[float, tuple[float, float, float]]:
    """Per planted level: (lowest exact J, highest exact J, fraction found)."""
    out = {}
    for level in sorted({level for _, _, level in planted}, reverse=True):
        pairs = [(i, j) for i, j, lv in planted if lv == level]
        js = [jaccard(i, j) for i, j in pairs]
        out[level] = (min(js), max(js), float(np.mean([roots[i] == roots[j] for i, j in pairs])))
    return out


def seconds() -> np.ndarray:
    """(wall-clock, this process's CPU) seconds: on a shared machine the CPU time is the steadier of the two."""
    return np.array([time.perf_counter(), time.process_time()])


def ours(texts: list[str], args, shards: int) -> tuple[np.ndarray, np.ndarray, DedupConfig, dict]:
    config = DedupConfig(
        threshold=args.threshold, num_perm=args.num_perm, shingle_size=args.shingle_size, seed=args.seed
    )
    with tempfile.TemporaryDirectory() as folder:
        start = seconds()
        _, roots, counters = deduplicate(texts, config, Path(folder), shards)
        return roots, seconds() - start, config, counters


def datasketch_signatures(texts: list[str], args):
    from datasketch import MinHash

    signatures = []
    for text in texts:
        m = MinHash(num_perm=args.num_perm, seed=args.seed)
        m.update_batch([s.encode("utf-8") for s in shingles(text, args.shingle_size)])
        signatures.append(m)
    return signatures


def datasketch_roots(signatures, args, weights: tuple[float, float]) -> tuple[np.ndarray, tuple[int, int]]:
    from datasketch import MinHashLSH

    lsh = MinHashLSH(threshold=args.threshold, num_perm=args.num_perm, weights=weights)
    for i, m in enumerate(signatures):
        lsh.insert(i, m)
    pairs = [(j, i) for i, m in enumerate(signatures) for j in lsh.query(m) if j < i]
    return union_find_roots(len(signatures), np.array(pairs, np.int64).reshape(-1, 2)), (lsh.b, lsh.r)


def report(name: str, seconds: float, n: int, metrics: dict) -> str:
    return (
        f"{name:<34} {n / seconds:>9,.0f} docs/s  recall {metrics['recall']:.3f}  precision {metrics['precision']:.3f}"
        f" (margin {metrics['precision_margin']:.3f})  found pairs {metrics['found_pairs']:,}"
    )


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=10_000)
    parser.add_argument("--copy-fraction", type=float, default=0.3)
    parser.add_argument("--threshold", type=float, default=0.8)
    parser.add_argument("--num-perm", type=int, default=128)
    parser.add_argument("--shingle-size", type=int, default=5)
    parser.add_argument("--shards", type=int, nargs="+", default=[1], help="shards of ours (one process; same result)")
    parser.add_argument("--repeats", type=int, default=1, help="interleaved runs of each; the fastest is reported")
    parser.add_argument("--random-pairs", type=int, default=2000, help="random pairs whose exact J is measured")
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args(argv)

    texts, planted = planted_corpus(args.docs, args.seed, args.copy_fraction, shingle_size=args.shingle_size)
    jaccard = ExactJaccard(texts, args.shingle_size)
    rng = np.random.default_rng(args.seed)
    sample = rng.integers(0, len(texts), (args.random_pairs, 2))
    random_j = max((jaccard(int(i), int(j)) for i, j in sample if i != j), default=0.0)
    words = sum(len(t.split()) for t in texts)
    print(
        f"corpus: {len(texts):,} docs, {words / len(texts):.0f} words/doc, {len(planted):,} planted copies "
        f"(target J {', '.join(map(str, LEVELS))}); highest exact J of {args.random_pairs:,} random pairs "
        f"{random_j:.3f}; threshold {args.threshold}, num_perm {args.num_perm}, {args.shingle_size}-word shingles"
    )
    print(format_s_curve(s_curve_table(args.threshold, args.num_perm)))
    runs, signing = {}, np.full(2, np.inf)
    for _ in range(args.repeats):  # interleaved; the fastest of each is kept (the machine may be shared)
        for n in args.shards:
            run = ours(texts, args, n)
            runs[n] = min(runs.get(n, run), run, key=lambda r: r[1][0])
        start = seconds()
        signatures = datasketch_signatures(texts, args)
        signing = np.minimum(signing, seconds() - start)
    results, theirs = {}, None
    for key, weights in (("datasketch", (0.5, 0.5)), ("datasketch_recall_weights", (0.1, 0.9))):
        start = seconds()
        roots, (bands, rows) = datasketch_roots(signatures, args, weights)
        took = signing + seconds() - start
        results[key] = {**evaluate(roots, planted, jaccard, args.threshold), "docs_per_s": len(texts) / took[0]}
        name = f"datasketch {bands}x{rows} (weights {weights[0]}/{weights[1]})"
        print(report(name, took[0], len(texts), results[key]) + f"  | CPU {len(texts) / took[1]:,.0f} docs/s")
        if theirs is None:
            theirs, theirs_took = roots, took
    for n, (roots, took, config, _) in runs.items():
        metrics = evaluate(roots, planted, jaccard, args.threshold)
        metrics.update(docs_per_s=len(texts) / took[0], ratio=theirs_took[0] / took[0])
        metrics["cpu_ratio"] = theirs_took[1] / took[1]
        line = report(f"ours {config.bands}x{config.rows} + verify, {n} shard(s)", took[0], len(texts), metrics)
        line += f"  | CPU {len(texts) / took[1]:,.0f} docs/s"
        results[f"ours_shards_{n}"] = metrics
        print(line)
        print(
            f"  ratio ours/datasketch: {metrics['ratio']:.1f}x wall-clock"
            + (f", {metrics['cpu_ratio']:.1f}x CPU time" if "cpu_ratio" in metrics else "")
        )
    roots, _, _, counters = runs[args.shards[0]]
    print(f"planted pairs by target J: exact J range, fraction found (ours, {args.shards[0]} shard(s) | datasketch)")
    mine, other = by_level(roots, planted, jaccard), by_level(theirs, planted, jaccard)
    for level, (low, high, found) in mine.items():
        print(f"  J {level:<4}  exact {low:.3f}-{high:.3f}  found {found:.3f} | {other[level][2]:.3f}")
    print(f"ours counters: {counters}")
    results["ratio"] = results[f"ours_shards_{args.shards[0]}"]["ratio"]
    results["random_pairs_max_jaccard"] = random_j
    return results


if __name__ == "__main__":
    main()
