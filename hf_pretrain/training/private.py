"""The private surfaces of other libraries, in one module: every private `Trainer` method hf_pretrain overrides or
calls, every `transformers.trainer` (or `transformers.modeling_utils`) module global it patches, and the two
touches of other libraries' privates: accelerate's process-wide state (`accelerate_states`, for FSDP2 on CPU
ranks, fsdp.py) and the copy stream of DCP's `DefaultStager` (`staging_stream`, which an asynchronous save makes
wait on the step's event instead of draining the device, resume/background.py).

`PretrainTrainer` derives from `TrainerPrivateOverrides`: each override hands the call to its room (tokens, loss
guard, data position, checkpointing, precision, compile). A module global is replaced only for the duration of
one call, through `patched`. At import, `check_private_surface()` makes sure every name in `PRIVATE_SURFACE`
exists in the installed transformers, and otherwise fails with one line naming the missing names, the installed
version and the range supported, so a transformers upgrade breaks here, by name, and not mid-training.
"""

from __future__ import annotations

import contextlib
import functools
import importlib

import transformers
import transformers.modeling_utils as hf_modeling
import transformers.trainer as hf_trainer
from transformers import Trainer

from ..precision import high_precision
from .compile import accelerator_args_for

SUPPORTED_TRANSFORMERS = ">=5.24,<6"  # setup.cfg's requirement (tests/training/test_private.py)

# "Trainer.<method>": overridden below or called on a trainer; "Trainer.<method>.<attribute>": an attribute that
# method sets and hf_pretrain sets too; "transformers.trainer.<global>", "transformers.modeling_utils.<global>":
# patched for one call.
PRIVATE_SURFACE = (
    "Trainer._build_accelerator_args",
    "Trainer._track_num_input_tokens",
    "Trainer._get_learning_rate",
    "Trainer._get_grad_norm",
    "Trainer._save",
    "Trainer._get_train_sampler",
    "Trainer._init_training_state",
    "Trainer._run_epoch",
    "Trainer._get_output_dir",
    "Trainer._save_checkpoint",
    "Trainer.create_scheduler._created_lr_scheduler",
    "transformers.trainer.rotate_checkpoints",
    "transformers.trainer.skip_first_batches",
    "transformers.modeling_utils.safe_save_file",
    "transformers.trainer.torch",
    "transformers.trainer.safetensors",
    "transformers.trainer.save_fsdp_model",
    "transformers.trainer.save_fsdp_optimizer",
)
# accelerate's and DCP's private names (read from accelerate 1.16 and torch 2.13), checked at import as well
OTHER_PRIVATE_SURFACE = (
    ("accelerate.state", "PartialState", "_shared_state"),
    ("accelerate.state", "AcceleratorState", "_shared_state"),
)


def accelerate_states() -> tuple[dict, dict]:
    """accelerate's process-wide state of `PartialState` and `AcceleratorState` (the dicts every instance shares)."""
    from accelerate.state import AcceleratorState, PartialState

    return PartialState._shared_state, AcceleratorState._shared_state


def staging_stream(stager):
    """The stream DCP's `DefaultStager` enqueues its copies on (None without an accelerator or async staging)."""
    return getattr(stager, "_staging_stream", None)


def _present(name: str) -> bool:
    owner, _, attribute = name.rpartition(".")
    if owner == "transformers.trainer":
        return hasattr(hf_trainer, attribute)
    if owner == "transformers.modeling_utils":
        return hasattr(hf_modeling, attribute)
    if owner == "Trainer":
        return hasattr(Trainer, attribute)
    method = getattr(Trainer, owner.removeprefix("Trainer."), None)  # an attribute the method's code sets
    return attribute in getattr(getattr(method, "__code__", None), "co_names", ())


def check_private_surface(surface: tuple[str, ...] = PRIVATE_SURFACE) -> None:
    """Fail with one line when the installed transformers lacks a private name hf_pretrain relies on."""
    missing = [name for name in surface if not _present(name)]
    if missing:
        raise ImportError(
            f"hf_pretrain supports transformers{SUPPORTED_TRANSFORMERS} and relies on private names the installed "
            f"transformers {transformers.__version__} lacks: {', '.join(missing)}. Fix: pip install "
            f"'transformers{SUPPORTED_TRANSFORMERS}' (a version in that range without them needs "
            "hf_pretrain/training/private.py updated)."
        )


def check_other_private_surface() -> None:
    """Fail with one line when the installed accelerate lacks a private name hf_pretrain relies on."""
    missing = [
        f"{module}.{owner}.{name}"
        for module, owner, name in OTHER_PRIVATE_SURFACE
        if not hasattr(getattr(importlib.import_module(module), owner, None), name)
    ]
    if missing:
        raise ImportError(
            f"hf_pretrain relies on private names the installed accelerate lacks: {', '.join(missing)}. Fix: install "
            "the accelerate of setup.cfg's range (a version without them needs hf_pretrain/training/private.py updated)."
        )


check_private_surface()
check_other_private_surface()


@contextlib.contextmanager
def patched(module, name: str, value):
    """`module.name` is `value` inside the block, and what it was afterwards."""
    saved = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, saved)


