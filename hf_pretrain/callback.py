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
"""

from __future__ import annotations

from transformers import TrainerCallback


class PretrainCallback(TrainerCallback):
    keep_in_history: bool = True

    def metrics_for_log(self, state) -> dict:
        return {}
