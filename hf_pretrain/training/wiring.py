"""What `PretrainTrainer` builds from its arguments: the loss guard, the callbacks of a `train()` call, the
precision recipe, the attention preflight and the compile scope.

Plain `TrainingArguments` lack hf_pretrain's fields: each is read with its default (`PretrainingArguments`
declares the same defaults), so a `Trainer` script gets the extras unchanged.
"""

from __future__ import annotations

import torch
from transformers import DataCollatorWithFlattening

from ..callback import PretrainCallback
from ..evaluation import GenerationProbeCallback, parse_prompt
from ..modeling.attention import Environment, plan_attention
from ..precision import apply_precision
from ..precision.recipes import LOW_PRECISION
from ..preflight.attention import AttentionReport, attention_preflight, enforce_attention_policy
from ..preflight.compile import CompileCallback
from ..telemetry.hardware import HardwareSensorsCallback
from ..telemetry.jsonl import JsonlCallback
from ..telemetry.moe import MoECallback
from ..telemetry.straggler import StragglerCallback
from ..telemetry.throughput import ThroughputCallback
from ..telemetry.underclock import UnderclockCallback
from .compile import compile_blocks, compile_kwargs, prepare_compile
from .loss_guard import LossGuardCallback


def _get(args, name, default):
    return getattr(args, name, default)


def loss_guard_from_arguments(args, model) -> LossGuardCallback | None:
    if not _get(args, "loss_guard", True):
        return None
    guard = LossGuardCallback(
        _get(args, "loss_spike_factor", 3.0),
        _get(args, "loss_spike_window", 20),
        _get(args, "loss_spike_action", "log"),
        args.output_dir,
        _get(args, "loss_spike_lr_factor", 0.5),
        _get(args, "loss_spike_max_rollbacks", 3),
    )
    guard.model = model
    return guard


def precision_from_arguments(trainer):
    """Convert the model's linears for `args.precision` (before the optimizer exists) and print what was kept."""
    args = trainer.args
    if _get(args, "precision", None) not in LOW_PRECISION:
        return None
    report = apply_precision(
        trainer.model,
        args.precision,
        scaling=args.precision_scaling,
        min_features=args.precision_min_features,
        keep_first_last_blocks=args.precision_keep_first_last,
        device=args.device,
    )
    if trainer.is_world_process_zero():
        print(report.summary(), flush=True)
    return report


def callbacks_from_arguments(trainer, tokens_seen) -> list[PretrainCallback]:
    """The callbacks of one `train()` call: throughput always, MoE load for MoE models, sensors, under-clock,
    straggler and the JSONL stream with `telemetry`, the generation probe with `probe_prompts`."""
    args = trainer.args
    callbacks: list[PretrainCallback] = [
        ThroughputCallback(
            sequence_length(trainer),
            _get(args, "peak_tflops", None),
            _get(args, "measure_peak_tflops", True),
            tokens_seen,
        )
    ]
    experts = getattr(getattr(trainer.model, "config", None), "num_experts", 0)
    if experts and not any(isinstance(c, MoECallback) for c in trainer.callback_handler.callbacks):
        callbacks.append(MoECallback(trainer.model))  # expert load, aux / z losses, dropped tokens in the logs
    if _get(args, "telemetry", True):
        sensors = HardwareSensorsCallback(every=args.logging_steps if args.logging_strategy == "steps" else 10)
        underclock = _get(args, "underclock_threshold", 0.6)
        straggler = StragglerCallback(
            _get(args, "straggler_every", 20), _get(args, "straggler_threshold", 0.75), sensors, underclock
        )
        straggler.trainer = trainer
        callbacks += [sensors, UnderclockCallback(sensors, underclock), straggler, JsonlCallback(args.output_dir)]
    if _get(args, "probe_prompts", None) and (_get(args, "probe_every", 0) > 0 or _get(args, "probe_at_end", True)):
        callbacks.append(
            GenerationProbeCallback(
                [parse_prompt(p) for p in args.probe_prompts],
                args.probe_every,
                args.probe_max_new_tokens,
                tokenizer=trainer.processing_class,
                at_end=args.probe_at_end,
            )
        )
    return callbacks


def compile_from_arguments(trainer) -> CompileCallback | None:
    """With `torch_compile`: prepare the model for Dynamo, compile its blocks in place for
    `torch_compile_scope='blocks'` (accelerate compiles the whole model otherwise), and the callback that
    reports the compile time."""
    args = trainer.args
    if not args.torch_compile:
        return None
    scope = _get(args, "torch_compile_scope", "model")
    prepare_compile(trainer.model)
    blocks = compile_blocks(trainer.model, **compile_kwargs(args)) if scope == "blocks" else None
    return CompileCallback(scope, compile_kwargs(args)["backend"], blocks, print_report=trainer.is_world_process_zero())


def sequence_length(trainer) -> int | None:
    """Tokens per row of the training data (the first row), else the model's maximum context, else None."""
    try:
        row = trainer.train_dataset[0]
        return len(row[getattr(trainer.model, "main_input_name", "input_ids")])
    except Exception:  # iterable or unusual datasets, rows without input ids: fall back to the config
        return getattr(getattr(trainer.model, "config", None), "max_position_embeddings", None)


def packed_documents(collator) -> bool:
    """Whether training batches hold several documents per row (position ids restarting)."""
    declared = getattr(collator, "packed_documents", None)
    return bool(declared) if declared is not None else isinstance(collator, DataCollatorWithFlattening)


def attention_preflight_for(trainer) -> tuple[AttentionReport | None, dict]:
    """Plan the attention kernels of an hf_pretrain model for this run, pin them, report them, apply
    `attn_fallback`; returns the report and the fallback warning to repeat in the first log."""
    model, args = trainer.model, trainer.args
    if not hasattr(model, "set_attention_plan"):
        return None, {}
    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else model.dtype
    env = Environment.detect(args.device, dtype, training=True)
    packed = packed_documents(trainer.data_collator)
    report = attention_preflight(model.config, sequence_length(trainer), env, packed)
    model.set_attention_plan(plan_attention(model.config, env, packed), pin=True)
    policy = _get(args, "attn_fallback", "warn")
    main = trainer.is_world_process_zero()
    enforce_attention_policy(
        report, policy if main or policy == "error" else "ignore", args.output_dir if main else None
    )
    pending = {}
    if report.warnings and policy == "warn":
        pending = {
            "attention_fallback": " | ".join(report.warnings),
            "attention_step_cost_vs_best": round(report.step_cost_vs_best, 3),
        }
    return report, pending
