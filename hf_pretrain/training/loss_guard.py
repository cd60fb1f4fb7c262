"""`LossGuardCallback`: skip updates with a NaN/inf loss or gradient; catch loss spikes.

Before every optimizer step (`on_pre_optimizer_step`) the guard looks at the step's loss (the sum
of its micro-batch losses, which `PretrainTrainer.training_step` hands over) and at the gradients:
- a non-finite loss or gradient norm -> the update is skipped (PretrainTrainer's optimizer step
  is a no-op for that step; the Trainer zeroes the gradients after it), counted and logged;
- a finite loss above `spike_factor` x the median of the last `window` good step losses -> the
  `spike_action`: `log` (record it, train on), `skip` (skip the update like a NaN), `stop` (raise
  `LossSpikeError`, a typed error a launcher can catch). Rolling back to the last checkpoint with
  a lower learning rate is the resume path of a later release.
Every event is appended to `OUTPUT_DIR/loss_guard.jsonl` (main process) with step, kind, loss
and the median it was compared with. The learning-rate schedule still advances on a skipped step.

Logs: `loss_guard_skipped` (updates skipped so far), `loss_guard_spikes` (spikes so far) and,
for the log that follows an event, `loss_guard_event` (text).

Test-only knob: `HF_PRETRAIN_TEST_LOSS_INJECT="3:nan,7:spike"` makes `PretrainTrainer.compute_loss`
return NaN (or 50x the loss) on those optimizer steps, so the guard is tested in a real run.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from pathlib import Path

import torch
from transformers import TrainerCallback
from transformers.utils import logging

logger = logging.get_logger(__name__)

ACTIONS = ("log", "skip", "stop")
INJECT_KNOB = "HF_PRETRAIN_TEST_LOSS_INJECT"


class LossSpikeError(RuntimeError):
    """Raised by the loss guard with spike_action="stop"."""


def injected(step: int) -> str | None:
    """The test knob's injection for optimizer step `step` (1-based), if any."""
    for item in filter(None, os.environ.get(INJECT_KNOB, "").split(",")):
        at, _, kind = item.partition(":")
        if int(at) == step:
            return kind
    return None


class LossGuardCallback(TrainerCallback):
    def __init__(
        self, spike_factor: float = 3.0, window: int = 20, spike_action: str = "log", output_dir: str | None = None
    ):
        if spike_action not in ACTIONS:
            raise ValueError(f"loss_spike_action={spike_action!r} is invalid; use one of {list(ACTIONS)}.")
        self.spike_factor, self.window, self.spike_action = spike_factor, window, spike_action
        self.path = Path(output_dir) / "loss_guard.jsonl" if output_dir else None
        self.model = None  # set by PretrainTrainer
        self.skip_next_update = False
        self.skipped = self.spikes = 0
        self.history: list[float] = []
        self.events: list[dict] = []
        self._losses: list[torch.Tensor] = []
        self._pending: dict = {}

    def record_loss(self, loss: torch.Tensor) -> None:
        self._losses.append(loss.detach().float())

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        step = state.global_step + 1
        loss = torch.stack(self._losses).sum().item() if self._losses else float("nan")
        self._losses = []
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        grads_finite = bool(torch.isfinite(torch.stack(torch._foreach_norm(grads))).all()) if grads else True
        if not (math.isfinite(loss) and grads_finite):
            self._event(args, step, "nonfinite", loss, None, skip=True)
            return
        median = statistics.median(self.history) if len(self.history) >= min(self.window, 5) else None
        if median is not None and loss > self.spike_factor * median:
            self.spikes += 1
            self._event(args, step, "spike", loss, median, skip=self.spike_action == "skip")
            if self.spike_action == "stop":
                raise LossSpikeError(
                    f"loss {loss:.4g} at step {step} is above {self.spike_factor} x the median {median:.4g}"
                )
            return
        self.history = (self.history + [loss])[-self.window :]

    def _event(self, args, step: int, kind: str, loss: float, median: float | None, skip: bool) -> None:
        self.skip_next_update = skip
        self.skipped += skip
        event = {
            "step": step,
            "kind": kind,
            "loss": loss if math.isfinite(loss) else str(loss),
            "median": median,
            "action": "skip" if skip else self.spike_action,
        }
        self.events.append(event)
        text = (
            f"step {step}: {kind} loss {loss:.4g}"
            + (f" vs median {median:.4g}" if median else "")
            + f" -> {event['action']}"
        )
        logger.warning(f"loss guard: {text}")
        self._pending["loss_guard_event"] = text
        if self.path is not None and args.process_index == 0:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a", encoding="utf-8") as f:
                f.write(json.dumps(event) + "\n")

    def metrics_for_log(self, state) -> dict:
        pending, self._pending = self._pending, {}
        return {"loss_guard_skipped": self.skipped, "loss_guard_spikes": self.spikes, **pending}
