"""`ResumableSampler`: the training order of a map-style dataset, able to start anywhere in an epoch.

The order is the one transformers + accelerate already use (`SeedableRandomSampler`): a
`torch.randperm` of the dataset drawn from a generator seeded with `seed + epoch`. So switching a
`Trainer` script to `PretrainTrainer` keeps its data order and its losses.

What it adds is the position: `start_at(epoch, consumed)` makes the next pass over `epoch` begin
at sample `consumed` by slicing the permutation, in time independent of how far into the epoch
that is. transformers resumes by running the sampler over every batch already consumed
(`accelerate.skip_first_batches`), which is index work for an Arrow dataset but, for a multi-
billion-sample corpus, a permutation turned into Python ints and walked one batch at a time.
`PretrainTrainer` stores the position with each checkpoint (`hf_pretrain_state.json`) and
positions this sampler on resume instead.

Written by hand: torch's and accelerate's samplers have no position, and torchdata's
`StatefulDataLoader` restores a sampler by replaying its iterator up to the saved position.
Iteration yields the permutation in chunks, so a huge dataset never becomes one Python list.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch.utils.data import Sampler

CHUNK = 1 << 16


class ResumableSampler(Sampler[int]):
    def __init__(self, num_samples: int, seed: int = 0, shuffle: bool = True):
        if num_samples <= 0:
            raise ValueError(f"num_samples={num_samples}: the training dataset is empty.")
        self.num_samples, self.seed, self.shuffle = num_samples, seed, shuffle
        self.epoch = 0
        self._start: tuple[int, int] | None = None  # (epoch, consumed) for the next pass only

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def start_at(self, epoch: int, consumed: int) -> None:
        """Begin the next pass over `epoch` at its sample `consumed` (samples already trained on)."""
        if not 0 <= consumed <= self.num_samples:
            raise ValueError(f"consumed={consumed} is outside the epoch of {self.num_samples} samples.")
        self._start = (epoch, consumed)

    def order(self, epoch: int) -> torch.Tensor:
        """Every sample index of `epoch`, in training order."""
        if not self.shuffle:
            return torch.arange(self.num_samples)
        generator = torch.Generator().manual_seed(self.seed + epoch)
        return torch.randperm(self.num_samples, generator=generator)

    def __iter__(self) -> Iterator[int]:
        start = self._start[1] if self._start is not None and self._start[0] == self.epoch else 0
        self._start = None
        order = self.order(self.epoch)
        for chunk in range(start, self.num_samples, CHUNK):
            yield from order[chunk : chunk + CHUNK].tolist()

    def __len__(self) -> int:
        return self.num_samples  # the whole epoch: the Trainer's step bookkeeping counts from its start
