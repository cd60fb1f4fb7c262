"""`PretrainTrainer`: a drop-in `transformers.Trainer` for pretraining from scratch.

Any script that runs with `Trainer(model=..., args=..., train_dataset=..., data_collator=...)` runs
unchanged with `PretrainTrainer`; with `args.pretrain_extras=False` it is `Trainer`, to the loss.
With extras on (the default) it:
- counts tokens seen (real tokens, not padding: `include_num_input_tokens_seen="non_padding"`,
  transformers' own counter, gathered over ranks, logged as `num_input_tokens_seen`) and logs, at
  every logging step, `tokens_per_second` (all ranks, over the interval since the previous log)
  and `tokens_per_second_per_rank`;
- refuses to train as one process when the launcher started several (WORLD_SIZE > 1 but the
  Trainer sees world_size 1, e.g. a GPU launch config on a CPU-only machine): silent
  single-process training wastes the other ranks.
It is the one place where hf_pretrain attaches its callbacks, schedules and preflight checks.
"""

from __future__ import annotations

import os
import time

from transformers import Trainer


class PretrainTrainer(Trainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.extras = getattr(self.args, "pretrain_extras", True)
        self._last_log: tuple[float, int] | None = None
        if not self.extras:
            return
        if self.args.include_num_input_tokens_seen in ("no", False):
            self.args.include_num_input_tokens_seen = "non_padding"
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        if launched != self.args.world_size:
            raise RuntimeError(
                f"The launcher started {launched} processes but the Trainer runs with world_size={self.args.world_size}. "
                "On a CPU-only machine pass use_cpu=True (PretrainingArguments does it by default) so the ranks join over gloo."
            )

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.extras and "loss" in logs:
            logs.update(self._throughput())
        super().log(logs, start_time)

    def _throughput(self) -> dict[str, float]:
        now, seen = time.perf_counter(), self.state.num_input_tokens_seen
        if self._last_log is None:
            self._last_log = (self._train_start, self._session_start_tokens)
        last_time, last_seen = self._last_log
        self._last_log = (now, seen)
        rate = (seen - last_seen) / max(now - last_time, 1e-9)
        return {"tokens_per_second": rate, "tokens_per_second_per_rank": rate / self.args.world_size}

    def train(self, *args, **kwargs):
        self._train_start, self._last_log = time.perf_counter(), None
        self._session_start_tokens = self.state.num_input_tokens_seen
        return super().train(*args, **kwargs)
