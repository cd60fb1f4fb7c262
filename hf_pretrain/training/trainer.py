"""`PretrainTrainer`: a drop-in `transformers.Trainer` for pretraining from scratch.

Any script that runs with `Trainer(model=..., args=..., train_dataset=..., data_collator=...)` runs
unchanged with `PretrainTrainer`, for any model and dataset; with `args.pretrain_extras=False` it is
`Trainer`, to the loss. With extras on (the default, plain `TrainingArguments` included) the user's
arguments are never written to, the callback list is the user's outside `train()`, and
`state.log_history` holds what `Trainer` puts there (docs/training.md lists the deliberate
differences). It:
- counts tokens seen: transformers' own counter when the arguments ask for it (`"non_padding"` by
  default in `PretrainingArguments`; every token for a collator that never pads, such as
  `PackedDocumentCollator`), else a count of its own for throughput, summed on the device;
- attaches the telemetry callbacks (`hf_pretrain.telemetry`) for each `train()` and merges what
  they measured into every training log: tokens/s global and per rank, step time, model TFLOP/s,
  MFU against the spec peak and a measured ceiling, ETA (`ThroughputCallback`); with
  `args.telemetry` also clocks, power, memory (`HardwareSensorsCallback`), under-clock warnings
  (`UnderclockCallback`), per-rank compute / wait and the slow rank (`StragglerCallback`), all of it
  written to `telemetry.jsonl` (`JsonlCallback`) as well as to `report_to`. Measured values stay
  out of `state.log_history` (see `hf_pretrain/callback.py`);
- refuses to train as one process when the launcher started several (WORLD_SIZE > 1 but the
  Trainer sees world_size 1, e.g. a GPU launch config on a CPU-only machine): silent
  single-process training wastes the other ranks;
- runs the attention preflight at the start of `train()` for hf_pretrain models: it fixes (pins)
  the kernel of each layer type for this device, dtype and collator (packed documents or not),
  writes `preflight.json` to the output dir and applies `args.attn_fallback` (warn / error /
  ignore). A fallback warning is repeated in the first logged metrics as `attention_fallback`,
  with `attention_step_cost_vs_best` (estimated step time against the best kernels here).
- guards every update (`LossGuardCallback`): a NaN/inf loss or gradient skips the optimizer step,
  a loss spike is logged, skipped, stops the run or rolls back to the newest checkpoint with a
  lower learning rate (`args.loss_spike_action`; `train()` does the roll-back);
- resumes exactly and fast: the training order comes from `ResumableSampler` (the order the
  Trainer already uses), its position is saved with every checkpoint and a resume starts the
  sampler there instead of walking through the consumed batches; the saved position is checked
  against the dataset and batch geometry of the resumed run (another geometry warns and falls
  back to the Trainer's batch skipping);
- writes checkpoints atomically (`checkpoints.py`): staged, then renamed into place; a killed
  save leaves the previous checkpoint as the newest;
- applies `args.precision` (`hf_pretrain.precision`): converts the selected linears before the
  optimizer exists, prints which were converted or kept and why, and runs `evaluate()` and saving
  with plain linears (`high_precision`).
It is the one place where hf_pretrain attaches its callbacks, schedules and preflight checks.
"""

from __future__ import annotations

import atexit
import contextlib
import copy
import datetime
import os
import shutil
import socket
import time
import types
from pathlib import Path

import torch
import transformers.trainer as hf_trainer
from torch.utils.data import RandomSampler
from transformers import DataCollatorWithFlattening, Trainer
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from transformers.utils import logging

from ..callback import PretrainCallback
from ..data.sampler import ResumableSampler
from ..evaluation import CausalLMMetrics, GenerationProbeCallback, causal_lm_statistics_or_empty, parse_prompt
from ..modeling.attention import Environment, plan_attention
from ..precision import apply_precision, high_precision
from ..precision.recipes import LOW_PRECISION
from ..preflight.attention import AttentionReport, attention_preflight, enforce_attention_policy
from ..telemetry.hardware import HardwareSensorsCallback
from ..telemetry.jsonl import JsonlCallback
from ..telemetry.moe import MoECallback
from ..telemetry.straggler import StragglerCallback
from ..telemetry.throughput import ThroughputCallback
from ..telemetry.underclock import UnderclockCallback
from .checkpoint_check import CheckpointError, check_checkpoint, checkpoints_newest_first, explain
from .checkpoints import (
    checkpoint_name,
    clear_staging,
    disk_full_error,
    promote,
    read_run_state,
    staging_root,
    write_run_state,
)
from .loss_guard import LossGuardCallback, injections
from .schedules import build_schedule
from .stream_position import EpochAligned, StreamPositions

