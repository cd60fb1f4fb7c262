"""Where the training data stands, saved with every checkpoint and restored on resume.

Two kinds of data, one record (`hf_pretrain_state.json`, keys `data` and `stream`):
- a map-style dataset: `ResumableSampler` (`sampler.py`) draws the order the Trainer already
  uses; the position is the sample of the epoch's permutation reached (with the batch geometry and
  the dataset's length, seed and fingerprint to check it against). On resume the sampler starts
  there and the Trainer's batch skipping becomes a no-op. Another geometry or dataset warns and
  falls back to that skipping, as `Trainer` would resume;
- a streaming `datasets.IterableDataset`: the stream's own `state_dict()` just after the last batch
  trained (`stream_position.py`), loaded back on resume; nothing is skipped or re-read.

`DataPosition` is the trainer's room for this: `PretrainTrainer` hands it the sampler the Trainer
built, the epoch about to run and the data loader to build, and asks it for the state to save.
"""

from __future__ import annotations

import torch
from torch.utils.data import RandomSampler
from transformers.utils import logging

from ..private import batch_skipping_off
from ..tensor_parallel import tensor_parallel_size
from .sampler import ResumableSampler
from .stream_position import EpochAligned, StreamPositions

logger = logging.get_logger(__name__)

FIXES = {
    "num_samples": "resume with the same train_dataset (same packing)",
    "seed": "keep seed / data_seed",
    "samples_per_micro_batch": "keep per_device_train_batch_size and the number of processes",
    "gradient_accumulation_steps": "keep gradient_accumulation_steps",
    "samples_consumed_in_epoch": "keep the batch geometry of the checkpointed run",
}


