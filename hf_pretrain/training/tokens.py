"""Tokens seen, without writing to the user's arguments.

transformers counts tokens only when `include_num_input_tokens_seen` asks for it (off in plain
`TrainingArguments`), and then gathers the count over ranks at every micro-batch and warns at
every step for batches without the model's `main_input_name`. `TokenCounter`:
- leaves the Trainer's counter alone when the arguments ask for it, except for a collator that
  declares it never pads (`has_padding = False`, e.g. `PackedDocumentCollator`): there every token
  is real, counted as such instead of guessed from a pad id;
- otherwise sums real tokens on the device (transformers' rule: the attention mask, else tokens
  other than the pad id, else all) for throughput, and reduces the sum over ranks only when
  `tokens_seen()` is read (at a log, where every rank calls it): no sync per micro-batch.
Batches without `main_input_name` count nothing (a regression model, features instead of tokens).
Under Ulysses sequence parallelism a micro-batch here is this rank's shard of the rows (the Trainer's loader
adapter cuts them before `training_step`): both counters sum the shards over the ranks, each token once.
Under DeepSpeed AutoTP the ranks of a TP group hold the same batch (`tensor_parallel.py`): the Trainer's gather
would count it once per TP rank, so this counter counts instead, in the Trainer's field and by its rule (`all`:
every token), only on the first rank of each group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .tensor_parallel import counts_tokens, tensor_parallel_size


class TokenCounter:
    def __init__(self, trainer):
        self.trainer = trainer
        self.local: torch.Tensor | None = None  # this rank's real tokens, when the arguments do not count them

    def reset(self) -> None:
        self.local = None

    def track(self, inputs) -> bool:
        """Count a micro-batch; False when the Trainer's own counter is the one to use."""
        trainer = self.trainer
        counting = trainer.args.include_num_input_tokens_seen
        never_pads = getattr(trainer.data_collator, "has_padding", True) is False
        tp = tensor_parallel_size(trainer)
        if counting != "no" and not never_pads and tp == 1:
            return False
        count = self.real_tokens(inputs, every=counting == "all")
        if count is None:
            return True
        if tp > 1 and not counts_tokens(trainer):
            count = torch.zeros_like(count)  # another rank of this TP group counts the batch
        if counting == "no":
            self.local = count if self.local is None else self.local + count
        else:
            trainer.state.num_input_tokens_seen += trainer.accelerator.gather(count).sum().item()
        return True

    def real_tokens(self, inputs, every: bool = False) -> torch.Tensor | None:
        trainer = self.trainer
        ids = inputs.get(getattr(trainer.model, "main_input_name", "input_ids"))
        if not torch.is_tensor(ids):
            return None
        pad_id = getattr(trainer.processing_class, "pad_token_id", None)
        if every or getattr(trainer.data_collator, "has_padding", True) is False:
            count = torch.tensor(ids.numel())
        elif torch.is_tensor(inputs.get("attention_mask")):
            count = inputs["attention_mask"].sum()
        elif pad_id is not None:
            count = (ids != pad_id).sum()
        else:
            count = torch.tensor(ids.numel())
        return count.to(trainer.args.device, torch.int64)

    def tokens_seen(self, state=None) -> int:
        """Real tokens of all ranks so far: the Trainer's counter, or ours when the arguments do not count."""
        trainer = self.trainer
        if trainer.args.include_num_input_tokens_seen != "no":
            return trainer.state.num_input_tokens_seen
        if self.local is None:
            return 0
        total = self.local.clone()
        if trainer.args.world_size > 1 and dist.is_initialized():
            dist.all_reduce(total)
        return int(total.item())
