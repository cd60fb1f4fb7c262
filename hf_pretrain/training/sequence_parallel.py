"""DeepSpeed Ulysses sequence parallelism (`ParallelismConfig(sp_size=N)`, `sp_backend="deepspeed"`) under
`PretrainTrainer`.

transformers' Trainer and accelerate carry the mechanism: `Accelerator.prepare` registers DeepSpeed's
`UlyssesSPAttentionHF` in place of the model's attention kernel in `ALL_ATTENTION_FUNCTIONS` (an all-to-all turns
each rank's sequence shard of all heads into the whole sequence of its share of the heads, and back), the Trainer
wraps the training loader in `UlyssesSPDataLoaderAdapter` (every tensor of a batch cut along dim 1, `position_ids`
included, which the attention all-gathers back; `labels` become pre-shifted `shift_labels`), and
`deepspeed_sp_compute_loss` takes the token-weighted mean of the shards' losses over the SP group. What is left,
done here so that a `parallelism_config` with `sp_size > 1` (an argument, or the launch config's
`parallelism_config_*` keys) is all a user writes:

1. DeepSpeed's own communication layer must be up before `prepare` (`initialize_sequence_parallel` asserts
   `deepspeed.comm.is_initialized()`). accelerate starts it only for a DeepSpeed process on an accelerator; on a
   CPU (`use_cpu`) it starts plain torch gloo. `init_distributed` here adopts the process group already there, with
   its backend: gloo on a CPU. CUDA/NCCL assumption: there accelerate's `PartialState` has already called
   `deepspeed.comm.init_distributed("nccl")` (the DeepSpeed branch of a launched process), so this is a no-op; if
   no group exists yet (a launcher-less process), DeepSpeed picks the accelerator's backend (nccl on CUDA) itself.
   The SP group is then a sub-group of that world group, on the same backend: every all-to-all of the attention runs
   on NCCL, so each rank must have its CUDA device set before (accelerate's `set_device` does, from LOCAL_RANK).
2. The SP kernel follows the model: `DeepSpeedSequenceParallelConfig.sp_attn_implementation` is set to
   `model.config._attn_implementation` (accelerate leaves it None outside `accelerate launch`, and DeepSpeed refuses a
   mismatch); an explicitly different one is refused. The parallelism config is copied, never written to.
   After the attention preflight pins the plan, every layer type must run exactly that kernel: Ulysses wraps one
   entry of `ALL_ATTENTION_FUNCTIONS`, and a layer on another kernel would attend within its shard, silently.
3. `position_ids` in every training batch (the adapter refuses a batch without them): `PositionIds` wraps the
   collator for the training loader only and adds 0..T-1 per row when the collator gives none.

Refused in one line before any work (`check_arguments` in `PretrainingArguments`, `check_trainer` at the end of
`PretrainTrainer.__init__`, `check_attention_plan` after the preflight), each found by running it or by reading the
code that would run (the windows, packed documents and MoE lines by running them):
- SP without DeepSpeed, an SP size that does not divide the processes, ZeRO stages other than 3 (the only one
  checked against one process; DeepSpeed averages or sums the SP group's gradients differently per stage and
  version, see transformers' `deepspeed_sp_compute_loss`);
- heads not divisible (`num_attention_heads % sp`, and `num_key_value_heads` neither a multiple nor a divisor of
  `sp`: DeepSpeed's rule), a sequence length not divisible by `sp` (the adapter's rule);
- sliding windows and packed documents: the Ulysses wrapper drops the attention mask (built for the local shard)
  and SDPA then runs plain causal attention over the whole sequence, across windows and document boundaries. The
  document boundaries do reach the kernel (DeepSpeed all-gathers `position_ids` and passes them on, and RoPE
  restarts per document on every shard), but SDPA reads only the mask, never the positions. Measured with the
  refusals lifted (2 gloo ranks, ZeRO-3, tiny preset of 2 layers, 8 rows of 32 tokens, 6 steps, against one
  process; the plain SP run agrees within 4.8e-7): windows (`window_pattern="SL"`, `sliding_window=8`) differ by
  7.7e-3 on the first step's loss (same weights) and up to 1.9e-2 by step 4; packed documents
  (`PackedDocumentCollator`, ~4.7 documents a row) by 9.6e-3 on the first step and up to 7.5e-2 by step 4 (lower
  from step 3: each token also sees the documents before it);
- mixture of experts: the router's auxiliary (load-balancing) loss is computed on each shard and averaged
  token-weighted, not the loss of the whole sequence. Measured the same way (4 experts, top-2, coefficient 0.01):
  the first step's aux loss is 1.00470 for the whole rows and 1.00813 / 1.00321 on the two halves (mean 1.00567,
  +9.7e-4), the loss +1.1e-5 (the z-loss is a per-token mean, exact), up to 2.9e-4 within 6 steps;
- FlashAttention: hf_pretrain's model passes `cu_seqlens` of the local shard to FA layers when batches carry
  `position_ids` (model.py `_flash_varlen_kwargs`), wrong after the all-to-all; GPU-only, not yet checked.
Left to the Trainer: the chunked loss needs nothing (it takes `shift_labels`; the Trainer turns off
`num_items_in_batch` under SP and weights by the shards' target counts). With gradient accumulation each micro-batch
is a per-token mean, averaged over micro-batches: exact for rows without padding.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os

import torch

from ..modeling.accounting import SLIDING

CHECKED_KERNELS = ("sdpa",)  # run against one process here (CPU gloo); FlashAttention: see the module docstring


def sequence_parallel_config(args):
    """The run's `ParallelismConfig` when it asks for sequence parallelism (sp_size > 1), else None: the argument, or
    the one accelerate builds from a launch config's `parallelism_config_*` keys (environment)."""
    config = getattr(args, "parallelism_config", None)
    if config is None and os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() == "true":
        from accelerate import ParallelismConfig

        config = ParallelismConfig()
    return config if config is not None and config.sp_size > 1 else None


