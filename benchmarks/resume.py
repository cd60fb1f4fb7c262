"""Time to the first batch after a resume: hf_pretrain's positioned sampler against transformers' skip.

transformers resumes mid-epoch with `accelerate.skip_first_batches`, which runs the epoch's
sampler through every batch already consumed; `ResumableSampler.start_at` slices the epoch's
permutation at the position. Both start from the same seeded permutation of a dataset of
`--samples` rows (index-only rows, so only the sampler work is timed) and draw the first batch
after `--positions` consumed batches; prints the seconds and the ratio transformers / ours.

    python benchmarks/resume.py [--samples 20000000] [--batch 8] [--positions 1000 100000 1000000]
"""

from __future__ import annotations

import argparse
import time

from accelerate.data_loader import SeedableRandomSampler, skip_first_batches
from torch.utils.data import DataLoader, Dataset

from hf_pretrain.training.resume.sampler import ResumableSampler


class Indices(Dataset):
    def __init__(self, n: int):
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> int:
        return i


def first_batch_seconds(loader: DataLoader) -> tuple[float, list[int]]:
    start = time.perf_counter()
    batch = next(iter(loader))
    return time.perf_counter() - start, batch.tolist()


def transformers_resume(data: Indices, batch: int, consumed_batches: int, seed: int):
    sampler = SeedableRandomSampler(data, data_seed=seed)
    return first_batch_seconds(
        skip_first_batches(DataLoader(data, batch_size=batch, sampler=sampler), consumed_batches)
    )


def positioned_resume(data: Indices, batch: int, consumed_batches: int, seed: int):
    sampler = ResumableSampler(len(data), seed)
    sampler.start_at(0, consumed_batches * batch)
    return first_batch_seconds(DataLoader(data, batch_size=batch, sampler=sampler))


def main(argv: list[str] | None = None) -> dict[int, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=20_000_000)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--positions", type=int, nargs="+", default=[1_000, 100_000, 1_000_000])
    parser.add_argument("--seed", type=int, default=42)
    args = parser.parse_args(argv)
    data = Indices(args.samples)
    ratios = {}
    print(f"dataset {args.samples:,} rows, batch {args.batch}; seconds to the first batch after a resume")
    for position in args.positions:
        theirs, expected = transformers_resume(data, args.batch, position, args.seed)
        ours, got = positioned_resume(data, args.batch, position, args.seed)
        assert got == expected, "the two resumes disagree on the next batch"
        ratios[position] = theirs / ours
        print(
            f"after {position:>9,} batches: transformers skip {theirs:8.3f} s | positioned {ours:6.3f} s | "
            f"ratio {ratios[position]:.1f}x"
        )
    return ratios


if __name__ == "__main__":
    main()
