"""FSDP2 under `PretrainTrainer`: CPU processes (gloo) and a consolidated final save.

FSDP2 itself is PyTorch's `fully_shard`, applied by accelerate (`fsdp_version: 2`, one unit per
`PretrainDecoderLayer`, the embedding and the final norm + LM head as their own units); nothing here
shards anything. Two gaps are closed, both small:

- **CPU ranks.** `fully_shard` runs on CPU tensors over gloo (its all-gather and reduce-scatter
  both exist there), but accelerate 1.15 only turns the FSDP plugin on when the process group's
  type is a GPU one (`AcceleratorState`: `MULTI_GPU`, `MULTI_XPU`, ...). A CPU launch
  (`use_cpu`, `MULTI_CPU`) silently trains plain DDP instead, the FSDP config ignored.
  `fsdp_on_cpu()` shows accelerate a GPU-type group for the moment the `Accelerator` is built, so
  its own FSDP branch runs (the device stays the CPU), and leaves the process-wide type at FSDP. It
  acts only when FSDP2 is asked for (`TrainingArguments.fsdp` or an accelerate FSDP launch config)
  on a `MULTI_CPU` group: GPU runs never enter it; FSDP1 there is refused with a clear error. This is how the 2-process CPU tests and rehearsals
  of `fsdp2_8gpu.yaml` run the same code as the GPUs.
- **The final weights.** With `fsdp_state_dict_type: SHARDED_STATE_DICT` (the presets: every rank
  writes its shard of a checkpoint, no gather), transformers' `save_model()` writes nothing at all
  for the model. `save_full_weights()` gathers the full state dict (`accelerator.get_state_dict`:
  DCP's `get_model_state_dict(full_state_dict=True, cpu_offload=True)`, on rank 0) and writes the
  usual `model.safetensors` + `config.json`, so `from_pretrained`, `export_hf` and plain
  transformers read it. Checkpoints stay sharded (`pytorch_model_fsdp_0/`, `optimizer_0/`: DCP
  folders, no gather) and get the `config.json` every other checkpoint has, so `accelerate
  merge-weights checkpoint-N/pytorch_model_fsdp_0 checkpoint-N` makes one loadable by itself.

- **Asynchronous sharded saves.** accelerate gets a sharded state dict with `offload_to_cpu` (its default): on a
  GPU a blocking device-to-host copy into unpinned memory, on the training thread, of every shard. An asynchronous
  save (`resume/background.py`) stages the state itself, into pinned buffers it reuses, beside the next step: with
  the offload on the state would be copied twice (and held twice in host memory). `sharded_state_writes()` takes
  the state on the device (`cpu_offload=False`) in accelerate's layout and hands it to the save's writer, so DCP's
  stager makes the only copy (the ~20 lines of accelerate's sharded branch, written again for that one option and
  the writer).

Written by hand: a two-line accelerate gap, not a feature a library offers (checked: accelerate
1.15, transformers 5.24).
"""

from __future__ import annotations

import contextlib
import os

from accelerate.utils import DistributedType

from .private import accelerate_states, save_weights


def fsdp_requested(args) -> bool:
    """FSDP asked for by the arguments (`fsdp=...`) or by an accelerate FSDP launch config."""
    return bool(getattr(args, "fsdp", None)) or os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true"


def sharding_requested(args) -> tuple[bool, bool]:
    """(DeepSpeed, FSDP) asked for by the arguments or by an accelerate launch config: what a script knows before
    the trainer exists (the trainer itself reads `is_deepspeed_enabled` / `is_fsdp_enabled`)."""
    launched = os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"
    return bool(getattr(args, "deepspeed", None)) or launched, fsdp_requested(args)


def fsdp_version(args) -> int:
    """The version asked for: `fsdp_config` of the arguments (transformers' default 2), else the launch config's."""
    if getattr(args, "fsdp", None):
        config = getattr(args, "fsdp_config", None) or {}
        return int(config.get("version", config.get("fsdp_version", 2)))
    return int(os.environ.get("FSDP_VERSION", "1"))


