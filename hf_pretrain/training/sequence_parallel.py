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
3. The mask. DeepSpeed's wrapper drops the model's attention mask (built for the local shard; a whole one would be
   s x s, it says) and calls the kernel with the whole sequence of 1/sp of the heads and the all-gathered
   `position_ids`. Stock SDPA would then run plain causal attention over the whole row, across windows and document
   boundaries (measured: the first step's loss 7.7e-3 off for windows, 9.6e-3 for packed documents). So
   `check_trainer` registers `FullSequenceSdpa` as the SP kernel before `prepare` (which wraps whatever the registry
   holds): it rebuilds each layer's mask from the gathered positions with the model's own builder (a document where
   the positions restart, the layer's `sliding_window`, causal). Against one process (2 gloo ranks, ZeRO-3, a window
   layer and a full one over ~4.6 packed documents a row, 6 steps) the losses agree within 9.5e-7, as plain SP's
   do (4.8e-7): tests/distributed/test_sequence_parallel.py. The cost is the one-process run's: a dense s x s
   boolean mask per layer type for rows with windows or documents (see `FullSequenceSdpa`); plain rows get none.
   With Ulysses off in evaluation (`sp_disable_in_eval`, the default; False is refused: evaluation batches are whole
   rows, which Ulysses' shape check rejects) the wrapper still drops the mask, and the same rebuild from the local
   positions keeps windows and documents there too. So evaluation runs data parallel over every rank: the Trainer's
   `evaluate()` and the downstream suite score disjoint shares of whole rows.
4. `position_ids` in every training batch (the adapter refuses a batch without them): `PositionIds` wraps the
   collator for the training loader only and adds 0..T-1 per row when the collator gives none. The padding mask is
   dropped as well: right padding needs none (a causal query never sees the padding after it), left padding is
   refused in one line by the same wrapper.
5. Mixture of experts. The router's load-balancing loss is a product of two means over the tokens (the share routed
   to each expert, the mean router probability): computed on each shard, it is the shard's, not the rows' (measured
   before, 2 gloo ranks, 4 experts top-2: 1.00813 and 1.00321 on the halves against 1.00470 for the whole rows; the
   loss 1.1e-5 off in the first step, 2.9e-4 within 6). `check_trainer` hands the model the SP group
   (`router_group`), and `modeling/moe.routing_statistics` sums the expert counts, the router probabilities (a
   differentiable all-reduce: each rank's router gets the whole loss's gradient) and the token counts over it: two
   all-reduces of (MoE layers x experts) floats a micro-batch, in training forwards only. The z-loss is a per-token
   mean, exact under the Trainer's token weighting. Expert capacity (`moe_capacity_factor`) stays per forward, so
   per shard under SP, as it is per rank under DDP. The ZeRO-3 gradient arithmetic (`deepspeed_sp_compute_loss`
   scales each rank's local sum by sp and ZeRO-3 averages over the group) gives the routers the whole loss's gradient
   once: the all-reduce's backward sums the ranks' token-weighted shares, which add up to one.
6. The data-parallel size. With more processes than `sp_size` (e.g. SP 2 on 8 GPUs: 4 data-parallel groups)
   accelerate sizes DeepSpeed's `train_batch_size` as micro x accumulation x the config's `data_parallel_size`
   (`dp_replicate_size x dp_shard_size`, 1 unless the user names it) and skips its own size check for DeepSpeed SP;
   DeepSpeed then asserts "train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step * world_size
   4 != 4 * 1 * 2.0" at the first `prepare` (4 gloo ranks, SP 2). The copied config gets `dp_shard_size` = world /
   sp when it names no data-parallel size; a product that does not match the processes is refused.

Refused in one line before any work (`check_arguments` in `PretrainingArguments`, `check_trainer` at the end of
`PretrainTrainer.__init__`, `check_attention_plan` after the preflight), each found by running it or by reading the
code that would run:
- `sp_disable_in_eval=False` (above, 3.);
- SP without DeepSpeed, an SP size that does not divide the processes, ZeRO stages other than 3 (the only one
  checked against one process; DeepSpeed averages or sums the SP group's gradients differently per stage and
  version, see transformers' `deepspeed_sp_compute_loss`);
- heads not divisible (`num_attention_heads % sp`, and `num_key_value_heads` neither a multiple nor a divisor of
  `sp`: DeepSpeed's rule), a sequence length not divisible by `sp` (the adapter's rule);
- FlashAttention: hf_pretrain's model passes `cu_seqlens` of the local shard to FA layers when batches carry
  `position_ids` (model.py `_flash_varlen_kwargs`), wrong after the all-to-all; GPU-only, not yet checked (the
  mask rebuild above is SDPA's).
Left to the Trainer: the chunked loss needs nothing (it takes `shift_labels`; the Trainer turns off
`num_items_in_batch` under SP and weights by the shards' target counts). With gradient accumulation each micro-batch
is a per-token mean, averaged over micro-batches: exact for rows without padding.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import os
import weakref

import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..modeling.accounting import FULL, SLIDING
from ..modeling.attention import build_attention_masks

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
    kernel = check_run(config, trainer.model, sequence_length(trainer), zero)
    _init_deepspeed_comm()
    ALL_ATTENTION_FUNCTIONS[kernel] = FullSequenceSdpa()  # what Ulysses wraps at `prepare` (module docstring, 3.)
    if hasattr(trainer.model, "router_group"):  # MoE: the router's loss over the whole rows (module docstring, 5.)
        trainer.model.router_group = sequence_parallel_group
    config = copy.copy(config)  # the user's config stays theirs
    config.sp_handler = dataclasses.replace(config.sp_handler, sp_attn_implementation=kernel)
    config.dp_shard_size = data_parallel_groups(config, trainer.args.world_size)
    trainer.accelerator.state.parallelism_config = config


def data_parallel_groups(config, world: int) -> int:
    """The data-parallel size DeepSpeed's batch check needs (module docstring, 6.): world / sp when the config names
    none, else the one it names if it matches."""
    sp, named = config.sp_size, config.dp_replicate_size * config.dp_shard_size
    if named * sp == world:
        return config.dp_shard_size
    if named == 1:
        return world // sp
    _refuse(
        sp,
        f"dp_replicate_size={config.dp_replicate_size} x dp_shard_size={config.dp_shard_size} x sp_size={sp} is not "
        f"the {world} processes",
        f"leave the data-parallel sizes at 1 (hf_pretrain sets dp_shard_size={world // sp}) or make the product {world}",
    )


def check_run(config, model, seq_len: int | None, zero_stage: int | None) -> str:
    """The SP kernel (the model's), or the one line that says what breaks: DeepSpeed stage, heads, sequence length,
    kernel. Windows and packed documents pass (`FullSequenceSdpa` rebuilds their mask), MoE too (module docstring, 5.)."""
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
    if seq_len and seq_len % sp:
        _refuse(sp, f"the sequence length {seq_len} is not divisible by it", f"use a multiple of {sp} tokens per row")
    if not config.sp_handler.sp_disable_in_eval:
        _refuse(
            sp,
            "sp_disable_in_eval=False: evaluation batches are whole rows, not the training adapter's shards, and "
            "DeepSpeed's attention asserts 'query input tensor does not match the required shape' at the first one",
            "leave sp_disable_in_eval at True (unset PARALLELISM_CONFIG_SP_DISABLE_IN_EVAL)",
        )
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


def sequence_parallel_group():
    """This rank's SP group (DeepSpeed builds it at `prepare`; accelerate reads it the same way)."""
    from deepspeed.runtime.sequence_parallel import parallel_state_sp

    return parallel_state_sp.get_sequence_parallel_group()


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


class FullSequenceSdpa:
    """transformers' SDPA with the mask Ulysses drops rebuilt for the whole sequence (module docstring, 3.).

    DeepSpeed's wrapper discards the model's mask (built for the local shard) and calls this with the whole sequence
    of 1/sp of the heads and the all-gathered `position_ids`. The mask is rebuilt from those by the model's own helper
    (`build_attention_masks`, transformers' builders): a new document where the positions restart, the layer's
    window from its `sliding_window` (the attention interface's argument; the window layers' config view carries the
    same value), causal. A row with neither gets no mask and SDPA runs `is_causal`, as in one process. With a mask
    given (no Ulysses), or a key longer than the query (a KV cache), it is plain SDPA.

    Memory: the rebuilt mask is the whole row's, b x s x s booleans per layer type, the size the one-process run
    builds (SP does not divide it: 1 GiB a row at s = 32k) and what the memory estimator prices
    (`attention_mask_bytes` takes the whole sequence). It is shared by the layers of a type through a weak
    reference: nothing is kept that a kernel does not hold for its backward, and a kernel that keeps it keeps one
    mask per layer type, not one per layer.
    """

    def __init__(self):
        self._masks: dict[tuple, tuple[torch.Tensor, weakref.ref]] = {}  # (window, batch) -> (positions, mask)

    def __call__(self, module, query, key, value, attention_mask, position_ids=None, sliding_window=None, **kwargs):
        whole = position_ids is not None and query.shape[-2] == key.shape[-2] == position_ids.shape[-1]
        if attention_mask is None and whole:
            attention_mask = self.mask(module, query, position_ids, sliding_window)
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            position_ids=position_ids,
            sliding_window=sliding_window,
            **kwargs,
        )

    def mask(self, module, query, position_ids: torch.Tensor, sliding_window: int | None) -> torch.Tensor | None:
        """The layer's mask over the whole sequence: causal, within documents, within its window."""
        slot = (sliding_window, query.shape[0])
        positions, mask = self._masks.get(slot, (None, lambda: None))
        mask = mask()
        if mask is not None and positions.shape == position_ids.shape and torch.equal(positions, position_ids):
            return mask
        layer_type = FULL if sliding_window is None else SLIDING
        shape = query.new_empty((query.shape[0], query.shape[-2], 0))  # what the builders read: batch, length, device
        mask = build_attention_masks({layer_type: module.config}, shape, None, None, position_ids)[layer_type]
        if mask is not None:
            self._masks[slot] = (position_ids, weakref.ref(mask))
        return mask


@dataclasses.dataclass
class PositionIds:
    """The training collator, plus `position_ids` 0..T-1 per row when it gives none (Ulysses needs them); a
    left-padded batch is refused: Ulysses drops the padding mask, and only right padding needs none."""

    collator: object

    def __call__(self, features):
        batch = self.collator(features)
        padding = batch.get("attention_mask")
        if padding is not None and (padding[:, 1:] > padding[:, :-1]).any():  # a token after padding
            raise ValueError(
                "attention_mask: padding before tokens (left padding) under sequence parallelism, whose attention "
                "drops the padding mask; pad on the right (tokenizer.padding_side='right') (docs/distributed.md)."
            )
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
