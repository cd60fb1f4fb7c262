"""Launched by test_distributed.py (under `accelerate launch` or alone): a short run of the tiny preset.

Usage: python tests/distributed/dist_run.py OUTPUT_DIR PER_DEVICE_BATCH [DEEPSPEED_CONFIG|-] [SAVE_STEPS] [resume]
       [--optim NAME] [--gradient_checkpointing] [--sp N] [--tp N] [--cp N] [--own_token_count] [--windows_documents]
       [--windows_checkpointing] [--windows_micro_batches N] [--evaluate]
Writes OUTPUT_DIR/rank-<r>.json: the per-step losses, a checksum of every parameter (gathered under
ZeRO-3 and FSDP2), the tokens seen and what the throughput callback would price a token at, the memory
preflight's estimate, the rank's parameter count and, on rank 0, logits of a fixed batch; saves the model to OUTPUT_DIR/model. The
accelerate config picks DDP or FSDP2 (cpu_2proc.yaml, cpu_2proc_fsdp2.yaml). `--own_token_count`: tokens counted
by `TokenCounter` (include_num_input_tokens_seen="no") instead of the Trainer's counter. `--windows_documents`:
then, in the same processes (a second launch would cost its start-up again), the same steps with sliding windows,
packed documents and MoE layers (`windows_documents`), recorded in OUTPUT_DIR/windows_documents/rank-<r>.json;
`--windows_checkpointing`: that run with activation checkpointing (the first keeps `--gradient_checkpointing`'s);
`--windows_micro_batches N`: then that run again in N gradient-accumulation micro-batches of PER_DEVICE/N rows
(`windows_documents_micro/`): each micro-batch's router losses are its own, as each data-parallel rank's are.
`--evaluate`: then the Trainer's `evaluate()` of `EVAL_ROWS` rows in batches of 8 (a full batch and a remainder),
its metrics recorded as "eval". `--tp N` / `--cp N`: accelerate's `ParallelismConfig(tp_size=N)` (the model loaded
sharded, `tp_plan="auto"`, as accelerate requires) / `cp_size=N` (under an FSDP2 launch); GPU-only, refused on a CPU
(benchmarks/gpu/parallel_2gpu.py launches them).
"""

import hashlib
import json
import os
import sys
from pathlib import Path

import torch
from accelerate import ParallelismConfig
from datasets import Dataset
from transformers import TrainerCallback

from hf_pretrain import PretrainForCausalLM, PretrainTrainer, get_preset
from hf_pretrain.data.collator import PackedDocumentCollator
from hf_pretrain.modeling.accounting import flops_per_token
from hf_pretrain.telemetry.throughput import sequence_length
from tests.conftest import quick_args

STEPS, GLOBAL_BATCH, SEQ = 6, 8, 32
EVAL_ROWS = 13  # --evaluate: a full batch of 8 and a remainder of 5
EOS = 2  # windows_documents: a document ends at every token divisible by 7, ~4.6 documents a row


class Losses(TrainerCallback):
    def __init__(self):
        self.losses, self.grad_norms = {}, {}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses[state.global_step] = logs["loss"]
            self.grad_norms[state.global_step] = logs.get("grad_norm")


def parameters_digest(trainer) -> str:
    digest = hashlib.sha256()
    params = list(trainer.model.named_parameters())
    if trainer.is_deepspeed_enabled:
        import deepspeed

        with deepspeed.zero.GatheredParameters([p for _, p in params]):
            for _, p in params:
                digest.update(p.detach().float().cpu().numpy().tobytes())
    else:  # FSDP2: DTensor shards, gathered (a collective: every rank, same order)
        for _, p in params:
            full = p.full_tensor() if hasattr(p, "full_tensor") else p
            digest.update(full.detach().float().cpu().numpy().tobytes())
    return digest.hexdigest()


