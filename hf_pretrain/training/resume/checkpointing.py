"""The trainer's checkpoint room: which checkpoint a resume reads, and how a checkpoint is written.

- `resolve(resume_from_checkpoint)`: the checkpoint to resume, checked first
  (`check.py`): an explicit path must be whole; `True` takes the newest whole one and
  says which it skipped and why; `"auto"` does the same, or starts from step 0 when there is
  none yet (what a launcher's restart needs: the same command resumes or starts).
- `save(...)`: the Trainer's own save, staged under `OUTPUT_DIR/.saving/` and renamed into place
  once every rank wrote its files (`store.py`), with `hf_pretrain_state.json` beside it; old
  checkpoints are rotated only after the rename; a full disk is named as such. With
  `async_checkpoint` the large files are written in the background (`background.py`): `wait()`,
  `raise_if_failed()` (each step) and `finish()` (the end of `train()`) keep its guarantees.
- `clear_interrupted()`: what a killed save left in `.saving/` goes at the next start.
- `resume_target(flag)` / `check_resume(args)`: for scripts: the flag's `true` / `last` as `True`, and the same
  check as `resolve` before any data work (the example's first-hour refusal).
"""

from __future__ import annotations

import contextlib
import functools
import os
import shutil
from pathlib import Path

import psutil
import torch
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import rotate_checkpoints
from transformers.utils import logging

from ..fsdp import sharded_saves, sharded_state_writes, sharding_requested
from ..loss_guard import LossSpikeError
from ..private import patched, rotation_deferred, writes_routed
from ..processes import wait_for_everyone
from .background import (
    ASYNC_CHECKPOINT_DEFAULT,
    HOST_MEMORY_SHARE,
    BackgroundSaves,
    CheckpointWriteError,
    DeepSpeedWrites,
    staged_bytes,
    stepped_storages,
)
from .check import CheckpointCheck, CheckpointError, check_checkpoint, checkpoints_newest_first, explain
from .store import (
    checkpoint_name,
    clear_staging,
    disk_full_error,
    promote,
    staging_root,
    write_run_state,
)

logger = logging.get_logger(__name__)
AUTO = "auto"  # resume_from_checkpoint: the newest whole checkpoint if any, else start


def is_auto(resume_from_checkpoint: str | bool | None) -> bool:
    return isinstance(resume_from_checkpoint, str) and resume_from_checkpoint.lower() == AUTO


def find_resume_checkpoint(
    resume_from_checkpoint: str | bool, output_dir: str, **settings
) -> tuple[CheckpointCheck | None, list[str]]:
    """The checkpoint a resume reads and the newer ones skipped (each with why), or `CheckpointError` naming the fix.
    Reads files only: the example calls it before any data work, the trainer when training starts. `settings`:
    `check_checkpoint`'s (world_size, deepspeed, fsdp, save_only_model)."""
    candidates = checkpoints_newest_first(output_dir)
    if resume_from_checkpoint is not True and not is_auto(resume_from_checkpoint):
        check = check_checkpoint(resume_from_checkpoint, **settings)
        if check.ok:
            return check, []
        others = (p for p in candidates if p != Path(check.path) and check_checkpoint(p, **settings).ok)
        newest = next(others, None)
        raise CheckpointError(  # Trainer's wording first, so code that matches it still does
            f"Can't find a valid checkpoint at {check.path}: {explain(check)}. Fix: resume from a whole checkpoint"
            + (f" (the newest one is {newest}, or pass resume_from_checkpoint=True)" if newest else "")
            + ", or start anew from the weights (from_pretrained) without resume_from_checkpoint."
        )
    skipped = []
    for candidate in candidates:
        check = check_checkpoint(candidate, **settings)
        if check.ok:
            return check, skipped
        skipped.append(f"{candidate.name}: {explain(check)}")
    if is_auto(resume_from_checkpoint):
        return None, skipped
    found = f" ({' | '.join(skipped)})" if skipped else ""
    raise CheckpointError(
        f"No valid checkpoint found in output directory ({output_dir}): no whole checkpoint-N{found}. "
        "Fix: pass the output_dir of the run to resume, or train without resume_from_checkpoint."
    )


