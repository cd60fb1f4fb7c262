"""What `PretrainTrainer` builds from its arguments: the loss guard, the callbacks of a `train()` call, the
precision recipe, the attention and memory preflights and the compile scope.

Plain `TrainingArguments` lack hf_pretrain's fields: each callback reads its own with the defaults it owns
(`PretrainCallback.arguments`, which `PretrainingArguments` declares its fields from), so a `Trainer` script gets
the extras unchanged.
"""

from __future__ import annotations

import torch
from transformers import DataCollatorWithFlattening
from transformers.utils import logging

from ..callback import PretrainCallback
from ..evaluation import GenerationProbeCallback
from ..evaluation.downstream.callback import DownstreamEvalCallback
from ..evaluation.downstream.cost import DownstreamCostCallback
from ..modeling.attention import Environment, plan_attention
from ..precision import apply_precision
from ..precision.recipes import RECIPES
from ..preflight.attention import AttentionReport, attention_preflight, enforce_attention_policy
from ..preflight.memory import MemoryCheck, RunShape, check_memory, enforce_memory_policy, model_bytes
from ..telemetry.compile import CompileCallback
from ..telemetry.goodput import GoodputCallback
from ..telemetry.hardware import HardwareSensorsCallback
from ..telemetry.jsonl import JsonlCallback
from ..telemetry.mixture import MixtureCallback
from ..telemetry.moe import MoECallback
from ..telemetry.straggler import StragglerCallback
from ..telemetry.throughput import ThroughputCallback, precision_of, sequence_length, torchao_scaling
from ..telemetry.underclock import UnderclockCallback
from .compile import compile_blocks, compile_kwargs, prepare_compile
from .recovery.room import RecoveryCallback
from .tensor_parallel import tensor_parallel_size

logger = logging.get_logger(__name__)


def _get(args, name, default):
    return getattr(args, name, default)


def precision_from_arguments(trainer):
    """Convert the model's linears for `args.precision` (before the optimizer exists) and print what was kept."""
    args = trainer.args
    recipe = RECIPES.get(_get(args, "precision", None))
    if recipe is None or not recipe.converts_linears:
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


# The callbacks a train() call may attach, in order: each builds itself from the arguments (or declines); the
# under-clock, straggler, goodput and JSONL callbacks follow the sensors' `telemetry` switch and share their reading;
# the recovery callback beats the hang watchdog.
RUN_CALLBACKS: tuple[type[PretrainCallback], ...] = (
    ThroughputCallback,
    MoECallback,
    HardwareSensorsCallback,
    UnderclockCallback,
    StragglerCallback,
    GoodputCallback,
    MixtureCallback,
    JsonlCallback,
    GenerationProbeCallback,
    DownstreamEvalCallback,
    DownstreamCostCallback,
    RecoveryCallback,
)


def callbacks_from_arguments(trainer) -> list[PretrainCallback]:
    """The callbacks of one `train()` call that the arguments ask for (the loss guard is built with the trainer)."""
    built: list[PretrainCallback] = []
    for kind in RUN_CALLBACKS:
        callback = kind.from_arguments(trainer, built)
        if callback is not None:
            built.append(callback)
    return built


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
    plan = plan_attention(model.config, env, packed)  # the one plan of the run: reported, then pinned
    report = attention_preflight(model.config, sequence_length(trainer), env, packed, plan)
    model.set_attention_plan(plan, pin=True)
    policy = _get(args, "attn_fallback", "warn")
    main = trainer.is_world_process_zero()
    precision = {
        "recipe": _get(args, "precision", None),
        "matmuls": precision_of(args, model),
        "scaling": torchao_scaling(args),
    }
    enforce_attention_policy(
        report,
        policy if main or policy == "error" else "ignore",
        args.output_dir if main else None,
        {"precision": precision},
    )
    pending = {}
    if report.warnings and policy == "warn":
        pending = {
            "attention_fallback": " | ".join(report.warnings),
            "attention_step_cost_vs_best": round(report.step_cost_vs_best, 3),
        }
    return report, pending


def memory_preflight_for(trainer) -> MemoryCheck | None:
    """An hf_pretrain model's estimated memory against what is free on the run's device or host, before the first
    step (`preflight/memory.py`): refused or warned of per `memory_preflight`."""
    report, args, model = trainer.attention_report, trainer.args, trainer.model
    policy = _get(args, "memory_preflight", "error")
    seq_len = sequence_length(trainer)
    if report is None or policy == "ignore" or not seq_len:
        return None
    micro = args.per_device_train_batch_size
    if hasattr(trainer.train_dataset, "__len__"):
        micro = max(1, min(micro, len(trainer.train_dataset)))
    zero, fsdp2, offload = 0, False, False
    if trainer.is_deepspeed_enabled:
        plugin = trainer.accelerator.state.deepspeed_plugin
        zero = plugin.zero_stage
        device = plugin.deepspeed_config.get("zero_optimization", {}).get("offload_optimizer", {}).get("device")
        offload = zero >= 1 and device in ("cpu", "nvme")
    elif trainer.is_fsdp_enabled:
        cpu_offload = trainer.accelerator.state.fsdp_plugin.cpu_offload  # FSDP1: CPUOffload; FSDP2: an OffloadPolicy
        if getattr(cpu_offload, "offload_params", False) or type(cpu_offload).__name__ == "CPUOffloadPolicy":
            return None  # FSDP's CPU offload is not modelled by the estimator
        zero, fsdp2 = 3, True
    plan = {row.layer_type: row for row in report.rows}
    sp = trainer.get_sp_size()  # Ulysses (sequence_parallel.py, pinned before this runs): 1/sp of each sequence
    tp = tensor_parallel_size(trainer)  # AutoTP (tensor_parallel.py): 1/tp of each split linear per rank
    sharding = dict(zero=zero, fsdp2=fsdp2, offload=offload, sp=sp, tp=tp)
    shape = RunShape.of_run(args, model.config, plan, seq_len, micro, **sharding)
    check = check_memory(model.config, shape, args.device, held=model_bytes(model, args.device))
    main = trainer.is_world_process_zero()
    enforce_memory_policy(check, policy if main or policy == "error" else "ignore", logger.warning)
    return check