def checkpoint_wrappers(trainer) -> int:
    """The layers accelerate's FSDP activation checkpointing (`fsdp_activation_checkpointing`) wrapped (`fully_shard`
    then renames their class `FSDPCheckpointWrapper`)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    return sum(isinstance(module, CheckpointWrapper) for module in trainer.model_wrapped.modules())


def record_state_dict_offload() -> list[bool]:
    """The `cpu_offload` of every state dict DCP is asked for (model and optimizer; appended as they come)."""
    import torch.distributed.checkpoint.state_dict as dcp_state

    seen: list[bool] = []
    for name in ("get_model_state_dict", "get_optimizer_state_dict"):
        get = getattr(dcp_state, name)

        def recorded(*args, _get=get, **kwargs):
            options = kwargs.get("options")
            seen.append(getattr(options, "cpu_offload", None))
            return _get(*args, **kwargs)

        setattr(dcp_state, name, recorded)
    return seen


def arguments(output_dir, per_device: int, deepspeed: str | None, sp: int, tp: int = 1, cp: int = 1, **overrides):
    sizes = {"sp_size": sp, "tp_size": tp, "cp_size": cp}
    return quick_args(
        output_dir,
        max_steps=STEPS,
        per_device_train_batch_size=per_device,
        per_device_eval_batch_size=8,  # --evaluate: EVAL_ROWS = 8 + 5
        learning_rate=3e-3,
        measure_peak_tflops=False,
        telemetry=False,
        seed=0,
        deepspeed=deepspeed,
        parallelism_config=ParallelismConfig(**sizes) if max(sizes.values()) > 1 else None,
        **overrides,
    )


def main(
    output_dir: str,
    per_device: int,
    deepspeed: str | None = None,
    save_steps: int = 0,
    resume: bool = False,
    optim: str = "adamw_torch",
    gradient_checkpointing: bool = False,
    sp: int = 1,
    own_token_count: bool = False,
    also_windows_documents: bool = False,
    as_sp_groups: str | None = None,
    evaluate: bool = False,
    tp: int = 1,
    cp: int = 1,
    windows_checkpointing: bool = False,
    windows_micro_batches: int = 1,
):
    torch.manual_seed(0)
    data = torch.randint(3, 500, (GLOBAL_BATCH * STEPS, SEQ), generator=torch.Generator().manual_seed(1))
    if as_sp_groups:
        data = rows_as_sp_groups_train_them(data, as_sp_groups)
    args = arguments(
        output_dir,
        per_device,
        deepspeed,
        sp,
        tp,
        cp,
        save_strategy="steps" if save_steps else "no",
        save_steps=save_steps or 500,
        optim=optim,
        gradient_checkpointing=gradient_checkpointing,
        **({"include_num_input_tokens_seen": "no"} if own_token_count else {}),
    )
    model = seeded_model(output_dir, tp)
    losses = Losses()
    dataset = Dataset.from_dict({"input_ids": data.tolist(), "labels": data.tolist()})
    trainer = PretrainTrainer(model=model, args=args, train_dataset=dataset)
    trainer.add_callback(losses)
    offloads = record_state_dict_offload()
    trainer.train(resume_from_checkpoint=True if resume else None)
    record = {
        "losses": losses.losses,
        "grad_norms": losses.grad_norms,
        "world_size": args.world_size,
        "digest": parameters_digest(trainer),
        "parameters": sum(p.numel() for p in trainer.model.parameters()),  # this rank's (AutoTP: its shards)
        "ranks_per_row": trainer.get_sp_size() * trainer.get_tp_size(),  # what MixtureCallback counts a group by
        "tokens_seen": trainer.tokens_seen(),  # what tokens/s and MFU are computed from (a collective: every rank)
        "flops_per_token": flops_per_token(model.config, sequence_length(trainer)),  # the MFU's numerator per token
    }
    if trainer.memory_check is not None:
        record["memory_estimate"] = trainer.memory_check.shape.estimate(model.config).to_dict()
    if trainer.checkpointing.background is not None:  # the last save's host copy, and the guard's estimate of it
        saves = trainer.checkpointing
        record["staged"] = [saves.background.staged_total, saves.staged_estimate]
    record["state_dict_offload"] = list(offloads)  # cpu_offload of each state dict train()'s saves took
    record["optimizer"] = type(getattr(trainer.optimizer, "optimizer", trainer.optimizer)).__name__
    record["gradient_checkpointing"] = trainer.model.is_gradient_checkpointing
    record["checkpoint_wrappers"] = checkpoint_wrappers(trainer)
    record["fused_loss_unavailable"] = trainer.model._fused_loss_unavailable()  # None: the chunked loss ran
    probe = data[:2]
    if trainer.get_sp_size() > 1:  # Ulysses is off in eval mode (sp_disable_in_eval): each rank runs the whole probe
        trainer.model_wrapped.eval()
    with torch.no_grad():  # every rank takes part (ZeRO-3 gathers the weights for the forward)
        logits = trainer.model_wrapped(input_ids=probe.to(args.device)).logits.float().cpu()
    if args.process_index == 0:
        record["logits"] = logits.tolist()
    if evaluate:
        record["eval"] = trainer.evaluate(eval_dataset=evaluation_rows())
    trainer.save_model(str(Path(output_dir) / "model"))
    name = f"rank-{args.process_index}{'-resumed' if resume else ''}.json"
    Path(output_dir, name).write_text(json.dumps(record))
    trainer.accelerator.wait_for_everyone()
    if also_windows_documents:
        windows = Path(output_dir) / "windows_documents"
        windows_documents(windows, per_device, deepspeed, sp, data, gradient_checkpointing=windows_checkpointing)
    if windows_micro_batches > 1:
        micro = Path(output_dir) / "windows_documents_micro"
        windows_documents(micro, per_device // windows_micro_batches, deepspeed, sp, data, windows_micro_batches)
    trainer.accelerator.end_training()


def seeded_model(output_dir: str, tp: int) -> PretrainForCausalLM:
    """The tiny model every run starts from; under accelerate's TP loaded sharded from the same weights (accelerate
    takes only a model split at load: `tp_plan="auto"`), each rank from its own copy (no barrier needed)."""
    model = PretrainForCausalLM(get_preset("tiny", vocab_size=512, num_hidden_layers=2))
    if tp == 1:
        return model
    init = Path(output_dir) / f"init-rank{os.environ['RANK']}"
    model.save_pretrained(init)
    return PretrainForCausalLM.from_pretrained(init, tp_plan="auto")


def evaluation_rows() -> Dataset:
    rows = torch.randint(3, 500, (EVAL_ROWS, SEQ), generator=torch.Generator().manual_seed(2)).tolist()
    return Dataset.from_dict({"input_ids": rows, "labels": rows})


def rows_as_sp_groups_train_them(data: torch.Tensor, sp_spec: str) -> torch.Tensor:
    """`data` reordered so that one process (the whole global batch a step, the Trainer's seeded order) trains at
    each step the rows an SP run of `sp_spec` = "SPxGROUPS" trains there. accelerate hands process q the q-th of
    every world-size run of micro-batches (GLOBAL_BATCH / GROUPS rows each); DeepSpeed's Ulysses loader adapter makes
    an SP group train its ranks' micro-batches in turn, one a step: step t of a round takes, from every group, the
    micro-batch of its rank t."""
    from hf_pretrain.training.resume.sampler import ResumableSampler

    sp, groups = (int(n) for n in sp_spec.split("x"))
    rows = GLOBAL_BATCH // groups
    world = sp * groups
    order = ResumableSampler(len(data), seed=0).order(0)  # the one process's training order (seed 0, epoch 0)
    batches = order.view(-1, rows)  # micro-batch i: process i % world of round i // world
    trained = [
        batches[start + group * sp + rank]
        for start in range(0, len(batches), world)
        for rank in range(sp)
        for group in range(groups)
    ]
    reordered = data.clone()
    reordered[order] = data[torch.cat(trained)]
    return reordered


def windows_documents(
    output_dir: Path,
    per_device: int,
    deepspeed: str | None,
    sp: int,
    data: torch.Tensor,
    accumulation: int = 1,
    gradient_checkpointing: bool = False,
) -> None:
    """The same steps with a window layer then a full one (`window_pattern="SL"`, 8 tokens) over packed documents,
    each layer's MLP a mixture of 8 experts (top-2): under SP, what Ulysses' attention drops the mask of
    (training/sequence_parallel.py, `FullSequenceSdpa`) and a router loss over the whole rows (its 5.)."""
    if sp > 1:  # DeepSpeed builds its SP groups once per process (asserted): the second run builds them again
        from deepspeed.runtime.sequence_parallel import parallel_state_sp

        parallel_state_sp._release_sequence_parallel_groups()
    torch.manual_seed(0)
    data = data.masked_fill(data % 7 == 0, EOS)
    args = arguments(
        output_dir,
        per_device,
        deepspeed,
        sp,
        save_strategy="no",
        gradient_accumulation_steps=accumulation,
        gradient_checkpointing=gradient_checkpointing,
    )
    preset = get_preset("tiny-moe", vocab_size=512, num_hidden_layers=2, window_pattern="SL", sliding_window=8)
    model, losses = PretrainForCausalLM(preset), Losses()
    dataset = Dataset.from_dict({"input_ids": data.tolist()})
    collator = PackedDocumentCollator(eos_token_id=EOS)
    trainer = PretrainTrainer(model=model, args=args, train_dataset=dataset, data_collator=collator)
    trainer.add_callback(losses)
    trainer.train()
    record = {"losses": losses.losses, "grad_norms": losses.grad_norms, "world_size": args.world_size}
    record["gradient_checkpointing"] = trainer.model.is_gradient_checkpointing
    record["checkpoint_wrappers"] = checkpoint_wrappers(trainer)
    record["digest"] = parameters_digest(trainer)
    probe = collator([{"input_ids": row} for row in data[:2].tolist()])  # Ulysses is off in eval mode: whole rows
    trainer.model_wrapped.eval()
    with torch.no_grad():
        inputs = {key: probe[key].to(args.device) for key in ("input_ids", "position_ids")}
        record["logits"] = trainer.model_wrapped(**inputs).logits.float().cpu().tolist()
    output_dir.mkdir(parents=True, exist_ok=True)
    Path(output_dir, f"rank-{args.process_index}.json").write_text(json.dumps(record))
    trainer.accelerator.wait_for_everyone()


if __name__ == "__main__":
    optim = sys.argv.pop(sys.argv.index("--optim") + 1) if "--optim" in sys.argv else "adamw_torch"
    checkpointing = "--gradient_checkpointing" in sys.argv
    sp, tp, cp = (int(sys.argv.pop(sys.argv.index(f) + 1)) if f in sys.argv else 1 for f in ("--sp", "--tp", "--cp"))
    own_count = "--own_token_count" in sys.argv
    also = "--windows_documents" in sys.argv
    groups = sys.argv.pop(sys.argv.index("--as_sp_groups") + 1) if "--as_sp_groups" in sys.argv else None
    evaluate = "--evaluate" in sys.argv
    windows_checkpointing = "--windows_checkpointing" in sys.argv
    micro = (
        int(sys.argv.pop(sys.argv.index("--windows_micro_batches") + 1)) if "--windows_micro_batches" in sys.argv else 1
    )
    flags = (
        "--optim",
        "--gradient_checkpointing",
        "--sp",
        "--tp",
        "--cp",
        "--own_token_count",
        "--windows_documents",
        "--as_sp_groups",
        "--evaluate",
        "--windows_checkpointing",
        "--windows_micro_batches",
    )
    sys.argv = [a for a in sys.argv if a not in flags]
    deepspeed_config = sys.argv[3] if len(sys.argv) > 3 and sys.argv[3] != "-" else None
    save = int(sys.argv[4]) if len(sys.argv) > 4 else 0
    resume = len(sys.argv) > 5 and sys.argv[5] == "resume"
    args = (deepspeed_config, save, resume, optim, checkpointing, sp, own_count, also, groups, evaluate, tp, cp)
    args += (windows_checkpointing, micro)
    main(sys.argv[1], int(sys.argv[2]), *args)
