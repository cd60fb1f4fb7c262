"""`PretrainTrainer`: a drop-in `transformers.Trainer` for pretraining from scratch.

Any script that runs with `Trainer(model=..., args=..., train_dataset=..., data_collator=...)` runs
unchanged with `PretrainTrainer`, for any model and dataset; with `args.pretrain_extras=False` it is
`Trainer`, to the loss. With extras on (the default, plain `TrainingArguments` included) the user's
arguments are never written to, the callback list is the user's outside `train()`, and
`state.log_history` holds what `Trainer` puts there (docs/training.md lists the deliberate
differences). It adds, each in its own room:
- tokens seen and throughput without a sync per micro-batch (`tokens.py`);
- the callbacks of each `train()` (`wiring.py`): throughput and MFU, sensors, under-clock,
  straggler, the `telemetry.jsonl` stream, MoE load, generation probes; their measured values are
  merged into every training log and kept out of `state.log_history` (`hf_pretrain/callback.py`);
  the printed line keeps what a person reads (`telemetry/console.py`);
- the attention preflight for hf_pretrain models and the precision recipe (`wiring.py`);
- Muon for the hidden matrices with `optim="muon"` (`optimizers.py`), refused under sharding;
- the loss guard (`loss_guard.py`): NaN/inf updates skipped, spikes logged, skipped, stopped or
  rolled back to the newest checkpoint with a lower learning rate;
- resume (`resume/`): exact, fast resume of samplers and streams (`data_position.py`); checkpoints checked
  before a resume and written atomically (`checkpointing.py`);
- DeepSpeed Ulysses sequence parallelism (`sequence_parallel.py`): what breaks refused, the rest wired;
- DeepSpeed AutoTP tensor parallelism (`tensor_parallel.py`): tokens and `evaluate()`'s outputs counted once per TP
  group, what breaks refused;
- FSDP2 (`fsdp.py`): on CPU ranks too, and `save_model()` writes the full weights under sharded state dicts;
- the processes (`processes.py`): a launch that lost its ranks is refused, one DeepSpeed process
  needs no launcher, the process group is left before exit, risky DataLoader workers of a rank are warned of;
- causal-LM metrics in `evaluate()` (`eval_metrics.py`).
This file only wires those rooms to the Trainer's public methods. Every override of a private `Trainer` method
and every patch of a `transformers.trainer` global is in `private.py`, the base class.
"""

from __future__ import annotations

import atexit
import time

from transformers.utils import logging

from ..callback import PretrainCallback
from ..precision import high_precision
from ..preflight.attention import AttentionReport
from ..telemetry.console import restore_console, swap_console
from ..telemetry.jsonl import record_outside_train
from .eval_metrics import is_causal_lm, lm_eval_metrics
from .fsdp import fsdp_on_cpu, save_config, save_full_weights, sharded_saves
from .loss_guard import LossGuardCallback, guard_optimizer
from .optimizers import build_optimizer, check_optimizer_supported
from .private import TrainerPrivateOverrides, scheduler_created
from .processes import (
    check_launched_world_size,
    leave_process_group,
    single_process_rendezvous,
    wait_for_everyone,
    workers_start_warning,
)
from .recovery.room import Recovery
from .resume.checkpointing import Checkpointing
from .resume.data_position import DataPosition
from .resume.store import read_run_state, save_into_place
from .schedules import build_schedule
from .sequence_parallel import check_attention_plan, check_trainer, training_batches
from .tensor_parallel import check_trainer as check_tensor_parallel
from .tensor_parallel import gathered_once_per_group, tensor_parallel_size
from .tokens import TokenCounter
from .wiring import (
    attention_preflight_for,
    callbacks_from_arguments,
    compile_from_arguments,
    memory_preflight_for,
    packed_documents,
    precision_from_arguments,
)

logger = logging.get_logger(__name__)


