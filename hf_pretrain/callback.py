"""`PretrainCallback`: what `PretrainTrainer` asks of the callbacks it attaches.

A `transformers.TrainerCallback` sees the Trainer's events; hf_pretrain's callbacks also hand values
to the Trainer's logs. The protocol, declared here instead of found with `hasattr`:
- `metrics_for_log(state)`: the values to merge into a training log (the one holding `loss`),
  measured since the previous call; `{}` when there is nothing new. Each callback's docstring lists
  the keys it returns.
- `keep_in_history` (class attribute): False for values read off clocks and sensors (step time,
  tokens/s, MFU, power, straggler figures). They differ between two identical runs, so
  `PretrainTrainer` keeps them out of `state.log_history` (and so out of `trainer_state.json`):
  they reach the console, `report_to` and `telemetry.jsonl` only. The loss guard's events stay out
  too (they are in `loss_guard.jsonl`), so a plain `Trainer` script keeps the history `Trainer`
  writes. True (the default) for values that follow from the computation alone and that the user
  asked for (expert load of an MoE model, generation probes), which stay in the history like the
  loss does.
- `arguments` (class attribute): the `PretrainingArguments` fields the callback reads, with their
  defaults. This is the one home of those defaults: `PretrainingArguments` declares its fields from it,
  and a plain `TrainingArguments`, which lacks them, gets them through `settings(args)`.
- `times_micro_batches` (class attribute, default False): True for a callback whose
  `before_micro_batch()` / `record_micro_batch(start, end)` the trainer calls around each
  micro-batch's forward and backward (host times); the others are not called there at all.
- `from_arguments(trainer, built)`: the callback a run's arguments ask for, or None when they turn it
  off. `built` holds the callbacks built before it (the sensor reading is shared, for one).
"""

from __future__ import annotations

from typing import Any, ClassVar

from transformers import TrainerCallback


class PretrainCallback(TrainerCallback):
    keep_in_history: ClassVar[bool] = True
    times_micro_batches: ClassVar[bool] = False
    arguments: ClassVar[dict[str, Any]] = {}

    @classmethod
    def settings(cls, args) -> dict[str, Any]:
        """This callback's fields of `args`, each with its default when `args` lacks it."""
        return {name: getattr(args, name, default) for name, default in cls.arguments.items()}

    @classmethod
    def from_arguments(cls, trainer, built: list[PretrainCallback]) -> PretrainCallback | None:
        return None

    def metrics_for_log(self, state) -> dict:
        return {}

    def before_micro_batch(self) -> None:
        pass

    def record_micro_batch(self, start: float, end: float) -> None:
        pass
