"""DeepSpeed AutoTP tensor parallelism (`"tensor_parallel": {"autotp_size": N}` in the DeepSpeed config) under
`PretrainTrainer`.

transformers, accelerate and DeepSpeed carry the mechanism; a DeepSpeed config (`ds_configs/zero1_autotp.json`) is
all a user writes. transformers' `deepspeed_init` calls `deepspeed.tp_model_init`, and the engine replaces each
`nn.Linear` of the model by DeepSpeed's: q/k/v, gate and up projections column-wise (`LinearLayer`: this rank's
heads and MLP columns), o and down projections row-wise (`LinearAllreduce`: an all-reduce over the TP group after
the matmul). Norms, embeddings and an untied LM head stay whole on every rank, their gradients all-reduced over the
TP group; a tied LM head becomes vocabulary-parallel (`VocabParallelLinear`, DeepSpeed's vocabulary-parallel
cross-entropy; the chunked loss then steps aside with a warning and computes the logits). hf_pretrain's attention
reshapes by `head_dim` (`-1` heads), so it runs whatever share of the heads a rank holds, uneven ones included.
Experts of an MoE layer (`PretrainExperts`, 3-D parameters, not linears) stay whole on every rank. accelerate builds
a `tp` device mesh on the device's type (gloo on a CPU) and its loader gives the ranks of a TP group the same batch
(data rank = process index // tp; DeepSpeed checks it before the first forward); `get_state_dict` gathers the TP
shards for `save_model`, with `stage3_gather_16bit_weights_on_model_save` on (it keeps the training dtype: fp32
here); checkpoints hold one `mp_rank_XX` file per TP rank and resume on the same TP size.

What is added here, each found by running 2 gloo ranks against one process (tests/distributed/test_tensor_parallel.py):
1. Tokens counted once per TP group. The Trainer's counter gathers every rank's batch, and the TP ranks of a group
   hold the same one: tokens/s, MFU and the schedule's token counts were doubled at TP=2 (3072 tokens for the one
   process's 1536). `counts_tokens` says whether this rank's tokens count (the first rank of its TP group, the
   loader's rule), and `TokenCounter` counts under TP instead of the Trainer.
2. The data position of a checkpoint is `per_device x world / (tp x sp)` samples per micro-batch
   (`resume/data_position.py`), and a mixture's rows trained follow the same groups (`telemetry/mixture.py`):
   with `world` alone a resume at step 3 of 6 started past the end of the epoch and trained nothing.
3. What breaks is refused in one line before any work (`check_run`, from `PretrainTrainer.__init__`):
   - ZeRO-3: DeepSpeed documents AutoTP training with ZeRO stage 0, 1 or 2 (deepspeed.ai/tutorials/autotp-training;
     DeepSpeedExamples says "AutoTP+ZeRO-3 not supported"). Run, it stops at the first `prepare` on two batch-size
     checks that cannot both pass: the engine's config counts every rank ("8 != 8 * 1 * 2" when the size is set to
     micro x accumulation x world / tp), ZeRO-3's partitioner only the data-parallel ones ("16 != 8 * 1 * 1" when it
     is micro x accumulation x world, what transformers and accelerate set). ZeRO 0/1/2 run: the optimizer states
     (1) and gradients (2) sharded over the data-parallel groups, the weights over the TP group.
   - Ulysses SP beside it (`parallelism_config.sp_size`, which runs only under ZeRO-3) and accelerate's own TP
     (`parallelism_config.tp_size`: DTensor layers, GPU-only) together with AutoTP: two schemes for one model.
   - a TP size that does not divide the processes.
   - precision recipes that convert the linears (fp8, te-*): AutoTP replaces the converted layers with its own
     (measured: the TP run's losses were the fp32 run's to the bit, not the fp8 one's).
   Measured and not refused: KV heads fewer than the TP size (DeepSpeed warns; ranks past the heads hold no
   attention shard), heads and MLP widths not divisible by it, sliding windows, MoE, tied embeddings: losses within
   1e-6 and gradient norms within 1.4e-6 of one process over 6 steps (docs/distributed.md).
4. The memory preflight prices each rank's share (`wiring.py` passes `tensor_parallel_size` as the estimator's
   `tp`: distributed/memory.py, measured by benchmarks/tensor_parallel.py).
5. `evaluate()` gathers each TP group's outputs once (`gathered_once_per_group`, set around the Trainer's evaluation
   loop). Its `gather_function`, accelerate's `gather_for_metrics`, gathers every rank's losses and per-sequence
   statistics, so each full batch counted once per TP rank, while the last is trimmed to the remainder of one data
   rank: on 13 rows in batches of 8, eval_loss (16a + 5b) / 21 = 5.97072 for the one process's (8a + 5b) / 13 =
   5.97230. The gathered tensors are the ranks' in rank order, a group `tp` consecutive ranks: every tp-th rank's
   share is kept, then trimmed as accelerate does. Only tensors (the model's, `preprocess_logits_for_metrics`'):
   objects (`eval_use_gather_object`) are refused in one line at the first gather.
GPUs/NCCL: nothing here depends on the backend. accelerate's `init_device_mesh("cuda", (tp,))` puts the TP group on
NCCL and DeepSpeed's all-reduces run there; the ranks of a TP group should share a node (NVLink), which the
consecutive ranks of a launch are. FlashAttention runs per head on the rank's heads and its variable-length
arguments are per sequence, so TP does not touch them, but that is not checked here (GPU-only).
"""