class PretrainTrainer(TrainerPrivateOverrides):
    def __init__(self, *args, **kwargs):
        arguments = kwargs.get("args", args[1] if len(args) > 1 else None)
        if getattr(arguments, "deepspeed", None) and getattr(arguments, "pretrain_extras", True):
            single_process_rendezvous()
        super().__init__(*args, **kwargs)
        self.extras = getattr(self.args, "pretrain_extras", True)
        self.attention_report: AttentionReport | None = None
        self.precision_report = None
        self.memory_check = None  # the memory preflight's estimate against what is free (train() fills it)
        self.loss_guard = None
        self.tokens = TokenCounter(self)
        self.data_position = DataPosition(self)
        self.checkpointing = Checkpointing(self)
        self.recovery = Recovery(self)
        self._pending_preflight_logs: dict = {}
        self._compile_callback = None
        self._attached: list[PretrainCallback] = []  # what train() attached; detached when it returns
        self._micro_batch_timers: list = []
        self._console: list = []  # transformers' console callbacks replaced during train()
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
        self.loss_guard = LossGuardCallback.from_arguments(self)  # attached at train()
        check_tensor_parallel(self)  # tensor_parallel.py: what breaks under AutoTP, before the recipe converts
        self.precision_report = precision_from_arguments(self)
        check_launched_world_size(self.args.world_size)
        check_optimizer_supported(self)
        check_trainer(self)  # sequence_parallel.py: refusals, DeepSpeed's comm on this group, the SP kernel
        if (warning := workers_start_warning(self.args)) and self.args.process_index == 0:
            logger.warning(warning)  # the same for every rank: said once

    def get_tp_size(self) -> int:
        """transformers' reads AutoTP off `args.hf_deepspeed_config`, which an accelerate-config launch leaves without
        it (1 for cpu_2proc_tp.yaml's 2); the DeepSpeed config accelerate runs says it in both launches."""
        return max(super().get_tp_size(), tensor_parallel_size(self))

    def tokens_seen(self, state=None) -> int:
        """Real tokens of all ranks so far (see `tokens.py`)."""
        return self.tokens.tokens_seen(state)

    def packed_documents(self) -> bool:
        """Whether training batches hold several documents per row (position ids restarting)."""
        return packed_documents(self.data_collator)

    def run_attention_preflight(self) -> AttentionReport | None:
        """Plan the attention kernels for this run, pin them on the model, report them, apply `attn_fallback`."""
        self.attention_report, self._pending_preflight_logs = attention_preflight_for(self)
        return self.attention_report

    # Public Trainer methods
    def train(self, resume_from_checkpoint: str | bool | None = None, *args, **kwargs):
        if not self.extras:
            return super().train(resume_from_checkpoint, *args, **kwargs)
        self.run_attention_preflight()
        check_attention_plan(self)  # under SP: every layer on the kernel Ulysses wraps
        self.memory_check = memory_preflight_for(self)
        self.checkpointing.clear_interrupted()
        checkpoint = self.checkpointing.resolve(resume_from_checkpoint)
        saved = read_run_state(checkpoint) if checkpoint else {}
        if self.loss_guard is not None and "loss_guard" in saved:
            self.loss_guard.load_state(saved["loss_guard"])
        self._compile_callback = compile_from_arguments(self)
        self._attach_callbacks()
        error = None
        try:
            self.recovery.start(checkpoint, saved, self._attached)  # recovery/: attempts, restart-loop guard, watchdog
            while True:
                self.data_position.resume(saved)
                output = super().train(checkpoint, *args, **kwargs)
                with self.recovery.phase("checkpoint", count=False):  # the watchdog's save floor: the last write ends
                    self.checkpointing.finish()  # the last background save complete (or raised) before train() returns
                guard = self.loss_guard
                if guard is None or guard.rollback_from is None:
                    wait_for_everyone(self.accelerator)  # ranks leave train() together (a probe on rank 0 may lag)
                    return output
                checkpoint = self.checkpointing.rollback_checkpoint(guard.rollback_from)
                guard.start_rollback(self.args, checkpoint)  # lowers the learning rate, or stops
                saved = read_run_state(checkpoint)
        except BaseException as failure:
            error = failure
            with self.recovery.phase("checkpoint", count=False):
                self.checkpointing.settle_after_failure()
            raise
        finally:  # the callback list is the user's again, as with Trainer
            self.recovery.finish(error)
            for callback in self._attached:
                self.remove_callback(callback)
            self._attached = []
            restore_console(self.callback_handler, self._console)
            self._console = []

    def _attach_callbacks(self) -> None:
        self.tokens.reset()
        callbacks = ([self.loss_guard] if self.loss_guard is not None else []) + callbacks_from_arguments(self)
        if self._compile_callback is not None:
            callbacks.append(self._compile_callback)
        for callback in callbacks:
            self.add_callback(callback)
        self._attached = callbacks
        self._micro_batch_timers = [c for c in callbacks if c.times_micro_batches]
        self._console = swap_console(self.callback_handler)  # telemetry/console.py: the printed line, filtered

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
        for key in measured:
            self.state.log_history[-1].pop(key, None)

    def training_step(self, model, inputs, *args, **kwargs):
        timers = self._micro_batch_timers  # found once per train(), not per micro-batch
        start = time.perf_counter()
        for timer in timers:
            timer.before_micro_batch()
        self.checkpointing.raise_if_failed()  # a background save that failed stops the run at its next step
        loss = super().training_step(model, inputs, *args, **kwargs)
        self.data_position.micro_batches_trained += 1
        end = time.perf_counter()
        for timer in timers:
            timer.record_micro_batch(start, end)
        if self.loss_guard is not None:
            self.loss_guard.record_loss(loss)
        return loss

    def create_optimizer(self, model=None):
        if self.optimizer is None and self.extras:  # optimizers.py: optim="muon"; None -> the Trainer's own
            self.optimizer = build_optimizer(self, self.model if model is None else model)
        optimizer = super().create_optimizer(model)
        return guard_optimizer(optimizer, self.loss_guard) if self.loss_guard is not None else optimizer

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
        scheduler_created(self)
        return self.lr_scheduler

    def get_train_dataloader(self):
        build = super().get_train_dataloader
        if not self.extras:
            return build()
        with training_batches(self):  # sequence_parallel.py: position_ids in every batch under SP
            return self.data_position.build_dataloader(build)

    def create_accelerator_and_postprocess(self) -> None:
        if not getattr(self.args, "pretrain_extras", True):  # called by Trainer.__init__, before self.extras
            return super().create_accelerator_and_postprocess()
        with fsdp_on_cpu(self.args):  # fsdp.py: accelerate applies FSDP on a CPU (gloo) process group too
            super().create_accelerator_and_postprocess()

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if self.extras and not _internal_call:  # resume/store.py: the final save written beside, moved into place
            barrier = lambda: wait_for_everyone(self.accelerator)  # noqa: E731
            save_into_place(self._save_whole_model, output_dir or self.args.output_dir, self.args.should_save, barrier)
            if self.args.push_to_hub:
                self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)
            return None
        if self.extras and sharded_saves(self):  # fsdp.py: Trainer would save a checkpoint's weights, not its config
            save_config(self, output_dir)
        return super().save_model(output_dir, _internal_call)

    def _save_whole_model(self, output_dir: str) -> None:
        if sharded_saves(self):  # fsdp.py: Trainer would save no weights under sharded state dicts
            return save_full_weights(self, output_dir)
        return super().save_model(output_dir, _internal_call=True)  # pushed, if at all, once moved into place

    def evaluate(self, *args, **kwargs):
        with high_precision(self.model):  # evaluation never runs the low-precision path
            if not self.extras:
                return super().evaluate(*args, **kwargs)
            with lm_eval_metrics(self), self.recovery.phase("eval"):
                metrics = super().evaluate(*args, **kwargs)
        if not self._attached:  # outside train(): no telemetry callback heard the log
            record_outside_train(self, metrics)
        return metrics

    def predict(self, *args, **kwargs):
        with high_precision(self.model):
            return super().predict(*args, **kwargs)

    def evaluation_loop(self, *args, **kwargs):
        if not self.extras:
            return super().evaluation_loop(*args, **kwargs)
        with gathered_once_per_group(self):  # tensor_parallel.py: a TP group's outputs gathered once
            return super().evaluation_loop(*args, **kwargs)