def resume_target(resume_from_checkpoint: str | bool | None) -> str | bool | None:
    """A command line's `--resume_from_checkpoint` as `train()` takes it: `true` / `last` (any case) mean the newest
    whole checkpoint (`True`); `auto`, a path and None pass unchanged."""
    return {"true": True, "last": True}.get(str(resume_from_checkpoint).lower(), resume_from_checkpoint)


def check_resume(args) -> None:
    """Refuse, before any data work, a resume that cannot be done (`CheckpointError` naming the fix): a script calls
    it right after parsing its flags; the trainer checks again when training starts."""
    resume = resume_target(args.resume_from_checkpoint)
    if not resume:
        return
    deepspeed, fsdp = sharding_requested(args)
    find_resume_checkpoint(
        resume,
        args.output_dir,
        world_size=args.world_size,
        deepspeed=deepspeed,
        fsdp=fsdp,
        save_only_model=args.save_only_model,
    )


class Checkpointing:
    def __init__(self, trainer):
        self.trainer = trainer
        self.staging: str | None = None  # where the Trainer's save writes while a save is staged
        self.writer = None  # the asynchronous save's DeferredWriter while it is being staged
        self.background: BackgroundSaves | None = None  # async_checkpoint, once the first save found it usable
        self._sync_reason: str | None = None  # why saves are synchronous although async_checkpoint asks otherwise
        self.staged_estimate = 0  # the bytes a save copies into host memory on this rank (`staged_bytes`)
        self._polled_step: int | None = None  # the optimizer step whose first micro-batch polled the save in flight

    def clear_interrupted(self) -> None:
        args = self.trainer.args
        if args.should_save:
            left = clear_staging(args.output_dir)
            if left:
                print(f"Removed what an interrupted save left in {staging_root(args.output_dir)}: {left}")
        wait_for_everyone(self.trainer.accelerator)

    def resolve(self, resume_from_checkpoint: str | bool | None) -> str | None:
        if not resume_from_checkpoint:
            return None
        trainer = self.trainer
        main = trainer.is_world_process_zero()
        settings = dict(
            world_size=trainer.args.world_size,
            deepspeed=trainer.is_deepspeed_enabled,
            fsdp=trainer.is_fsdp_enabled,
            save_only_model=trainer.args.save_only_model,
        )
        check, skipped = find_resume_checkpoint(resume_from_checkpoint, trainer.args.output_dir, **settings)
        found = f" ({' | '.join(skipped)})" if skipped else ""
        if check is None:  # "auto" with nothing whole yet
            if main:
                logger.warning(f"No whole checkpoint in {trainer.args.output_dir} yet{found}: starting at step 0.")
            return None
        if (skipped or is_auto(resume_from_checkpoint)) and main:
            logger.warning(
                f"Resuming from {check.path}, the newest whole checkpoint"
                + ("; skipped: " + " | ".join(skipped) if skipped else "")
            )
        else:
            self._say_resuming(check.path)
        self._warn(check)
        return check.path

    def _say_resuming(self, path: str) -> None:
        if self.trainer.is_world_process_zero():
            print(f"Resuming from {path}", flush=True)

    def _warn(self, check) -> None:
        for warning in check.warnings if self.trainer.is_world_process_zero() else ():
            logger.warning(f"{check.path}: {warning}.")

    def rollback_checkpoint(self, spike_step: int) -> str:
        """The newest whole checkpoint, for the loss guard's roll-back after a spike at `spike_step`."""
        try:
            return self.resolve(True)
        except ValueError as error:
            raise LossSpikeError(
                f"loss spike at step {spike_step} and no checkpoint in {self.trainer.args.output_dir} to roll back "
                "to: save checkpoints (save_strategy='steps', save_steps=N) or use loss_spike_action='skip'."
            ) from error

    def run_state(self) -> dict:
        """What `hf_pretrain_state.json` holds beside the Trainer's files: the data position, the loss guard's state."""
        trainer = self.trainer
        state = trainer.data_position.state_now(trainer.state.global_step)
        if trainer.loss_guard is not None:
            state["loss_guard"] = trainer.loss_guard.state()
        state.update(trainer.recovery.run_state())
        return state

    def save(self, save_checkpoint, run_dir: str, run_state: dict) -> None:
        """`save_checkpoint()` (the Trainer's) staged, then renamed into `run_dir/checkpoint-N`."""
        name = checkpoint_name(self.trainer.state.global_step)
        staged, final = os.path.join(staging_root(run_dir), name), os.path.join(run_dir, name)
        background = self._background()
        if background is not None:
            background.wait(next_save=name)  # one save in flight at most
            background.raise_if_failed()
        try:
            self._save_staged(save_checkpoint, run_dir, staged, final, run_state, background)
        except (OSError, RuntimeError) as error:  # a full disk: say so (space measured first); free the half save
            full = disk_full_error(error, run_dir, name)
            shutil.rmtree(staged, ignore_errors=True)
            if full is None:
                raise
            raise full from error

    def _save_staged(self, save_checkpoint, run_dir: str, staged: str, final: str, run_state: dict, background) -> None:
        trainer = self.trainer
        self.staging = staging_root(run_dir)
        try:
            with (
                rotation_deferred(),
                background.deferred_writes(self._stepped()) if background else contextlib.nullcontext() as writer,
                self._routed_to(writer),
            ):
                self.writer = writer
                save_checkpoint()
        finally:
            self.staging = self.writer = None
        best = trainer.state.best_model_checkpoint
        if best and best.startswith(staging_root(run_dir)):
            trainer.state.best_model_checkpoint = os.path.join(run_dir, os.path.basename(best))
            if trainer.args.should_save:
                trainer.state.save_to_json(os.path.join(staged, TRAINER_STATE_NAME))
        if trainer.args.should_save:
            write_run_state(staged, run_state)
        if background is not None:  # the files are written, gathered and renamed by the background writer
            name = os.path.basename(final)
            failed = functools.partial(self._write_failed, name, staged, run_dir)
            background.submit(name, writer.writes, functools.partial(self._promote, staged, final, run_dir), failed)
            return
        wait_for_everyone(trainer.accelerator)  # every rank's files are in place
        self._promote(staged, final, run_dir)
        wait_for_everyone(trainer.accelerator)

    def _routed_to(self, writer):
        """The Trainer's, DeepSpeed's and FSDP2's checkpoint files go to `writer` (an asynchronous save's) for one
        save: transformers' module globals (private.py), the one DeepSpeed engine's checkpoint engine, the sharded
        FSDP2 saves (fsdp.py). No function of torch, safetensors or DCP is replaced."""
        stack = contextlib.ExitStack()
        if writer is None:
            return stack
        trainer = self.trainer
        stack.enter_context(writes_routed(writer, *sharded_state_writes(trainer, writer)))
        if trainer.is_deepspeed_enabled:
            engine = trainer.model_wrapped
            stack.enter_context(patched(engine, "checkpoint_engine", DeepSpeedWrites(engine.checkpoint_engine, writer)))
        return stack

    def torch_save(self, obj, path: str) -> None:
        """`torch.save` of a file into the checkpoint being saved (for a subclass's or a callback's own file):
        deferred with the save's other writes when it is asynchronous, written at once otherwise."""
        if self.writer is not None:
            self.writer.torch_save(obj, path)
        else:
            torch.save(obj, path)

    def _promote(self, staged: str, final: str, run_dir: str) -> None:
        trainer = self.trainer
        if trainer.args.should_save:
            promote(staged, final)
            rotate_checkpoints(
                output_dir=run_dir,
                save_total_limit=trainer.args.save_total_limit,
                best_model_checkpoint=trainer.state.best_model_checkpoint,
                use_mtime=True,
            )

    # Asynchronous saves (background.py)
    def _background(self) -> BackgroundSaves | None:
        """The background writer when saves are asynchronous; decided at the first save, the same on every rank."""
        if self.background is not None or self._sync_reason is not None:
            return self.background
        trainer, args = self.trainer, self.trainer.args
        if not getattr(args, "async_checkpoint", ASYNC_CHECKPOINT_DEFAULT):
            self._sync_reason = "async_checkpoint=False"
            return None
        background = BackgroundSaves(
            args.process_index,
            args.world_size,
            args.ddp_timeout,
            waiting=lambda: trainer.recovery.phase("checkpoint", count=False),  # the next step's wait for the copy
        )
        reason = self._why_synchronous(background)
        if background.agree(reason is None):
            self.background = background
            return background
        self._sync_reason = reason or "another host's memory cannot hold its ranks' copies of the state"
        if trainer.is_world_process_zero() or reason:
            logger.warning(f"Checkpoints are saved synchronously (async_checkpoint is on): {self._sync_reason}.")
        return None

    def _stepped(self) -> set[int] | None:
        """The storages whose copy may run beside the next step (`background.py`); None under DeepSpeed."""
        trainer = self.trainer
        return None if trainer.is_deepspeed_enabled else stepped_storages(trainer.model, trainer.optimizer)

    def _why_synchronous(self, background: BackgroundSaves) -> str | None:
        """Why this rank's saves cannot be asynchronous; every rank calls it (the host's total is gathered)."""
        args = self.trainer.args
        self.staged_estimate = self._staged_estimate()
        host_total, ranks = background.on_this_host(self.staged_estimate)  # a collective: before any return
        if args.push_to_hub:
            return "push_to_hub uploads a checkpoint's files as it is saved"
        if args.load_best_model_at_end:
            return "load_best_model_at_end reads the best checkpoint as soon as it is saved"
        available = psutil.virtual_memory().available
        if host_total > HOST_MEMORY_SHARE * available:
            return (
                f"the {ranks} rank(s) on this host would copy {host_total / 2**30:.1f} GiB of state into host memory "
                f"(rank {args.process_index}: {self.staged_estimate / 2**30:.1f} GiB), more than {HOST_MEMORY_SHARE:.0%} "
                f"of the memory available ({available / 2**30:.1f} GiB)"
            )
        return None

    def _staged_estimate(self) -> int:
        """The bytes a save of this rank copies into host memory (`staged_bytes`), from the backend's layout."""
        trainer, args = self.trainer, self.trainer.args
        stage = trainer.accelerator.state.deepspeed_plugin.zero_stage if trainer.is_deepspeed_enabled else None
        sharded = sharded_saves(trainer)
        return staged_bytes(
            trainer.model,
            trainer.optimizer,
            writes_model=args.should_save,
            holds_optimizer=args.should_save or sharded or trainer.is_deepspeed_enabled,
            sharded=sharded,
            module_again=args.should_save and stage in (0, 1, 2),
            gathered=trainer.is_fsdp_enabled and not sharded,
        )

    def raise_if_failed(self) -> None:
        """A background write that failed is raised here, on every rank by the same training step (`settled`: within
        two steps after the write ended on every rank). Called at every micro-batch; polls once per optimizer step."""
        step = self.trainer.state.global_step
        if self.background is None or step == self._polled_step:
            return
        self._polled_step = step
        if self.background.settled():
            self.background.raise_if_failed()

    def finish(self) -> None:
        """The save in flight completes (or raises) before `train()` returns; the host copy is freed (the choice of
        asynchronous saves and the checkpointer's group stay for the next `train()`)."""
        if self.background is not None:
            self.background.close()
            self.background.raise_if_failed()

    def settle_after_failure(self) -> None:
        """A one-process `train()` that raises first lets its save in flight finish, so a `train()` that follows in
        the same process (a notebook, a retry loop) finds that checkpoint whole rather than racing its writer for
        `.saving/`. With several ranks the write waits on the others, which may be gone: the process ends as it is
        and the next start clears what the write left."""
        background = self.background
        if background is None or self.trainer.args.world_size != 1:
            return
        background.close()
        if background.error is not None:  # the exception in flight stands; this one is said, not lost
            logger.warning(f"The background save in flight when train() failed also failed: {background.error}")
            background.error = None

    def _write_failed(self, name: str, staged: str, run_dir: str, error: BaseException | None, failed: list[int]):
        """The error the next step raises for a failed background write; the half-written folder goes."""
        if self.trainer.args.should_save:
            shutil.rmtree(staged, ignore_errors=True)
        if error is not None and (full := disk_full_error(error, run_dir, name)) is not None:
            full.__cause__ = error
            return full
        if error is None:
            return CheckpointWriteError(
                f"{name}: the background write failed on rank(s) {failed} (their logs say why); the checkpoints "
                f"already in {run_dir} are intact."
            )
        wrapped = CheckpointWriteError(
            f"{name}: the background write failed on rank {self.trainer.args.process_index} ({type(error).__name__}: "
            f"{str(error).splitlines()[0][:300] if str(error) else ''}); the checkpoints already in {run_dir} are intact."
        )
        wrapped.__cause__ = error
        return wrapped
