"""The trainer's checkpoint room: which checkpoint a resume reads, and how a checkpoint is written.

- `resolve(resume_from_checkpoint)`: the checkpoint to resume, checked first
  (`check.py`): an explicit path must be whole; `True` takes the newest whole one and
  says which it skipped and why.
- `save(...)`: the Trainer's own save, staged under `OUTPUT_DIR/.saving/` and renamed into place
  once every rank wrote its files (`store.py`), with `hf_pretrain_state.json` beside it; old
  checkpoints are rotated only after the rename; a full disk is named as such.
- `clear_interrupted()`: what a killed save left in `.saving/` goes at the next start.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import rotate_checkpoints
from transformers.utils import logging

from ..loss_guard import LossSpikeError
from ..processes import wait_for_everyone
from ..transformers_private import rotation_deferred
from .check import CheckpointError, check_checkpoint, checkpoints_newest_first, explain
from .store import (
    checkpoint_name,
    clear_staging,
    disk_full_error,
    promote,
    staging_root,
    write_run_state,
)

logger = logging.get_logger(__name__)


class Checkpointing:
    def __init__(self, trainer):
        self.trainer = trainer
        self.staging: str | None = None  # where the Trainer's save writes while a save is staged

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
        settings = dict(
            world_size=trainer.args.world_size,
            deepspeed=trainer.is_deepspeed_enabled,
            fsdp=trainer.is_fsdp_enabled,
            save_only_model=trainer.args.save_only_model,
        )
        candidates = checkpoints_newest_first(trainer.args.output_dir)
        if resume_from_checkpoint is not True:
            check = check_checkpoint(resume_from_checkpoint, **settings)
            if not check.ok:
                others = (p for p in candidates if p != Path(check.path) and check_checkpoint(p, **settings).ok)
                newest = next(others, None)
                raise CheckpointError(  # Trainer's wording first, so code that matches it still does
                    f"Can't find a valid checkpoint at {check.path}: {explain(check)}. Fix: resume from a whole checkpoint"
                    + (f" (the newest one is {newest}, or pass resume_from_checkpoint=True)" if newest else "")
                    + ", or start anew from the weights (from_pretrained) without resume_from_checkpoint."
                )
            self._warn(check)
            self._say_resuming(check.path)
            return check.path
        skipped = []
        for candidate in candidates:
            check = check_checkpoint(candidate, **settings)
            if check.ok:
                if skipped and trainer.is_world_process_zero():
                    logger.warning(
                        f"Resuming from {check.path}, the newest whole checkpoint; skipped: " + " | ".join(skipped)
                    )
                self._warn(check)
                if not skipped:
                    self._say_resuming(check.path)
                return check.path
            skipped.append(f"{candidate.name}: {explain(check)}")
        found = f" ({' | '.join(skipped)})" if skipped else ""
        raise CheckpointError(
            f"No valid checkpoint found in output directory ({trainer.args.output_dir}): no whole checkpoint-N{found}. "
            "Fix: pass the output_dir of the run to resume, or train without resume_from_checkpoint."
        )

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
        return state

    def save(self, save_checkpoint, run_dir: str, run_state: dict) -> None:
        """`save_checkpoint()` (the Trainer's) staged, then renamed into `run_dir/checkpoint-N`."""
        name = checkpoint_name(self.trainer.state.global_step)
        staged, final = os.path.join(staging_root(run_dir), name), os.path.join(run_dir, name)
        try:
            self._save_staged(save_checkpoint, run_dir, staged, final, run_state)
        except (OSError, RuntimeError) as error:  # a full disk: say so (space measured first); free the half save
            full = disk_full_error(error, run_dir, name)
            shutil.rmtree(staged, ignore_errors=True)
            if full is None:
                raise
            raise full from error

    def _save_staged(self, save_checkpoint, run_dir: str, staged: str, final: str, run_state: dict) -> None:
        trainer = self.trainer
        self.staging = staging_root(run_dir)
        try:
            with rotation_deferred():
                save_checkpoint()
        finally:
            self.staging = None
        best = trainer.state.best_model_checkpoint
        if best and best.startswith(staging_root(run_dir)):
            trainer.state.best_model_checkpoint = os.path.join(run_dir, os.path.basename(best))
            if trainer.args.should_save:
                trainer.state.save_to_json(os.path.join(staged, TRAINER_STATE_NAME))
        if trainer.args.should_save:
            write_run_state(staged, run_state)
        wait_for_everyone(trainer.accelerator)  # every rank's files are in place
        if trainer.args.should_save:
            promote(staged, final)
            rotate_checkpoints(
                output_dir=run_dir,
                save_total_limit=trainer.args.save_total_limit,
                best_model_checkpoint=trainer.state.best_model_checkpoint,
                use_mtime=True,
            )
        wait_for_everyone(trainer.accelerator)