from __future__ import annotations

import contextlib
import functools

import torch
from accelerate.utils import recursively_apply

from ..precision.recipes import LOW_PRECISION


def _refuse(tp: int, problem: str, fix: str) -> None:
    raise ValueError(f"tensor_parallel.autotp_size={tp}: {problem}; {fix} (docs/distributed.md).")


def tensor_parallel_size(trainer) -> int:
    """The AutoTP degree of the run's DeepSpeed config (1 without DeepSpeed or without `tensor_parallel`)."""
    if not getattr(trainer, "is_deepspeed_enabled", False):
        return 1
    config = trainer.accelerator.state.deepspeed_plugin.deepspeed_config
    return int(config.get("tensor_parallel", {}).get("autotp_size", 1) or 1)


def counts_tokens(trainer) -> bool:
    """Whether this rank's batch counts toward the tokens seen: the first rank of its TP group (the group shares the
    batch; accelerate's loader gives data rank process_index // tp)."""
    return trainer.args.process_index % tensor_parallel_size(trainer) == 0


@contextlib.contextmanager
def gathered_once_per_group(trainer):
    """Within it, the evaluation loop gathers each TP group's outputs once (module docstring, 5.); the loop resets
    `gather_function` itself when done, and this puts back what was there."""
    tp = tensor_parallel_size(trainer)
    if tp <= 1:
        yield
        return
    before = trainer.gather_function
    trainer.gather_function = functools.partial(gather_once_per_group, trainer.accelerator, tp)
    try:
        yield
    finally:
        trainer.gather_function = before


def gather_once_per_group(accelerator, tp: int, data):
    """`accelerator.gather_for_metrics(data)` keeping the first TP rank's copy of each group's batch: the gathered
    tensors are the ranks' in rank order and a group is `tp` consecutive ranks. Then the last batch is trimmed to the
    evaluation set's remainder, as `gather_for_metrics` does."""
    try:
        recursively_apply(lambda x: x, data, error_on_other_type=True)
    except TypeError as error:
        raise TypeError(
            f"tensor_parallel.autotp_size={tp}: evaluate() gathers tensors only under AutoTP ({error}); "
            "return tensors from the model and preprocess_logits_for_metrics, and leave eval_use_gather_object off"
        ) from None
    world = accelerator.num_processes
    data = recursively_apply(lambda t: torch.cat(t.chunk(world)[::tp]), accelerator.gather(data))
    state = accelerator.gradient_state
    if state.end_of_dataloader and state.remainder > 0:
        data = recursively_apply(lambda t: t[: state.remainder], data)
    return data


def check_trainer(trainer) -> None:
    """Refuse what breaks under AutoTP (module docstring, 3.), before the precision recipe converts anything."""
    tp = tensor_parallel_size(trainer)
    if tp <= 1:
        return
    accelerator, args = trainer.accelerator, trainer.args
    config = getattr(accelerator, "parallelism_config", None) or getattr(args, "parallelism_config", None)
    check_run(
        tp,
        world=args.world_size,
        zero_stage=accelerator.state.deepspeed_plugin.zero_stage,
        sp_size=getattr(config, "sp_size", 1),
        parallel_tp_size=getattr(config, "tp_size", 1),
        precision=getattr(args, "precision", None),
    )


def check_run(tp: int, world: int, zero_stage: int, sp_size: int, parallel_tp_size: int, precision: str | None):
    """The one line that says what breaks under AutoTP of `tp` in this run, or nothing."""
    if world % tp:
        _refuse(tp, f"it does not divide the {world} processes", f"launch a multiple of {tp} processes")
    if zero_stage == 3:
        _refuse(
            tp,
            "DeepSpeed's AutoTP training runs with ZeRO stage 0, 1 or 2, not 3 (its AutoTP training tutorial); "
            "ZeRO-3 stops at DeepSpeed's batch-size assertion",
            "use ds_configs/zero1_autotp.json (ZeRO stage 0, 1 or 2)",
        )
    if sp_size > 1:
        _refuse(tp, f"not checked with Ulysses sequence parallelism (sp_size={sp_size})", "use one of the two")
    if parallel_tp_size > 1:
        _refuse(
            tp,
            f"parallelism_config.tp_size={parallel_tp_size} would split the model a second time",
            "set tensor parallelism in one place (the DeepSpeed config's autotp_size)",
        )
    if precision in LOW_PRECISION:
        _refuse(
            tp,
            f"AutoTP replaces the linears precision={precision!r} converted with its own full-precision ones",
            "train with precision='bf16' or 'fp32'",
        )
