"""`PretrainTrainer`: a drop-in `transformers.Trainer` for pretraining from scratch.

Any script that runs with `Trainer(model=..., args=..., train_dataset=..., data_collator=...)` runs
unchanged with `PretrainTrainer`; with `args.pretrain_extras=False` it is `Trainer`, to the loss.
With extras on (the default) it:
- counts tokens seen (real tokens: transformers' own counter, gathered over ranks, logged as
  `num_input_tokens_seen`; `"non_padding"` for plain `TrainingArguments`, and every token for a
  collator that never pads, such as `PackedDocumentCollator`);
- adds the telemetry callbacks (`hf_pretrain.telemetry`) and merges what they measured into every
  training log: tokens/s global and per rank, step time, model TFLOP/s, MFU against the spec
  peak and a measured ceiling, ETA (`ThroughputCallback`); with `args.telemetry` also clocks,
  power, memory (`HardwareSensorsCallback`), under-clock warnings (`UnderclockCallback`),
  per-rank compute / wait and the slow rank (`StragglerCallback`), all of it written to
  `telemetry.jsonl` (`JsonlCallback`) as well as to `report_to`;
- refuses to train as one process when the launcher started several (WORLD_SIZE > 1 but the
  Trainer sees world_size 1, e.g. a GPU launch config on a CPU-only machine): silent
  single-process training wastes the other ranks;
- runs the attention preflight at the start of `train()` for hf_pretrain models: it fixes (pins)
  the kernel of each layer type for this device, dtype and collator (packed documents or not),
  writes `preflight.json` to the output dir and applies `args.attn_fallback` (warn / error /
  ignore). A fallback warning is repeated in the first logged metrics as `attention_fallback`,
  with `attention_step_cost_vs_best` (estimated step time against the best kernels here).
- guards every update (`LossGuardCallback`): a NaN/inf loss or gradient skips the optimizer step,
  a loss spike is logged, skipped or stops the run (`args.loss_spike_action`);
- applies `args.precision` (`hf_pretrain.precision`): converts the selected linears before the
  optimizer exists, prints which were converted or kept and why, and runs `evaluate()` and saving
  with plain linears (`high_precision`).
It is the one place where hf_pretrain attaches its callbacks, schedules and preflight checks.
"""

from __future__ import annotations

import os
import time

import torch
from transformers import DataCollatorWithFlattening, Trainer

from ..modeling.attention import Environment, plan_attention
from ..precision import apply_precision, high_precision
from ..precision.recipes import LOW_PRECISION
from ..preflight.attention import AttentionReport, attention_preflight, enforce_attention_policy
from ..telemetry.hardware import HardwareSensorsCallback
from ..telemetry.jsonl import JsonlCallback
from ..telemetry.straggler import StragglerCallback
from ..telemetry.throughput import ThroughputCallback
from ..telemetry.underclock import UnderclockCallback
from .arguments import PretrainingArguments
from .loss_guard import LossGuardCallback, injected
from .schedules import build_schedule


class PretrainTrainer(Trainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.extras = getattr(self.args, "pretrain_extras", True)
        self.attention_report: AttentionReport | None = None
        self._pending_preflight_logs: dict = {}
        self.precision_report = None
        self.loss_guard = None
        self._micro_batch_timers: list = []
        if not self.extras:
            return
        if getattr(self.args, "loss_guard", True):
            self.loss_guard = LossGuardCallback(
                getattr(self.args, "loss_spike_factor", 3.0),
                getattr(self.args, "loss_spike_window", 20),
                getattr(self.args, "loss_spike_action", "log"),
                self.args.output_dir,
            )
            self.loss_guard.model = self.model
            self.add_callback(self.loss_guard)
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
        if not isinstance(self.args, PretrainingArguments) and self.args.include_num_input_tokens_seen in ("no", False):
            self.args.include_num_input_tokens_seen = "non_padding"  # plain TrainingArguments default off
        if (
            getattr(self.data_collator, "has_padding", True) is False
            and self.args.include_num_input_tokens_seen != "no"
        ):
            self.args.include_num_input_tokens_seen = "all"  # nothing to subtract, and no pad id to look for
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        if launched != self.args.world_size:
            raise RuntimeError(
                f"The launcher started {launched} processes but the Trainer runs with world_size={self.args.world_size}. "
                "On a CPU-only machine pass use_cpu=True (PretrainingArguments does it by default) so the ranks join over gloo."
            )

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.extras and "loss" in logs:
            for callback in self.callback_handler.callbacks:
                if hasattr(callback, "metrics_for_log"):
                    logs.update(callback.metrics_for_log(self.state))
            logs.update(self._pending_preflight_logs)
            self._pending_preflight_logs = {}
        super().log(logs, start_time)

    def training_step(self, model, inputs, *args, **kwargs):
        timers = self._micro_batch_timers  # found once per train(), not per micro-batch
        start = time.perf_counter()
        for timer in timers:
            timer.before_micro_batch()  # (the test knob's sleep counts as this rank's compute)
        loss = super().training_step(model, inputs, *args, **kwargs)
        end = time.perf_counter()
        for timer in timers:
            timer.record_micro_batch(start, end)
        if self.loss_guard is not None:
            self.loss_guard.record_loss(loss)
        return loss

    def compute_loss(self, model, inputs, *args, **kwargs):
        result = super().compute_loss(model, inputs, *args, **kwargs)
        kind = injected(self.state.global_step + 1) if self.extras and model.training else None
        if kind is None:  # the test-only knob of the loss guard
            return result
        loss = result[0] if isinstance(result, tuple) else result
        loss = loss * float("nan") if kind == "nan" else loss * 50.0
        return (loss, *result[1:]) if isinstance(result, tuple) else loss

    def create_optimizer(self, *args, **kwargs):
        optimizer = super().create_optimizer(*args, **kwargs)
        guard = self.loss_guard
        if guard is not None and not getattr(optimizer, "_loss_guarded", False):
            step = optimizer.step

            def guarded_step(*step_args, **step_kwargs):
                if guard.skip_next_update:  # a NaN/inf or spiking step: no update at all
                    guard.skip_next_update = False
                    return None
                return step(*step_args, **step_kwargs)

            optimizer.step = guarded_step
            optimizer._loss_guarded = True
        return optimizer

    def evaluate(self, *args, **kwargs):
        with high_precision(self.model):  # evaluation never runs the low-precision path
            return super().evaluate(*args, **kwargs)

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

    def train(self, *args, **kwargs):
        if self.extras:
            self.run_attention_preflight()
            self._attach_telemetry()
        return super().train(*args, **kwargs)

    def _attach_telemetry(self) -> None:
        """(Re)attach hf_pretrain's callbacks for this `train()` call."""
        ours = (ThroughputCallback, HardwareSensorsCallback, UnderclockCallback, StragglerCallback, JsonlCallback)
        for callback in [c for c in self.callback_handler.callbacks if isinstance(c, ours)]:
            self.remove_callback(callback)
        args = self.args
        get = lambda name, default: getattr(args, name, default)  # noqa: E731  (plain TrainingArguments lack them)
        callbacks = [
            ThroughputCallback(self._sequence_length(), get("peak_tflops", None), get("measure_peak_tflops", True))
        ]
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
        for callback in callbacks:
            self.add_callback(callback)
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

    def _sequence_length(self) -> int:
        """Tokens per row of the training data (the first row), or the model's maximum context."""
        try:
            return len(self.train_dataset[0]["input_ids"])
        except (TypeError, KeyError, IndexError, NotImplementedError):  # iterable or unusual datasets
            return self.model.config.max_position_embeddings