def _refuse(sp: int, problem: str, fix: str) -> None:
    raise ValueError(f"parallelism_config.sp_size={sp}: {problem}; {fix} (docs/distributed.md).")


def check_arguments(args) -> None:
    """What the arguments alone say breaks under SP: no DeepSpeed, an SP size that does not divide the processes."""
    config = sequence_parallel_config(args)
    if config is None:
        return
    sp = config.sp_size
    deepspeed = args.deepspeed or os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    if not deepspeed:
        _refuse(
            sp,
            "Ulysses sequence parallelism runs inside DeepSpeed (sp_backend='deepspeed')",
            "pass --deepspeed ds_configs/zero3.json",
        )
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world % sp:
        _refuse(sp, f"it does not divide the {world} processes", f"launch a multiple of {sp} processes")


def check_trainer(trainer) -> None:
    """Refuse what breaks under SP (module docstring), then bring up DeepSpeed's communication and name the kernel."""
    config = sequence_parallel_config(trainer.accelerator) or sequence_parallel_config(trainer.args)
    if config is None:
        return
    from ..telemetry.throughput import sequence_length

    zero = trainer.accelerator.state.deepspeed_plugin.zero_stage if trainer.is_deepspeed_enabled else None
    kernel = check_run(config, trainer.model, trainer.data_collator, sequence_length(trainer), zero)
    _init_deepspeed_comm()
    config = copy.copy(config)  # the user's config stays theirs
    config.sp_handler = dataclasses.replace(config.sp_handler, sp_attn_implementation=kernel)
    trainer.accelerator.state.parallelism_config = config


def check_run(config, model, collator, seq_len: int | None, zero_stage: int | None) -> str:
    """The SP kernel (the model's), or the one line that says what breaks: DeepSpeed stage, heads, windows, MoE,
    packed documents, sequence length, kernel."""
    sp = config.sp_size
    if zero_stage != 3:
        _refuse(sp, "checked only with DeepSpeed ZeRO-3", "use ds_configs/zero3.json")
    text = model.config.get_text_config()
    heads, kv = text.num_attention_heads, text.num_key_value_heads
    if heads % sp or (kv % sp and sp % kv):
        _refuse(
            sp,
            f"num_attention_heads={heads} must be divisible by it and num_key_value_heads={kv} a multiple or a divisor",
            "pick an sp_size that divides the heads",
        )
    if SLIDING in (getattr(text, "layer_types", None) or []):
        _refuse(
            sp,
            "sliding windows would attend over the whole sequence (Ulysses drops the mask)",
            "use window_pattern='L'",
        )
    if getattr(text, "num_experts", 0):
        _refuse(sp, "MoE's router loss would be computed per sequence shard", "train MoE without SP")
    from .wiring import packed_documents

    if packed_documents(collator):
        _refuse(
            sp,
            "packed documents would attend across their boundaries (Ulysses drops the mask; SDPA runs plain causal)",
            "collate with separate_documents=False",
        )
    if seq_len and seq_len % sp:
        _refuse(sp, f"the sequence length {seq_len} is not divisible by it", f"use a multiple of {sp} tokens per row")
    kernel = model.config._attn_implementation
    wanted = config.sp_handler.sp_attn_implementation
    if wanted not in (None, kernel):
        _refuse(
            sp,
            f"sp_attn_implementation={wanted!r} but the model runs {kernel!r}",
            f"set it to {kernel!r} or leave it unset",
        )
    if kernel not in CHECKED_KERNELS:
        _refuse(
            sp,
            f"the model's attention {kernel!r} is not checked under SP",
            "load the model with attn_implementation='sdpa'",
        )
    return kernel


def _init_deepspeed_comm() -> None:
    """DeepSpeed's communication layer on the process group already up (gloo on a CPU; module docstring, 1.)."""
    import deepspeed.comm

    if not deepspeed.comm.is_initialized():
        backend = torch.distributed.get_backend() if torch.distributed.is_initialized() else None
        deepspeed.comm.init_distributed(dist_backend=backend, auto_mpi_discovery=False)


def check_attention_plan(trainer) -> None:
    """After the preflight pinned the plan: every layer type on the one kernel Ulysses wraps."""
    config = trainer.accelerator.parallelism_config
    plan = getattr(trainer.model, "attention_plan", None)
    if config is None or not config.sp_enabled or not plan:
        return
    kernel = config.sp_handler.sp_attn_implementation
    others = sorted({choice.backend for choice in plan.values()} - {kernel})
    if others:
        _refuse(
            config.sp_size,
            f"the attention plan runs {others}, but Ulysses wraps only {kernel!r}",
            f"load the model with attn_implementation={kernel!r}",
        )


@dataclasses.dataclass
class PositionIds:
    """The training collator, plus `position_ids` 0..T-1 per row when it gives none (Ulysses needs them)."""

    collator: object

    def __call__(self, features):
        batch = self.collator(features)
        if "position_ids" not in batch:
            rows, length = batch["input_ids"].shape
            batch["position_ids"] = torch.arange(length).expand(rows, length).clone()
        return batch


@contextlib.contextmanager
def training_batches(trainer):
    """While the training loader is built: its collator adds `position_ids` under SP."""
    config = trainer.accelerator.parallelism_config
    if config is None or not config.sp_enabled:
        yield
        return
    collator = trainer.data_collator
    trainer.data_collator = PositionIds(collator)
    try:
        yield
    finally:
        trainer.data_collator = collator