def rotation_deferred():
    """`Trainer._save_checkpoint` rotates old checkpoints at its end (`rotate_checkpoints`); the staged save rotates
    after its rename instead."""
    return patched(hf_trainer, "rotate_checkpoints", lambda *args, **kwargs: None)


def batch_skipping_off():
    """The Trainer's batch skipping on resume (`skip_first_batches`) becomes a no-op: the data already starts at the
    saved position."""
    return patched(hf_trainer, "skip_first_batches", lambda dataloader, num_batches=0: dataloader)


class Delegate:
    """A module seen through one module's global name, with some attributes replaced (the module itself unchanged)."""

    def __init__(self, module, **replaced):
        self._module = module
        self.__dict__.update(replaced)

    def __getattr__(self, name: str):
        return getattr(self._module, name)


@contextlib.contextmanager
def writes_routed(writer, save_fsdp_model=None, save_fsdp_optimizer=None):
    """Inside: the files `Trainer._save_checkpoint` writes go to `writer` (an asynchronous save's `DeferredWriter`):
    transformers.trainer's `torch.save` (optimizer, scheduler, RNG, arguments) and `safetensors.torch.save_file`,
    transformers.modeling_utils' `safe_save_file` (the weights of `save_pretrained`) and, given, the FSDP saves
    transformers.trainer imported from accelerate. Only those modules' global names change, for this one call:
    `torch.save` stays `torch.save` for every other caller (a user callback's file is written when it asks)."""
    import safetensors
    import torch

    routes = [
        patched(hf_trainer, "torch", Delegate(torch, save=writer.torch_save)),
        patched(
            hf_trainer,
            "safetensors",
            Delegate(safetensors, torch=Delegate(safetensors.torch, save_file=writer.save_file)),
        ),
        patched(hf_modeling, "safe_save_file", writer.save_file),
    ]
    if save_fsdp_model is not None:
        routes += [
            patched(hf_trainer, "save_fsdp_model", save_fsdp_model),
            patched(hf_trainer, "save_fsdp_optimizer", save_fsdp_optimizer),
        ]
    with contextlib.ExitStack() as stack:
        for route in routes:
            stack.enter_context(route)
        yield


def save_weights(trainer: Trainer, output_dir: str, state_dict) -> None:
    """The Trainer's own weight save (`_save`: the model's files and the config) of a given state dict."""
    trainer._save(output_dir, state_dict=state_dict)


def scheduler_created(trainer: Trainer) -> None:
    """Mark the scheduler as made by `create_scheduler`, as Trainer does: the next `train()` builds it anew."""
    trainer._created_lr_scheduler = True


class TrainerPrivateOverrides(Trainer):
    """The overrides of private `Trainer` methods; `PretrainTrainer` sets the rooms they hand the calls to."""

    def _build_accelerator_args(self, **kwargs) -> dict:  # compile.py: scope 'blocks' compiles in place
        return accelerator_args_for(self.args, super()._build_accelerator_args(**kwargs))

    def _track_num_input_tokens(self, inputs):  # tokens.py: our count when the arguments do not ask for one
        if not (self.extras and self.tokens.track(inputs)):
            super()._track_num_input_tokens(inputs)

    def _get_learning_rate(self):  # loss_guard.py: the logged rate includes a roll-back's scale
        lr = super()._get_learning_rate()
        return lr * self.loss_guard.lr_scale if self.loss_guard is not None else lr

    def _get_grad_norm(self, model, grad_norm=None):  # loss_guard.py: its finite test reads the norm clipping took
        grad_norm = super()._get_grad_norm(model, grad_norm=grad_norm)
        if self.loss_guard is not None and not self.is_deepspeed_enabled:  # DeepSpeed's is its engine's, not ours
            self.loss_guard.record_grad_norm(grad_norm)
        return grad_norm

    def _save(self, output_dir: str | None = None, state_dict=None):  # precision: plain weights in every save
        with high_precision(self.model):
            return super()._save(output_dir, state_dict)

    def _get_train_sampler(self, train_dataset=None):  # resume/data_position.py: a sampler that can start anywhere
        sampler = super()._get_train_sampler(train_dataset)
        return self.data_position.sampler_for(sampler) if self.extras else sampler

    def _init_training_state(self, max_steps, num_update_steps_per_epoch, *args, **kwargs):  # resume/data_position
        self.data_position.update_steps_per_epoch = num_update_steps_per_epoch
        return super()._init_training_state(max_steps, num_update_steps_per_epoch, *args, **kwargs)

    def _run_epoch(self, **kwargs):  # resume/data_position.py: the resumed epoch starts at the saved position
        return self.data_position.run_epoch(super()._run_epoch, **kwargs)

    def _get_output_dir(self, trial):  # resume/checkpointing.py: the Trainer's save writes into the staging folder
        return self.checkpointing.staging or super()._get_output_dir(trial)

    def _save_checkpoint(self, model, trial) -> None:  # resume/checkpointing.py: staged, checked, renamed
        if not self.extras:
            return super()._save_checkpoint(model, trial)
        save = functools.partial(super()._save_checkpoint, model, trial)
        with self.recovery.phase("checkpoint"):  # recovery/room.py: the watchdog's floor, goodput's stall
            self.checkpointing.save(save, super()._get_output_dir(trial), self.checkpointing.run_state())
