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

Several processes, an epoch that is not a multiple of the global micro-batch: accelerate
(`even_batches`, its default) completes the last batches with the first samples *of the pass*,
which after a positioned start would be other samples than in the uninterrupted run. With
`pad_to_multiple_of=per_device_batch x processes` the sampler does that completion itself, with
the epoch's first samples (cycled when the epoch is shorter), exactly as accelerate would in an
uninterrupted pass; accelerate then finds full batches and adds nothing, and a resumed pass yields
the same tail. One process gets no padding (the Trainer's last batch is just shorter).

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
    def __init__(self, num_samples: int, seed: int = 0, shuffle: bool = True, pad_to_multiple_of: int = 1):
        if num_samples <= 0:
            raise ValueError(f"num_samples={num_samples}: the training dataset is empty.")
        self.num_samples, self.seed, self.shuffle = num_samples, seed, shuffle
        self.pad_to_multiple_of = pad_to_multiple_of
        self.padded_length = -(-num_samples // pad_to_multiple_of) * pad_to_multiple_of
        self.epoch = 0
        self._start: tuple[int, int] | None = None  # (epoch, consumed) for the next pass only

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def start_at(self, epoch: int, consumed: int) -> None:
        """Begin the next pass over `epoch` at its sample `consumed` (samples already trained on)."""
        if not 0 <= consumed <= self.padded_length:
            raise ValueError(f"consumed={consumed} is outside the epoch of {self.padded_length} samples.")
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
        if self.padded_length > self.num_samples:  # accelerate's even_batches completion, done here
            repeats = -(-self.padded_length // self.num_samples)
            order = order.repeat(repeats)[: self.padded_length]
        for chunk in range(start, self.padded_length, CHUNK):
            yield from order[chunk : chunk + CHUNK].tolist()

    def __len__(self) -> int:
        return self.padded_length  # the whole epoch: the Trainer's step bookkeeping counts from its start