@contextlib.contextmanager
def fsdp_on_cpu(args):
    """While the `Accelerator` is built, a CPU process group reads as a GPU one, so accelerate applies FSDP.

    Afterwards the process-wide state says FSDP: every later `AcceleratorState()` (accelerate builds one in
    each `AcceleratedOptimizer`) copies the type from it, and would otherwise put `MULTI_CPU` back, turning
    off accelerate's FSDP paths (state-dict gathering, gradient clipping) mid-run."""
    state, accelerator_state = accelerate_states()
    flip = fsdp_requested(args) and state.get("distributed_type") == DistributedType.MULTI_CPU
    if flip and fsdp_version(args) != 2:
        raise ValueError(
            f"fsdp_version={fsdp_version(args)} on CPU processes: only FSDP2 runs on CPU ranks here. "
            "Set fsdp_version: 2 in the accelerate config (or fsdp_config={'version': 2})."
        )
    if flip:
        state["distributed_type"] = DistributedType.MULTI_GPU
    try:
        yield
    finally:
        if flip:
            built = accelerator_state.get("distributed_type")
            state["distributed_type"] = built if built == DistributedType.FSDP else DistributedType.MULTI_CPU


def is_fsdp2(trainer) -> bool:
    return bool(getattr(trainer, "is_fsdp_enabled", False)) and trainer.accelerator.is_fsdp2


def sharded_saves(trainer) -> bool:
    """FSDP2 whose state dicts are sharded: `save_model()` would write no weights."""
    return is_fsdp2(trainer) and "SHARDED_STATE_DICT" in str(trainer.accelerator.state.fsdp_plugin.state_dict_type)


def sharded_state_writes(trainer, writer):
    """transformers.trainer's `save_fsdp_model` / `save_fsdp_optimizer` for an asynchronous save of sharded FSDP2
    state: accelerate's layout (`pytorch_model_fsdp_<i>/`, `optimizer_<i>/`: DCP folders its loader reads), the
    state taken on the device (no `cpu_offload`: the writer's stager makes the one, pinned, host copy) and handed to
    `writer.dcp_save`. (None, None) for any other run; a PEFT model's adapter-only or a non-DCP save goes to
    accelerate's own."""
    if not sharded_saves(trainer):
        return None, None
    import torch.distributed.checkpoint.state_dict as dcp_state
    from accelerate.utils import save_fsdp_model, save_fsdp_optimizer
    from accelerate.utils.constants import FSDP_MODEL_NAME, OPTIMIZER_NAME
    from accelerate.utils.modeling import is_peft_model
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    options = dcp_state.StateDictOptions(full_state_dict=False, cpu_offload=False)

    def write(state: dict, folder: str) -> None:
        os.makedirs(folder, exist_ok=True)
        writer.dcp_save(state, storage_writer=FileSystemWriter(folder), planner=DefaultSavePlanner())

    def model_save(plugin, accelerator, model, output_dir, model_index=0, adapter_only=False, use_dcp=True):
        if (adapter_only and is_peft_model(model)) or not use_dcp:  # transformers asks adapter_only for any model
            return save_fsdp_model(plugin, accelerator, model, output_dir, model_index, adapter_only, use_dcp)
        state = dcp_state.get_model_state_dict(model, options=options)
        write({"model": state}, os.path.join(output_dir, f"{FSDP_MODEL_NAME}_{model_index}"))

    def optimizer_save(plugin, accelerator, optimizer, model, output_dir, optimizer_index=0, use_dcp=True):
        if not use_dcp:
            return save_fsdp_optimizer(plugin, accelerator, optimizer, model, output_dir, optimizer_index, use_dcp)
        inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper
        state = dcp_state.get_optimizer_state_dict(model, inner, options=options)
        write({"optimizer": state}, os.path.join(output_dir, f"{OPTIMIZER_NAME}_{optimizer_index}"))

    return model_save, optimizer_save


def save_config(trainer, output_dir: str) -> None:
    """A sharded checkpoint's config (Trainer writes none there): what `from_pretrained` needs after a merge."""
    config = getattr(trainer.model, "config", None)
    if trainer.args.should_save and config is not None:
        config.save_pretrained(output_dir)


def save_full_weights(trainer, output_dir: str) -> None:
    """Every rank takes part in the gather; rank 0 writes `model.safetensors` and the config."""
    state_dict = trainer.accelerator.get_state_dict(trainer.model)
    save_weights(trainer, output_dir, state_dict)