class DataPosition:
    def __init__(self, trainer):
        self.trainer = trainer
        self.sampler: ResumableSampler | None = None
        self.stream: StreamPositions | None = None
        self.saved: dict = {}  # hf_pretrain_state.json of the checkpoint being resumed
        self.update_steps_per_epoch = 0
        self.micro_batches_trained = 0  # counted on from a stream's resumed position
        self.stream_resumed = self._stream_warned = False

    # Map-style datasets
    def sampler_for(self, sampler):
        """The Trainer's default random sampler, replaced by a `ResumableSampler` of the same order."""
        self.sampler = None
        if type(sampler) is RandomSampler and not sampler.replacement:
            args = self.trainer.args
            seed = args.data_seed if args.data_seed is not None else args.seed
            in_order = getattr(sampler.data_source, "keeps_order", False)  # a dataset in training order (mixtures)
            self.sampler = sampler = ResumableSampler(
                len(sampler.data_source), seed, shuffle=not in_order, pad_to_multiple_of=self._epoch_padding()
            )
        return sampler

    def _even_batches_multiple(self) -> int:
        """Samples per global micro-batch when accelerate would complete an uneven epoch end (`even_batches`), else 1."""
        args = self.trainer.args
        config = args.accelerator_config
        if args.world_size <= 1 or args.dataloader_drop_last or config.split_batches or not config.even_batches:
            return 1
        return args.per_device_train_batch_size * args.world_size // tensor_parallel_size(self.trainer)

    def _epoch_padding(self) -> int:
        """The multiple the sampler completes each epoch to: this run's (`_even_batches_multiple`), or on one process
        the checkpoint's, so a resume of a several-process run trains the same epoch ends as that run."""
        multiple = self._even_batches_multiple()
        position = self.saved.get("data") or {}
        saved = position.get("epoch_padded_to_multiple_of")
        if saved is None or saved == multiple:
            return multiple
        args = self.trainer.args
        same_batch = position.get("samples_per_micro_batch") == args.per_device_train_batch_size * args.world_size
        if multiple == 1 and args.world_size == 1 and not args.dataloader_drop_last and same_batch:
            logger.info(
                f"Each epoch is completed to a multiple of {saved} samples with its first ones, as the checkpoint's "
                "run of several processes did (accelerate's even_batches): the same samples as that run."
            )
            return saved
        if saved == 1 and same_batch:
            logger.warning(
                "The checkpoint's run trained a shorter last batch at each epoch end; with "
                f"{args.world_size} processes accelerate completes it with repeated samples (even_batches), so the "
                "losses differ from that run's from the end of this epoch on. For the same samples resume on the "
                "checkpoint's number of processes (or set dataloader_drop_last=True in both runs)."
            )
        return multiple

    def run_epoch(self, run_epoch, **kwargs):
        """Run the Trainer's `_run_epoch`, starting the data at the saved position when this epoch resumes."""
        done = kwargs["steps_trained_in_current_epoch"]  # micro-batches of this rank already trained in the epoch
        resuming = kwargs["resume_from_checkpoint"] is not None and kwargs["epoch"] == kwargs["epochs_trained"]
        if self.stream_resumed and resuming and done > 0:  # the stream starts at its saved position
            with batch_skipping_off():
                return run_epoch(**kwargs)
        if self.sampler is None or not resuming or done == 0 or self.trainer.args.ignore_data_skip:
            return run_epoch(**kwargs)
        position = self.position(kwargs["epoch"], done)
        mismatch = self.mismatch(position)
        if mismatch:  # as Trainer does: walk through the consumed batches of the new geometry
            logger.warning(
                f"Cannot resume the data position exactly: {mismatch} Falling back to the Trainer's batch skipping."
            )
            return run_epoch(**kwargs)
        self.sampler.start_at(position["epoch"], position["samples_consumed_in_epoch"])
        with batch_skipping_off():
            return run_epoch(**kwargs)

    def position(self, epoch: int, micro_batches_done: int) -> dict:
        args = self.trainer.args
        # Under sequence parallelism each micro-batch is one batch of each data-parallel group, cut along the sequence;
        # under AutoTP the ranks of a TP group share one batch (tensor_parallel.py)
        groups = args.world_size // (self.trainer.get_sp_size() * tensor_parallel_size(self.trainer))
        per_micro_batch = args.per_device_train_batch_size * groups
        return {
            "epoch": epoch,
            "samples_consumed_in_epoch": micro_batches_done * per_micro_batch,
            "samples_per_micro_batch": per_micro_batch,
            "gradient_accumulation_steps": args.gradient_accumulation_steps,
            "num_samples": self.sampler.num_samples,
            "seed": self.sampler.seed,
            "dataset_fingerprint": getattr(self.trainer.train_dataset, "_fingerprint", None),
            "epoch_padded_to_multiple_of": self.sampler.pad_to_multiple_of,
        }

    def mismatch(self, position: dict) -> str | None:
        """Why the checkpoint's data position does not fit this run (another dataset or batch geometry), or None."""
        saved = self.saved.get("data")
        if not saved:
            return None  # a checkpoint of plain transformers: its step count is the only position there is
        if saved.get("dataset_fingerprint") != position["dataset_fingerprint"]:  # can be random: warn only
            logger.warning(
                "train_dataset's fingerprint differs from the checkpoint's: resume with the same packed "
                "data, or the resumed order is not the one the checkpoint stopped in."
            )
        for key, fix in FIXES.items():
            if saved.get(key) is not None and position[key] is not None and saved[key] != position[key]:
                return f"{key} is {position[key]} here but {saved[key]} in the checkpoint (for an exact resume: {fix})."
        return None

    # Streams
    def stream_dataset(self):
        """The training stream whose position can be saved, or None (with one warning when it is a stream)."""
        trainer = self.trainer
        data = trainer.train_dataset
        if not (hasattr(data, "load_state_dict") and isinstance(data, torch.utils.data.IterableDataset)):
            return None
        if trainer.args.dataloader_num_workers or trainer.args.world_size > 1:
            if not self._stream_warned:
                self._stream_warned = True
                logger.warning(
                    "The streaming dataset's position is saved only with dataloader_num_workers=0 in one process: "
                    "a resume reads it again from the start (the Trainer's batch skipping)."
                )
            return None
        return data

    def resume(self, saved: dict) -> None:
        """Before each pass of `Trainer.train`: the checkpoint's state; a stream is moved to its saved position."""
        self.saved = saved
        stream_state, stream = saved.get("stream"), self.stream_dataset()
        self.stream_resumed = bool(stream_state and stream is not None and not self.trainer.args.ignore_data_skip)
        self.micro_batches_trained = stream_state["micro_batches"] if self.stream_resumed else 0
        if self.stream_resumed:
            stream.load_state_dict(stream_state["state"])

    def build_dataloader(self, build):
        """`build()` (the Trainer's `get_train_dataloader`) with the collator recording a stream's positions."""
        trainer = self.trainer
        stream = self.stream_dataset()
        if stream is None:
            self.stream = None
            return build()
        collator = trainer.data_collator
        keep = 2 * trainer.args.gradient_accumulation_steps + 8  # more than the loader and the Trainer read ahead
        trainer.data_collator = self.stream = StreamPositions(collator, stream, keep)
        self.stream.batches = self.micro_batches_trained
        if self.stream_resumed:
            trainer.train_dataset = EpochAligned(stream, self.saved["stream"]["state"].get("epoch", 0))
        try:
            return build()
        finally:
            trainer.data_collator, trainer.train_dataset = collator, stream

    def state_now(self, global_step: int) -> dict:
        """What to save with the checkpoint of `global_step`."""
        state = {}
        if self.sampler is not None and self.update_steps_per_epoch:
            epoch, steps = divmod(global_step, self.update_steps_per_epoch)
            state["data"] = self.position(epoch, steps * self.trainer.args.gradient_accumulation_steps)
        position = self.stream.state_after(self.micro_batches_trained) if self.stream is not None else None
        if position is not None:
            state["stream"] = {"state": position, "micro_batches": self.micro_batches_trained}
        return state