# Test-only: "STEP:SECONDS" sleeps between a checkpoint's weights and its optimizer state when saving at STEP.
SLOW_SAVE_KNOB = "HF_PRETRAIN_TEST_SLOW_SAVE"

logger = logging.get_logger(__name__)


@contextlib.contextmanager
def _sampler_positioned():
    """The Trainer's batch skipping on resume becomes a no-op: the sampler already starts at the position."""
    skip = hf_trainer.skip_first_batches
    hf_trainer.skip_first_batches = lambda dataloader, num_batches=0: dataloader
    try:
        yield
    finally:
        hf_trainer.skip_first_batches = skip


def is_causal_lm(model) -> bool:
    """Whether `model` (a PeftModel's base model included) is a causal LM whose logits are [batch, seq, vocab]."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    name = type(base).__name__
    return name.endswith("ForCausalLM") or name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()


def single_process_rendezvous() -> None:
    """DeepSpeed started without a launcher (`python train.py --deepspeed ...`, or `accelerate launch` with one
    process) looks for MPI and fails ("No module named 'mpi4py'"): give it the rendezvous of one process, as a
    launcher would. Nothing changes when a launcher set it."""
    if "WORLD_SIZE" in os.environ or "OMPI_COMM_WORLD_SIZE" in os.environ:
        return
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("MASTER_ADDR", "127.0.0.1")):
        os.environ.setdefault(name, value)
    os.environ.setdefault("MASTER_PORT", str(port))


def leave_process_group() -> None:
    """Registered with `atexit` by `PretrainTrainer`: leave the process group before the interpreter exits.

    A gloo or NCCL group still alive at interpreter teardown is destroyed in an arbitrary order with
    its worker threads, which aborts the process ("terminate called without an active exception",
    SIGABRT) now and then; user scripts rarely call `destroy_process_group()`. Under gloo the ranks
    first meet at a barrier (bounded: a peer that died makes it fail at once), so no rank closes its
    connections while another still uses them."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    with contextlib.suppress(Exception):
        if torch.distributed.get_backend() == "gloo":
            torch.distributed.monitored_barrier(timeout=datetime.timedelta(seconds=60))
    with contextlib.suppress(Exception):
        torch.distributed.destroy_process_group()


@contextlib.contextmanager
def _rotation_deferred():
    """`Trainer._save_checkpoint` rotates old checkpoints at its end (module function `rotate_checkpoints`,
    transformers 5.24); the atomic save rotates itself after the rename."""
    rotate = hf_trainer.rotate_checkpoints
    hf_trainer.rotate_checkpoints = lambda *args, **kwargs: None
    try:
        yield
    finally:
        hf_trainer.rotate_checkpoints = rotate


