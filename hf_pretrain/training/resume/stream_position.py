"""The position of a streaming `datasets.IterableDataset` in training, for an exact resume without re-reading.

`Trainer` resumes a stream by reading it again from the start and throwing away every batch already
trained on (`skip_first_batches`): hours for a large corpus. `datasets.IterableDataset` can save its
position (`state_dict()`: shard, example in shard, epoch) and start there (`load_state_dict()`),
but the position it reports is where *reading* got to, and the data loader reads ahead of training
(accelerate's one-batch look-ahead, the Trainer's gradient-accumulation prefetch).

`StreamPositions` wraps the collator: a batch is collated right after its examples were read, so
the dataset's state at that moment is the position just after that batch. It keeps the states of
the last batches by batch number; `PretrainTrainer` saves the one of the last batch trained with
each checkpoint (`hf_pretrain_state.json`, key `stream`) and, on resume, loads it into the dataset
and skips nothing. Each resumed run records positions anew, so a second resume is as exact as the
first (the failure mode of datasets issue 8308, tested).

On a resumed run the Trainer numbers epochs from 0 again (it cannot know how long a stream is), and
its `set_epoch(0)` would put the stream back into epoch 0 semantics (another shard order): the
data loader then reads the stream through `EpochAligned`, which maps the first epoch the Trainer
sets onto the saved one.

Limits: one process reading in the main process (`dataloader_num_workers=0`); with workers the
dataset is copied into them and its position is not visible here, and several processes without
a shared reader are not covered: there the Trainer's batch skipping is used (a warning says so).
Written by hand: neither transformers nor accelerate saves a stream's position with a checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class StreamPositions:
    def __init__(self, collate: Callable, dataset, keep: int = 64):
        self.collate, self.dataset, self.keep = collate, dataset, keep
        self.batches = 0  # batches collated since the run (or the resumed run's position) began
        self._states: dict[int, dict] = {}

    def __call__(self, features):
        batch = self.collate(features)
        self.batches += 1
        self._states[self.batches] = self.dataset.state_dict()
        self._states.pop(self.batches - self.keep, None)
        return batch

    def state_after(self, batches: int) -> dict | None:
        """The dataset's position just after its batch number `batches`, if still kept."""
        return self._states.get(batches)


class EpochAligned(torch.utils.data.IterableDataset):
    def __init__(self, dataset, saved_epoch: int):
        self.dataset, self.saved_epoch = dataset, saved_epoch
        self.offset: int | None = None

    def set_epoch(self, epoch: int) -> None:
        if self.offset is None:  # the Trainer's first epoch of this run is the saved epoch of the stream
            self.offset = self.saved_epoch - epoch
        self.dataset.set_epoch(epoch + self.offset)

    def __iter__(self):
        return iter(self.dataset)
