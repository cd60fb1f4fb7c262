"""Duplicate removal: the dedup section's settings (`DedupConfig`) and the blocks that drop the rows the chain's
sharded driver listed (`ListedDuplicates`).

Dedup is global: a document is a duplicate of another anywhere in the data, so its verdicts are decided once over
all of it, by one driver: `chain/dedup_shards.py` (content hashes of the normalised text for exact copies, MinHash
signatures of word shingles, LSH bands from the threshold, candidate pairs verified by their estimated Jaccard,
union-find clusters keeping the lowest global id), run as datatrove tasks by the chain, or in one process over a
list of texts by `dedup_shards.deduplicate` (tests, benchmarks). Each shard's task then applies its verdicts with
`ListedDuplicates`, so counting and drop reasons are every block's: `exact_duplicate`, `near_duplicate`. The result
is a function of the data alone: the same rows whatever the number of tasks (tests/data/test_chain.py).

Why ours and not datatrove's four MinHash stages, measured side by side in one run (`benchmarks/datatrove_parts.py`,
docs/data.md): on the planted corpus precision 0.999 against 0.902 (theirs links unverified candidates and drops
1.8 % of the dissimilar documents), recall within two points, about 20x the documents per second per core; theirs
adds less memory per task (15 MB against 100-400 MB). datasketch builds its signatures one document at a time (see
`minhash.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from datasets import Dataset

from .blocks import DROP, Block
from .lsh import format_s_curve, lsh_params, s_curve_table

EXACT = "exact_duplicate"
NEAR = "near_duplicate"
REASONS = ("", EXACT, NEAR)  # by code: 0 keeps the row
ROW = "_dedup_row"


@dataclass
class DedupConfig:
    """The `dedup` section: `exact` (drop copies of the same normalised text: lower-cased, whitespace collapsed),
    `minhash` (drop near copies: Jaccard >= `threshold` of `shingle_size`-word shingles, estimated from `num_perm`
    MinHash values seeded by `seed`), `verify` (link a candidate pair only if its estimated Jaccard >= threshold),
    `bands` x `rows` (default: `lsh_params(threshold, num_perm)`), `bucket_window` (pairs per bucket member),
    `verbose` (print the banding's S-curve after the summary table)."""

    exact: bool = True
    minhash: bool = True
    threshold: float = 0.8
    num_perm: int = 128
    shingle_size: int = 5
    seed: int = 1
    verify: bool = True
    bands: int | None = None
    rows: int | None = None
    bucket_window: int = 64
    verbose: bool = True

    def __post_init__(self):
        if not 0.0 < self.threshold < 1.0 or self.shingle_size < 1 or self.bucket_window < 1:
            raise ValueError(
                f"threshold={self.threshold} must be in (0, 1); shingle_size={self.shingle_size} and "
                f"bucket_window={self.bucket_window} must be >= 1."
            )
        if (self.bands is None) != (self.rows is None):
            raise ValueError(f"bands={self.bands} and rows={self.rows}: give both or neither.")
        if self.bands is None:
            self.bands, self.rows = lsh_params(self.threshold, self.num_perm)
        if self.bands * self.rows > self.num_perm:
            raise ValueError(f"bands * rows = {self.bands * self.rows} exceeds num_perm={self.num_perm}.")

    @property
    def lsh_bands(self) -> int:
        """The MinHash bands searched (none without `minhash`)."""
        return self.bands if self.minhash else 0

    @property
    def total_bands(self) -> int:
        """The MinHash bands and the exact band (the content hash), the last one."""
        return self.lsh_bands + 1

    def s_curve(self) -> str:
        """The probability that a pair of each Jaccard becomes a candidate, and the areas off the threshold."""
        return format_s_curve(s_curve_table(self.threshold, self.num_perm, self.bands, self.rows))


class ListedDuplicates(Block):
    """Drops the rows whose verdict the sharded driver decided: `codes[i]` (an index into REASONS) for row i."""

    def __init__(self, name: str, codes: np.ndarray, text_column: str = "text"):
        super().__init__()
        self.name, self.codes, self.text_column = name, np.asarray(codes), text_column

    def process(self, batch: dict[str, list]) -> dict[str, list]:
        out = {name: values for name, values in batch.items() if name != ROW}
        out[DROP] = [REASONS[code] for code in self.codes[np.asarray(batch[ROW], np.int64)]]
        return out

    def run(self, data: Dataset, rank: int = 0, world_size: int = 1, num_proc: int | None = None) -> Dataset:
        if len(data) != len(self.codes):
            raise ValueError(f"{self.name}: {len(self.codes)} verdicts for {len(data)} rows; relaunch the chain.")
        if len(data) == 0:
            return data
        return super().run(data.add_column(ROW, np.arange(len(data), dtype=np.int64)), rank, world_size, num_proc)


def verdict_blocks(config: DedupConfig, codes: np.ndarray, text_column: str) -> list[ListedDuplicates]:
    """The dedup blocks of the chain over a shard's verdicts: `exact_dedup` then `minhash_dedup` (or the one that is
    on), each counting its own reason (the exact copies are the exact block's when both run)."""
    exact = REASONS.index(EXACT)
    if config.exact and config.minhash:
        remaining = codes[codes != exact]  # the rows left after the exact block, in order
        return [
            ListedDuplicates("exact_dedup", np.where(codes == exact, codes, 0), text_column),
            ListedDuplicates("minhash_dedup", remaining, text_column),
        ]
    if config.exact:
        return [ListedDuplicates("exact_dedup", codes, text_column)]
    return [ListedDuplicates("minhash_dedup", codes, text_column)]  # alone, MinHash drops exact copies too
