"""`LossGuardCallback`: skip updates with a NaN/inf loss or gradient; catch loss spikes.

Before every optimizer step (`on_pre_optimizer_step`) the guard looks at the step's loss (the sum
of its micro-batch losses, which `PretrainTrainer.training_step` hands over) and at the gradients:
- a non-finite loss or gradient norm -> the update is skipped (PretrainTrainer's optimizer step
  is a no-op for that step; the Trainer zeroes the gradients after it), counted and logged. The
  gradient test reads the total norm the Trainer has just computed for clipping and for its
  `grad_norm` log (`Trainer._get_grad_norm`, handed over by PretrainTrainer: `record_grad_norm`):
  a NaN or inf in any gradient makes that norm non-finite, so one float test replaces a second
  pass over every gradient (`torch._foreach_norm`, most of the callbacks' cost on a CPU step).
  Under FSDP that norm is the global one, so every rank decides alike. When no norm was handed
  over for the step (DeepSpeed, whose engine computes and clips its norm inside its own step; a
  Trainer without the hook) the guard computes the per-tensor norms itself;
- a finite loss above `spike_factor` x the median of the last `window` good step losses -> the
  `spike_action`: `log` (record it, train on), `skip` (skip the update like a NaN), `stop` (raise
  `LossSpikeError`, a typed error a launcher can catch), `rollback` (skip the update, end this
  pass; `PretrainTrainer.train` reloads the newest checkpoint and trains on from there with the
  learning rate multiplied by `rollback_lr_factor`, at most `max_rollbacks` times, then stops
  with `LossSpikeError`).
The step loss is averaged over ranks first, so every rank takes the same decision. Every event
is appended to `OUTPUT_DIR/loss_guard.jsonl` (main process) with step, kind, loss and the median
it was compared with. The learning-rate schedule still advances on a skipped step. The
learning-rate scale (`lr_scale`, 1 until a roll-back) is applied at each optimizer step and kept
in every checkpoint (`state()`), so a later resume keeps the lowered rate.

Logs, from the first event on (a healthy run logs nothing of its own):
`loss_guard_skipped` (updates skipped so far), `loss_guard_spikes` (spikes so far),
`loss_guard_rollbacks` and `loss_guard_lr_scale` (after a roll-back) and, for the log that follows
an event, `loss_guard_event` (text).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import types
from pathlib import Path

import torch
import torch.distributed as dist
from transformers.utils import logging

from ..callback import PretrainCallback

logger = logging.get_logger(__name__)

ACTIONS = ("log", "skip", "stop", "rollback")
ARGUMENTS = {  # PretrainingArguments fields -> defaults (their one home)
    "loss_guard": True,
    "loss_spike_factor": 3.0,
    "loss_spike_window": 20,
    "loss_spike_action": "log",
    "loss_spike_lr_factor": 0.5,
    "loss_spike_max_rollbacks": 3,
}


class LossSpikeError(RuntimeError):
    """Raised by the loss guard with spike_action="stop"."""


class LossGuardCallback(PretrainCallback):
    keep_in_history = False  # events go to loss_guard.jsonl and the logs; the history stays Trainer's
    arguments = ARGUMENTS

    def __init__(
        self,
        spike_factor: float = ARGUMENTS["loss_spike_factor"],
        window: int = ARGUMENTS["loss_spike_window"],
        spike_action: str = ARGUMENTS["loss_spike_action"],
        output_dir: str | None = None,
        rollback_lr_factor: float = ARGUMENTS["loss_spike_lr_factor"],
        max_rollbacks: int = ARGUMENTS["loss_spike_max_rollbacks"],
    ):
        if spike_action not in ACTIONS:
            raise ValueError(f"loss_spike_action={spike_action!r} is invalid; use one of {list(ACTIONS)}.")
        if not 0 < rollback_lr_factor <= 1:
            raise ValueError(f"loss_spike_lr_factor={rollback_lr_factor} is invalid; use a factor in (0, 1].")
        self.spike_factor, self.window, self.spike_action = spike_factor, window, spike_action
        self.rollback_lr_factor, self.max_rollbacks = rollback_lr_factor, max_rollbacks
        self.lr_scale = 1.0
        self.rollbacks = 0
        self.rollback_from: int | None = None  # the spiking step of a requested roll-back
        self.path = Path(output_dir) / "loss_guard.jsonl" if output_dir else None
        self.model = None  # set by PretrainTrainer
        self.skip_next_update = False
        self.skipped = self.spikes = 0
        self.history: list[float] = []
        self.events: list[dict] = []
        self._losses: list[torch.Tensor] = []
        self._grad_norm: torch.Tensor | float | None = None  # this step's total norm, when the Trainer gave one
        self._pending: dict = {}

    @classmethod
    def from_arguments(cls, trainer, built=()) -> LossGuardCallback | None:
        settings = cls.settings(trainer.args)
        if not settings["loss_guard"]:
            return None
        guard = cls(
            settings["loss_spike_factor"],
            settings["loss_spike_window"],
            settings["loss_spike_action"],
            trainer.args.output_dir,
            settings["loss_spike_lr_factor"],
            settings["loss_spike_max_rollbacks"],
        )
        guard.model = trainer.model
        return guard

    def record_loss(self, loss: torch.Tensor) -> None:
        self._losses.append(loss.detach().float())

    def record_grad_norm(self, norm: torch.Tensor | float | None) -> None:
        """The step's total gradient norm as the Trainer computed it (before clipping), or None when it has none."""
        self._grad_norm = norm

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        step = state.global_step + 1
        loss = self._step_loss()
        if not (math.isfinite(loss) and self._grads_finite()):
            self._event(args, step, "nonfinite", loss, None, skip=True)
            return
        median = statistics.median(self.history) if len(self.history) >= min(self.window, 5) else None
        if median is not None and loss > self.spike_factor * median:
            self.spikes += 1
            self._event(args, step, "spike", loss, median, skip=self.spike_action in ("skip", "rollback"))
            if self.spike_action == "stop":
                raise LossSpikeError(
                    f"loss {loss:.4g} at step {step} is above {self.spike_factor} x the median {median:.4g}"
                )
            if self.spike_action == "rollback":
                self.rollback_from = step
                control.should_training_stop = True
                return control
            return
        self.history = (self.history + [loss])[-self.window :]

    def on_step_end(self, args, state, control, **kwargs):
        if self.rollback_from is not None:
            control.should_save = False  # never checkpoint the step that is being rolled back
        return control

    def _grads_finite(self) -> bool:
        """Whether every gradient of this step is finite: from the Trainer's total norm when it handed one over
        (read once: the next step needs its own), else from the norm of each gradient."""
        norm, self._grad_norm = self._grad_norm, None
        if norm is not None:
            norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # a DTensor norm (FSDP2)
            return math.isfinite(float(norm))
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        return bool(torch.isfinite(torch.stack(torch._foreach_norm(grads))).all()) if grads else True

    def _step_loss(self) -> float:
        """This step's loss (sum over its micro-batches), averaged over ranks: one decision for all."""
        if not self._losses:
            return float("nan")
        loss = torch.stack(self._losses).sum()
        self._losses = []
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(loss)
            loss = loss / dist.get_world_size()
        return loss.item()

    def start_rollback(self, args, checkpoint: str) -> None:
        """Called by PretrainTrainer before it resumes from `checkpoint`: lower the learning rate."""
        if self.rollbacks >= self.max_rollbacks:
            raise LossSpikeError(
                f"loss spike at step {self.rollback_from} after {self.rollbacks} roll-backs "
                f"(loss_spike_max_rollbacks={self.max_rollbacks}): stopping."
            )
        self.rollbacks += 1
        self.lr_scale *= self.rollback_lr_factor
        self._write(args, {"step": self.rollback_from, "kind": "rollback", "to": checkpoint, "lr_scale": self.lr_scale})
        self._pending["loss_guard_event"] = (
            f"rolled back from step {self.rollback_from} to {os.path.basename(checkpoint)}, lr x{self.lr_scale:g}"
        )
        self.rollback_from = None
        self.skip_next_update = False

    def state(self) -> dict:
        return {
            "lr_scale": self.lr_scale,
            "rollbacks": self.rollbacks,
            "skipped": self.skipped,
            "spikes": self.spikes,
            "history": self.history,
        }

    def load_state(self, saved: dict) -> None:
        self.lr_scale = saved.get("lr_scale", 1.0)
        self.rollbacks, self.skipped = saved.get("rollbacks", 0), saved.get("skipped", 0)
        self.spikes, self.history = saved.get("spikes", 0), list(saved.get("history", []))

    def _event(self, args, step: int, kind: str, loss: float, median: float | None, skip: bool) -> None:
        self.skip_next_update = skip
        self.skipped += skip
        event = {
            "step": step,
            "kind": kind,
            "loss": loss if math.isfinite(loss) else str(loss),
            "median": median,
            "action": self.spike_action if kind == "spike" else "skip",
        }
        self.events.append(event)
        text = (
            f"step {step}: {kind} loss {loss:.4g}"
            + (f" vs median {median:.4g}" if median else "")
            + f" -> {event['action']}"
        )
        logger.warning(f"loss guard: {text}")
        self._pending["loss_guard_event"] = text
        self._write(args, event)

    def _write(self, args, event: dict) -> None:
        if self.path is not None and args.process_index == 0:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a", encoding="utf-8") as f:
                f.write(json.dumps(event) + "\n")

    def metrics_for_log(self, state) -> dict:
        """The counters once anything happened (a healthy run logs what `Trainer` logs), and the pending event."""
        pending, self._pending = self._pending, {}
        if not (self.skipped or self.spikes or self.rollbacks or pending):
            return {}
        rollbacks = (
            {"loss_guard_rollbacks": self.rollbacks, "loss_guard_lr_scale": self.lr_scale} if self.rollbacks else {}
        )
        return {"loss_guard_skipped": self.skipped, "loss_guard_spikes": self.spikes, **rollbacks, **pending}


def guard_optimizer(optimizer, guard: LossGuardCallback):
    """Make `optimizer.step()` skip the update the guard rejected and apply its learning-rate scale (after a
    roll-back; the schedule itself is untouched). Once per optimizer."""
    if getattr(optimizer, "_loss_guarded", False):
        return optimizer
    step = optimizer.step

    def guarded_step(optimizer, *args, **kwargs):
        if guard.skip_next_update:  # a NaN/inf or spiking step: no update at all
            guard.skip_next_update = False
            return None
        if guard.lr_scale == 1.0:
            return step(*args, **kwargs)
        scheduled = [group["lr"] for group in optimizer.param_groups]
        for group in optimizer.param_groups:
            group["lr"] *= guard.lr_scale
        try:
            return step(*args, **kwargs)
        finally:
            for group, lr in zip(optimizer.param_groups, scheduled, strict=True):
                group["lr"] = lr

    optimizer.step = types.MethodType(guarded_step, optimizer)  # a method, as LR schedulers expect
    optimizer._loss_guarded = True
    return optimizer
