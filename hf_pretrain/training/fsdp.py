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
  the offload on the state would be copied twice (and held twice in host memory). `device_state_dicts()` turns the
  offload off for the duration of an asynchronous save, so DCP's stager makes the only copy.

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


@contextlib.contextmanager
def device_state_dicts(trainer):
    """Inside: accelerate's sharded FSDP2 state dicts stay on the device (`offload_to_cpu` off), for a save whose
    own stager copies them to the host. Nothing changes for any other kind of run."""
    config = trainer.accelerator.state.fsdp_plugin.state_dict_config if sharded_saves(trainer) else None
    offload = getattr(config, "offload_to_cpu", False)
    if offload:
        config.offload_to_cpu = False
    try:
        yield
    finally:
        if offload:
            config.offload_to_cpu = True


def save_config(trainer, output_dir: str) -> None:
    """A sharded checkpoint's config (Trainer writes none there): what `from_pretrained` needs after a merge."""
    config = getattr(trainer.model, "config", None)
    if trainer.args.should_save and config is not None:
        config.save_pretrained(output_dir)


def save_full_weights(trainer, output_dir: str) -> None:
    """Every rank takes part in the gather; rank 0 writes `model.safetensors` and the config."""
    state_dict = trainer.accelerator.get_state_dict(trainer.model)
    save_weights(trainer, output_dir, state_dict)