class PretrainTrainer(Trainer):
    def __init__(self, *args, **kwargs):
        arguments = kwargs.get("args", args[1] if len(args) > 1 else None)
        if getattr(arguments, "deepspeed", None) and getattr(arguments, "pretrain_extras", True):
            single_process_rendezvous()
        super().__init__(*args, **kwargs)
        self.extras = getattr(self.args, "pretrain_extras", True)
        self.attention_report: AttentionReport | None = None
        self._pending_preflight_logs: dict = {}
        self.precision_report = None
        self.loss_guard = None
        self._micro_batch_timers: list = []
        self._stream: StreamPositions | None = None  # the training stream's positions, per batch
        self._stream_resumed = self._stream_warned = False
        self._micro_batches_trained = 0  # micro-batches trained, counted on from the resumed position of a stream
        self._attached: list[PretrainCallback] = []  # what train() attached; detached when it returns
        self._local_tokens: torch.Tensor | None = None  # real tokens of this rank, when args do not count them
        self._sampler: ResumableSampler | None = None
        self._staging: str | None = None  # where _save_checkpoint writes before the rename
        self._update_steps_per_epoch = 0
        self._run_state: dict = {}  # hf_pretrain_state.json of the checkpoint being resumed
        self._injections: dict[int, str] = {}  # the loss guard's test knob, read once per train()
        self._injections_done: set[int] = set()
        if not self.extras:
            return
        atexit.unregister(leave_process_group)  # once, however many trainers
        atexit.register(leave_process_group)
        if self.compute_metrics is not None and self.preprocess_logits_for_metrics is None and is_causal_lm(self.model):
            logger.warning(
                "compute_metrics without preprocess_logits_for_metrics: evaluate() keeps the logits of the whole "
                "evaluation set ([samples, seq, vocab]). Reduce them per batch with "
                "hf_pretrain.evaluation.preprocess_logits_for_metrics (docs/evaluation.md)."
            )
        if getattr(self.args, "loss_guard", True):  # attached at train(), with the telemetry
            self.loss_guard = LossGuardCallback(
                getattr(self.args, "loss_spike_factor", 3.0),
                getattr(self.args, "loss_spike_window", 20),
                getattr(self.args, "loss_spike_action", "log"),
                self.args.output_dir,
                getattr(self.args, "loss_spike_lr_factor", 0.5),
                getattr(self.args, "loss_spike_max_rollbacks", 3),
            )
            self.loss_guard.model = self.model
        if getattr(self.args, "precision", None) in LOW_PRECISION:
            self.precision_report = apply_precision(
                self.model,
                self.args.precision,
                scaling=self.args.precision_scaling,
                min_features=self.args.precision_min_features,
                keep_first_last_blocks=self.args.precision_keep_first_last,
                device=self.args.device,
            )
            if self.is_world_process_zero():
                print(self.precision_report.summary(), flush=True)
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        if launched != self.args.world_size:
            raise RuntimeError(
                f"The launcher started {launched} processes but the Trainer runs with world_size={self.args.world_size}. "
                "On a CPU-only machine pass use_cpu=True (PretrainingArguments does it by default) so the ranks join over gloo."
            )

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Merge the callbacks' metrics into each training log. Measured values (clocks, sensors) reach the
        console, `report_to` and telemetry.jsonl but not `state.log_history`: identical runs keep identical states."""
        measured: set[str] = set()
        if self.extras and "loss" in logs:
            for callback in self.callback_handler.callbacks:
                if isinstance(callback, PretrainCallback):
                    metrics = callback.metrics_for_log(self.state)
                    logs.update(metrics)
                    if not callback.keep_in_history:
                        measured.update(metrics)
            logs.update(self._pending_preflight_logs)
            self._pending_preflight_logs = {}
        super().log(logs, start_time)
        if measured:
            kept = self.state.log_history[-1]
            for key in measured:
                kept.pop(key, None)

    def _track_num_input_tokens(self, inputs):
        """transformers' token counter when the arguments ask for it, else a count of our own for throughput.

        The arguments are never written to: with counting off (plain `TrainingArguments`) real tokens are summed
        on the device for `tokens_seen()`, without a sync per micro-batch and without the Trainer's per-step
        warning for batches that carry no `main_input_name`."""
        if not self.extras:
            return super()._track_num_input_tokens(inputs)
        counting = self.args.include_num_input_tokens_seen
        if counting == "no" or getattr(self.data_collator, "has_padding", True) is False:
            count = self._real_tokens(inputs)
            if count is None:
                return
            if counting == "no":
                self._local_tokens = count if self._local_tokens is None else self._local_tokens + count
            else:  # a collator that never pads: every token is real, no pad id to guess with
                self.state.num_input_tokens_seen += self.accelerator.gather(count).sum().item()
            return
        super()._track_num_input_tokens(inputs)

    def _real_tokens(self, inputs) -> torch.Tensor | None:
        """Non-padding tokens of a batch (transformers' rule), or None for batches without `main_input_name`."""
        ids = inputs.get(getattr(self.model, "main_input_name", "input_ids"))
        if not torch.is_tensor(ids):
            return None
        if getattr(self.data_collator, "has_padding", True) is False:
            count = torch.tensor(ids.numel())
        elif torch.is_tensor(inputs.get("attention_mask")):
            count = inputs["attention_mask"].sum()
        elif getattr(self.processing_class, "pad_token_id", None) is not None:
            count = (ids != self.processing_class.pad_token_id).sum()
        else:
            count = torch.tensor(ids.numel())
        return count.to(self.args.device, torch.int64)

    def tokens_seen(self, state=None) -> int:
        """Real tokens of all ranks so far: the Trainer's counter, or ours when the arguments do not count.

        Our count is reduced over ranks here (every rank calls it at the same log), not at every micro-batch."""
        if self.args.include_num_input_tokens_seen != "no":
            return self.state.num_input_tokens_seen
        if self._local_tokens is None:
            return 0
        total = self._local_tokens.clone()
        if self.args.world_size > 1 and torch.distributed.is_initialized():
            torch.distributed.all_reduce(total)
        return int(total.item())

    def training_step(self, model, inputs, *args, **kwargs):
        timers = self._micro_batch_timers  # found once per train(), not per micro-batch
        start = time.perf_counter()
        for timer in timers:
            timer.before_micro_batch()  # (the test knob's sleep counts as this rank's compute)
        loss = super().training_step(model, inputs, *args, **kwargs)
        self._micro_batches_trained += 1
        if self._injections and self.state.global_step + 1 in self._injections:
            self._injections_done.add(self.state.global_step + 1)
        end = time.perf_counter()
        for timer in timers:
            timer.record_micro_batch(start, end)
        if self.loss_guard is not None:
            self.loss_guard.record_loss(loss)
        return loss

    def compute_loss(self, model, inputs, *args, **kwargs):
        result = super().compute_loss(model, inputs, *args, **kwargs)
        step = self.state.global_step + 1
        kind = self._injections.get(step) if model.training and step not in self._injections_done else None
        if kind is None:  # the test-only knob of the loss guard (once per step: a replay after a roll-back is clean)
            return result
        loss = result[0] if isinstance(result, tuple) else result
        loss = loss * float("nan") if kind == "nan" else loss * 50.0
        return (loss, *result[1:]) if isinstance(result, tuple) else loss

    def create_optimizer(self, *args, **kwargs):
        optimizer = super().create_optimizer(*args, **kwargs)
        guard = self.loss_guard
        if guard is not None and not getattr(optimizer, "_loss_guarded", False):
            step = optimizer.step

            def guarded_step(optimizer, *step_args, **step_kwargs):
                if guard.skip_next_update:  # a NaN/inf or spiking step: no update at all
                    guard.skip_next_update = False
                    return None
                if guard.lr_scale == 1.0:
                    return step(*step_args, **step_kwargs)
                scheduled = [group["lr"] for group in optimizer.param_groups]
                for group in optimizer.param_groups:  # lowered after a roll-back; the schedule itself is untouched
                    group["lr"] *= guard.lr_scale
                try:
                    return step(*step_args, **step_kwargs)
                finally:
                    for group, lr in zip(optimizer.param_groups, scheduled, strict=True):
                        group["lr"] = lr

            optimizer.step = types.MethodType(guarded_step, optimizer)  # a method, as LR schedulers expect
            optimizer._loss_guarded = True
        return optimizer

    def _get_learning_rate(self):
        lr = super()._get_learning_rate()
        return lr * self.loss_guard.lr_scale if self.loss_guard is not None else lr

    def evaluate(self, *args, **kwargs):
        with high_precision(self.model), self._lm_eval_metrics():  # evaluation never runs the low-precision path
            return super().evaluate(*args, **kwargs)

    @contextlib.contextmanager
    def _lm_eval_metrics(self):
        """Perplexity and next-token accuracy from per-sequence sums (`hf_pretrain.evaluation`) for a causal LM when
        the user set no metrics of their own: evaluate() then keeps neither logits nor labels of the evaluation set.
        Any other model evaluates as with `Trainer` (only `eval_loss`)."""
        if not (
            self.extras
            and getattr(self.args, "eval_lm_metrics", True)
            and self.compute_metrics is None
            and self.preprocess_logits_for_metrics is None
            and is_causal_lm(self.model)
        ):
            yield
            return
        args = self.args
        self.args = copy.copy(args)  # the user's arguments are never written to
        self.args.batch_eval_metrics = True  # one add_batch per batch: nothing of the eval set accumulates
        self.compute_metrics = CausalLMMetrics(skip_empty=True)
        self.preprocess_logits_for_metrics = causal_lm_statistics_or_empty
        try:
            yield
        finally:
            self.compute_metrics = self.preprocess_logits_for_metrics = None
            self.args = args

    def create_scheduler(self, num_training_steps: int, optimizer=None):
        name = getattr(self.args, "pretrain_schedule", None)
        if name is None or self.lr_scheduler is not None:
            return super().create_scheduler(num_training_steps, optimizer)
        self.lr_scheduler = build_schedule(
            name,
            optimizer or self.optimizer,
            num_training_steps,
            self.args.get_warmup_steps(num_training_steps),
            self.args.lr_scheduler_kwargs,
            tokens_seen=lambda: self.state.num_input_tokens_seen,
        )
        self._created_lr_scheduler = True
        return self.lr_scheduler

    def predict(self, *args, **kwargs):
        with high_precision(self.model):
            return super().predict(*args, **kwargs)

    def _save(self, output_dir: str | None = None, state_dict=None):
        with high_precision(self.model):  # plain weights that load without torchao or TE
            return super()._save(output_dir, state_dict)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        if not self.extras:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        self.run_attention_preflight()
        self._injections = injections()
        self._clear_interrupted_saves()
        checkpoint = self._resolve_checkpoint(resume_from_checkpoint)
        self._run_state = read_run_state(checkpoint) if checkpoint else {}
        if self.loss_guard is not None and "loss_guard" in self._run_state:
            self.loss_guard.load_state(self._run_state["loss_guard"])
        self._attach_callbacks()
        try:
            while True:
                self._load_stream_position()
                output = super().train(checkpoint, *args, **kwargs)
                guard = self.loss_guard
                if guard is None or guard.rollback_from is None:
                    self._wait_for_everyone()  # ranks leave train() together (a probe on rank 0 may run late)
                    return output
                checkpoint = self._rollback_checkpoint(guard.rollback_from)
                guard.start_rollback(self.args, checkpoint)  # lowers the learning rate, or stops
                self._run_state = read_run_state(checkpoint)
        finally:  # the callback list is the user's again, as with Trainer
            for callback in self._attached:
                self.remove_callback(callback)
            self._attached = []

    def _resolve_checkpoint(self, resume_from_checkpoint: str | bool | None) -> str | None:
        """The checkpoint to resume, checked first (`checkpoint_check.py`): an explicit path must be whole; `True`
        takes the newest whole one and says which it skipped."""
        if not resume_from_checkpoint:
            return None
        settings = dict(
            world_size=self.args.world_size,
            deepspeed=self.is_deepspeed_enabled,
            save_only_model=self.args.save_only_model,
        )
        if resume_from_checkpoint is not True:
            check = check_checkpoint(resume_from_checkpoint, **settings)
            if not check.ok:
                newest = next(
                    (
                        str(p)
                        for p in checkpoints_newest_first(self.args.output_dir)
                        if p != Path(check.path) and check_checkpoint(p, **settings).ok
                    ),
                    None,
                )
                raise CheckpointError(
                    f"Cannot resume from {check.path}: {explain(check)}. Fix: resume from a whole checkpoint"
                    + (f" (the newest one is {newest}, or pass resume_from_checkpoint=True)" if newest else "")
                    + ", or start anew from the weights (from_pretrained) without resume_from_checkpoint."
                )
            self._warn_checkpoint(check)
            return check.path
        skipped = []
        for candidate in checkpoints_newest_first(self.args.output_dir):
            check = check_checkpoint(candidate, **settings)
            if check.ok:
                if skipped and self.is_world_process_zero():
                    logger.warning(
                        f"Resuming from {check.path}, the newest whole checkpoint; skipped: " + " | ".join(skipped)
                    )
                self._warn_checkpoint(check)
                return check.path
            skipped.append(f"{candidate.name}: {explain(check)}")
        found = f" ({' | '.join(skipped)})" if skipped else ""
        raise CheckpointError(
            f"resume_from_checkpoint=True but {self.args.output_dir} holds no whole checkpoint-N{found}. "
            "Fix: pass the output_dir of the run to resume, or train without resume_from_checkpoint."
        )

    def _warn_checkpoint(self, check) -> None:
        for warning in check.warnings if self.is_world_process_zero() else ():
            logger.warning(f"{check.path}: {warning}; resuming anyway (another number of processes).")

    def _wait_for_everyone(self) -> None:
        """A barrier when there are other ranks. (accelerate's would fail for one DeepSpeed process before the
        engine starts, which creates the process group.)"""
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            self.accelerator.wait_for_everyone()

    def _rollback_checkpoint(self, spike_step: int) -> str:
        from .loss_guard import LossSpikeError

        try:
            return self._resolve_checkpoint(True)
        except CheckpointError as error:
            raise LossSpikeError(
                f"loss spike at step {spike_step} and no checkpoint in {self.args.output_dir} to roll back to: "
                "save checkpoints (save_strategy='steps', save_steps=N) or use loss_spike_action='skip'."
            ) from error

    def _clear_interrupted_saves(self) -> None:
        if self.args.should_save:
            left = clear_staging(self.args.output_dir)
            if left:
                print(f"Removed what an interrupted save left in {staging_root(self.args.output_dir)}: {left}")
        self._wait_for_everyone()

    # Data position: the sampler starts where the checkpoint stopped (see ResumableSampler).
    def _get_train_sampler(self, train_dataset=None):
        sampler = super()._get_train_sampler(train_dataset)
        self._sampler = None
        if self.extras and type(sampler) is RandomSampler and not sampler.replacement:  # the default random order
            seed = self.args.data_seed if self.args.data_seed is not None else self.args.seed
            self._sampler = sampler = ResumableSampler(
                len(sampler.data_source), seed, pad_to_multiple_of=self._even_batches_multiple()
            )
        return sampler

    def _even_batches_multiple(self) -> int:
        """Samples per global micro-batch when accelerate would complete an uneven epoch end (`even_batches`), else 1."""
        config = self.args.accelerator_config
        if (
            self.args.world_size <= 1
            or self.args.dataloader_drop_last
            or config.split_batches
            or not config.even_batches
        ):
            return 1
        return self.args.per_device_train_batch_size * self.args.world_size

    def _init_training_state(self, max_steps, num_update_steps_per_epoch, *args, **kwargs):
        self._update_steps_per_epoch = num_update_steps_per_epoch
        return super()._init_training_state(max_steps, num_update_steps_per_epoch, *args, **kwargs)

    def _run_epoch(self, **kwargs):
        done = kwargs["steps_trained_in_current_epoch"]  # micro-batches of this rank already trained in the epoch
        resuming = kwargs["resume_from_checkpoint"] is not None and kwargs["epoch"] == kwargs["epochs_trained"]
        if self._stream_resumed and resuming and done > 0:  # the stream starts at its saved position: skip nothing
            with _sampler_positioned():
                return super()._run_epoch(**kwargs)
        if self._sampler is None or not resuming or done == 0 or self.args.ignore_data_skip:
            return super()._run_epoch(**kwargs)
        position = self._data_position(kwargs["epoch"], done)
        mismatch = self._resumed_position_mismatch(position)
        if mismatch:  # as Trainer does: walk through the consumed batches of the new geometry
            logger.warning(
                f"Cannot resume the data position exactly: {mismatch} Falling back to the Trainer's batch skipping."
            )
            return super()._run_epoch(**kwargs)
        self._sampler.start_at(position["epoch"], position["samples_consumed_in_epoch"])
        with _sampler_positioned():
            return super()._run_epoch(**kwargs)

    # Streams: a `datasets.IterableDataset` resumes from its saved position (see stream_position.py).
    def _stream_dataset(self):
        """The training stream whose position can be saved, or None (with one warning when it is a stream)."""
        data = self.train_dataset
        if not (
            self.extras and hasattr(data, "load_state_dict") and isinstance(data, torch.utils.data.IterableDataset)
        ):
            return None
        if self.args.dataloader_num_workers or self.args.world_size > 1:
            if not self._stream_warned:
                self._stream_warned = True
                logger.warning(
                    "The streaming dataset's position is saved only with dataloader_num_workers=0 in one process: "
                    "a resume reads it again from the start (the Trainer's batch skipping)."
                )
            return None
        return data

    def _load_stream_position(self) -> None:
        saved = self._run_state.get("stream")
        stream = self._stream_dataset()
        self._stream_resumed = bool(saved and stream is not None and not self.args.ignore_data_skip)
        self._micro_batches_trained = saved["micro_batches"] if self._stream_resumed else 0
        if self._stream_resumed:
            stream.load_state_dict(saved["state"])

    def get_train_dataloader(self):
        stream = self._stream_dataset()
        if stream is None:
            self._stream = None
            return super().get_train_dataloader()
        collator = self.data_collator
        keep = 2 * self.args.gradient_accumulation_steps + 8  # more than the loader and the Trainer read ahead
        self.data_collator = self._stream = StreamPositions(collator, stream, keep)
        self._stream.batches = self._micro_batches_trained
        if self._stream_resumed:
            self.train_dataset = EpochAligned(stream, self._run_state["stream"]["state"].get("epoch", 0))
        try:
            return super().get_train_dataloader()
        finally:
            self.data_collator, self.train_dataset = collator, stream

    def _data_position(self, epoch: int, micro_batches_done: int) -> dict:
        return {
            "epoch": epoch,
            "samples_consumed_in_epoch": micro_batches_done
            * self.args.per_device_train_batch_size
            * self.args.world_size,
            "samples_per_micro_batch": self.args.per_device_train_batch_size * self.args.world_size,
            "gradient_accumulation_steps": self.args.gradient_accumulation_steps,
            "num_samples": self._sampler.num_samples,
            "seed": self._sampler.seed,
            "dataset_fingerprint": getattr(self.train_dataset, "_fingerprint", None),
        }

    def _resumed_position_mismatch(self, position: dict) -> str | None:
        """Why the checkpoint's data position does not fit this run (another dataset or batch geometry), or None."""
        saved = self._run_state.get("data")
        if not saved:
            return None  # a checkpoint of plain transformers: its step count is the only position there is
        if saved.get("dataset_fingerprint") != position["dataset_fingerprint"]:  # can be random: warn only
            logger.warning(
                "train_dataset's fingerprint differs from the checkpoint's: resume with the same packed "
                "data, or the resumed order is not the one the checkpoint stopped in."
            )
        fixes = {
            "num_samples": "resume with the same train_dataset (same packing)",
            "seed": "keep seed / data_seed",
            "samples_per_micro_batch": "keep per_device_train_batch_size and the number of processes",
            "gradient_accumulation_steps": "keep gradient_accumulation_steps",
            "samples_consumed_in_epoch": "keep the batch geometry of the checkpointed run",
        }
        for key, fix in fixes.items():
            if saved.get(key) is not None and position[key] is not None and saved[key] != position[key]:
                return f"{key} is {position[key]} here but {saved[key]} in the checkpoint (for an exact resume: {fix})."
        return None

    def _save_optimizer_and_scheduler(self, output_dir):
        step, _, seconds = os.environ.get(SLOW_SAVE_KNOB, "").partition(":")
        if step and int(step) == self.state.global_step:  # test-only: a window in which to kill a save half done
            time.sleep(float(seconds))
        return super()._save_optimizer_and_scheduler(output_dir)

    def _get_output_dir(self, trial):
        return self._staging or super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial) -> None:
        if not self.extras:
            return super()._save_checkpoint(model, trial)
        run_dir = super()._get_output_dir(trial)
        name = checkpoint_name(self.state.global_step)
        staged, final = os.path.join(staging_root(run_dir), name), os.path.join(run_dir, name)
        try:
            self._save_staged_checkpoint(model, trial, run_dir, staged, final)
        except (OSError, RuntimeError) as error:  # a full disk: say so, and free what the half save took
            full = disk_full_error(error, run_dir, name)
            if full is None:
                raise
            shutil.rmtree(staged, ignore_errors=True)
            raise full from error

    def _save_staged_checkpoint(self, model, trial, run_dir: str, staged: str, final: str) -> None:
        self._staging = staging_root(run_dir)
        try:
            with _rotation_deferred():  # rotate only after the rename
                super()._save_checkpoint(model, trial)
        finally:
            self._staging = None
        best = self.state.best_model_checkpoint
        if best and best.startswith(staging_root(run_dir)):
            self.state.best_model_checkpoint = os.path.join(run_dir, os.path.basename(best))
            if self.args.should_save:
                self.state.save_to_json(os.path.join(staged, hf_trainer.TRAINER_STATE_NAME))
        if self.args.should_save:
            write_run_state(staged, self._run_state_now())
        self._wait_for_everyone()  # every rank's files are in place
        if self.args.should_save:
            promote(staged, final)
            hf_trainer.rotate_checkpoints(
                output_dir=run_dir,
                save_total_limit=self.args.save_total_limit,
                best_model_checkpoint=self.state.best_model_checkpoint,
                use_mtime=True,
            )
        self._wait_for_everyone()

    def _run_state_now(self) -> dict:
        state = {}
        position = self._stream.state_after(self._micro_batches_trained) if self._stream is not None else None
        if position is not None:
            state["stream"] = {"state": position, "micro_batches": self._micro_batches_trained}
        if self._sampler is not None and self._update_steps_per_epoch:
            epoch, steps = divmod(self.state.global_step, self._update_steps_per_epoch)
            state["data"] = self._data_position(epoch, steps * self.args.gradient_accumulation_steps)
        if self.loss_guard is not None:
            state["loss_guard"] = self.loss_guard.state()
        return state

    def _attach_callbacks(self) -> None:
        """Attach hf_pretrain's callbacks for this `train()` call (`train()` detaches them when it returns)."""
        args = self.args
        get = lambda name, default: getattr(args, name, default)  # noqa: E731  (plain TrainingArguments lack them)
        self._local_tokens = None
        callbacks: list[PretrainCallback] = [] if self.loss_guard is None else [self.loss_guard]
        callbacks.append(
            ThroughputCallback(
                self._sequence_length(), get("peak_tflops", None), get("measure_peak_tflops", True), self.tokens_seen
            )
        )
        experts = getattr(getattr(self.model, "config", None), "num_experts", 0)
        if experts and not any(isinstance(c, MoECallback) for c in self.callback_handler.callbacks):
            callbacks.append(MoECallback(self.model))  # expert load, aux / z losses, dropped tokens in the logs
        if get("telemetry", True):
            sensors = HardwareSensorsCallback(every=args.logging_steps if args.logging_strategy == "steps" else 10)
            straggler = StragglerCallback(
                get("straggler_every", 20), get("straggler_threshold", 0.75), sensors, get("underclock_threshold", 0.6)
            )
            straggler.trainer = self
            callbacks += [
                sensors,
                UnderclockCallback(sensors, get("underclock_threshold", 0.6)),
                straggler,
                JsonlCallback(args.output_dir),
            ]
        if get("probe_prompts", None) and (get("probe_every", 0) > 0 or get("probe_at_end", True)):
            callbacks.append(
                GenerationProbeCallback(
                    [parse_prompt(p) for p in args.probe_prompts],
                    args.probe_every,
                    args.probe_max_new_tokens,
                    tokenizer=self.processing_class,
                    at_end=args.probe_at_end,
                )
            )
        for callback in callbacks:
            self.add_callback(callback)
        self._attached = callbacks
        self._micro_batch_timers = [c for c in callbacks if hasattr(c, "record_micro_batch")]

    def packed_documents(self) -> bool:
        """Whether training batches hold several documents per row (position ids restarting)."""
        declared = getattr(self.data_collator, "packed_documents", None)
        return bool(declared) if declared is not None else isinstance(self.data_collator, DataCollatorWithFlattening)

    def run_attention_preflight(self) -> AttentionReport | None:
        """Plan the attention kernels for this run, pin them on the model, report them, apply `attn_fallback`."""
        model = self.model
        if not hasattr(model, "set_attention_plan"):
            return None
        dtype = torch.bfloat16 if self.args.bf16 else torch.float16 if self.args.fp16 else model.dtype
        env = Environment.detect(self.args.device, dtype, training=True)
        packed = self.packed_documents()
        report = attention_preflight(model.config, self._sequence_length(), env, packed)
        model.set_attention_plan(plan_attention(model.config, env, packed), pin=True)
        policy = getattr(self.args, "attn_fallback", "warn")
        main = self.is_world_process_zero()
        enforce_attention_policy(
            report, policy if main or policy == "error" else "ignore", self.args.output_dir if main else None
        )
        if report.warnings and policy == "warn":
            self._pending_preflight_logs = {
                "attention_fallback": " | ".join(report.warnings),
                "attention_step_cost_vs_best": round(report.step_cost_vs_best, 3),
            }
        self.attention_report = report
        return report

    def _sequence_length(self) -> int | None:
        """Tokens per row of the training data (the first row), else the model's maximum context, else None."""
        try:
            row = self.train_dataset[0]
            return len(row[getattr(self.model, "main_input_name", "input_ids")])
        except Exception:  # iterable or unusual datasets, rows without input ids: fall back to the config
            return getattr(getattr(self.model, "config", None), "max_position_embeddings", None)
