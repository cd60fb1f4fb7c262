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
  single-process training wastes the other ranks;
- runs the attention preflight at the start of `train()` for hf_pretrain models: it fixes the
  kernel of each layer type for this device, dtype and collator (packed documents or not), writes
  `preflight.json` to the output dir and applies `args.attn_fallback` (warn / error / ignore).
  A fallback warning is repeated in the first logged metrics as `attention_fallback`, with
  `attention_step_cost_vs_best` (estimated step time against the best kernels here).
It is the one place where hf_pretrain attaches its callbacks, schedules and preflight checks.
"""

from __future__ import annotations

import os
import time

import torch
from transformers import Trainer

from ..modeling.attention import Environment, plan_attention
from ..preflight.attention import AttentionReport, attention_preflight, enforce_attention_policy


class PretrainTrainer(Trainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.extras = getattr(self.args, "pretrain_extras", True)
        self._last_log: tuple[float, int] | None = None
        self.attention_report: AttentionReport | None = None
        self._pending_preflight_logs: dict = {}
        if not self.extras:
            return
        if self.args.include_num_input_tokens_seen in ("no", False):
            self.args.include_num_input_tokens_seen = "non_padding"
        if getattr(self.data_collator, "has_padding", True) is False:
            self.args.include_num_input_tokens_seen = "all"  # nothing to subtract, and no pad id to look for
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        if launched != self.args.world_size:
            raise RuntimeError(
                f"The launcher started {launched} processes but the Trainer runs with world_size={self.args.world_size}. "
                "On a CPU-only machine pass use_cpu=True (PretrainingArguments does it by default) so the ranks join over gloo."
            )

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.extras and "loss" in logs:
            logs.update(self._throughput())
            logs.update(self._pending_preflight_logs)
            self._pending_preflight_logs = {}
        super().log(logs, start_time)

    def run_attention_preflight(self) -> AttentionReport | None:
        """Plan the attention kernels for this run, report them and apply `attn_fallback`."""
        model = self.model
        if not hasattr(model, "set_attention_plan"):
            return None
        dtype = torch.bfloat16 if self.args.bf16 else torch.float16 if self.args.fp16 else model.dtype
        env = Environment.detect(self.args.device, dtype, training=True)
        packed = bool(getattr(self.data_collator, "packed_documents", False))
        seq_len = self._sequence_length()
        report = attention_preflight(model.config, seq_len, env, packed)
        model.set_attention_plan(plan_attention(model.config, env, packed))
        policy = getattr(self.args, "attn_fallback", "warn")
        main = self.is_world_process_zero()
        enforce_attention_policy(
            report, policy if main or policy == "error" else "ignore", self.args.output_dir if main else None
        )
        if report.warnings and policy == "warn":
            self._pending_preflight_logs = {
                "attention_fallback": " | ".join(report.warnings),
                "attention_step_cost_vs_best": round(report.step_cost_vs_best, 3),
            }
        self.attention_report = report
        return report

    def _sequence_length(self) -> int:
        try:
            return len(self.train_dataset[0]["input_ids"])
        except (TypeError, KeyError, IndexError):
            return self.model.config.max_position_embeddings

    def _throughput(self) -> dict[str, float]:
        now, seen = time.perf_counter(), self.state.num_input_tokens_seen
        if self._last_log is None:
            self._last_log = (self._train_start, self._session_start_tokens)
        last_time, last_seen = self._last_log
        self._last_log = (now, seen)
        rate = (seen - last_seen) / max(now - last_time, 1e-9)
        return {"tokens_per_second": rate, "tokens_per_second_per_rank": rate / self.args.world_size}

    def train(self, *args, **kwargs):
        if self.extras:
            self.run_attention_preflight()
        self._train_start, self._last_log = time.perf_counter(), None
        self._session_start_tokens = self.state.num_input_tokens_seen
        return super().train(*args, **kwargs)
