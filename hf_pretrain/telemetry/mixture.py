"""`MixtureCallback`: the realised token share of each source of a data mixture in every training log.

Attached when the training dataset is a `data/mixture.py` `MixtureDataset` (read in its order, so the rows trained
after `s` optimizer steps are the first `s x per_device_batch x processes x accumulation` of it; under sequence
parallelism and DeepSpeed AutoTP `processes` counts one per SP or TP group, whose ranks share each row). Keys, per source
NAME of the mixture:

- `mixture/NAME/tokens`: tokens of that source trained so far (all ranks; padding is not counted);
- `mixture/NAME/share`: those tokens over all the mixture's tokens trained so far;
- `mixture/NAME/target`: the weight of the mixture's phase the run is in (the schedule's, or the only one).

Values follow from the step and the mixture alone (kept in `state.log_history`, like the loss). `hf-pretrain report`
shows the last ones beside their targets.
"""

from __future__ import annotations

from ..callback import PretrainCallback


class MixtureCallback(PretrainCallback):
    @classmethod
    def from_arguments(cls, trainer, built=()) -> MixtureCallback | None:
        dataset = trainer.train_dataset
        return (
            cls(dataset, trainer.get_sp_size() * trainer.get_tp_size())  # the Trainer's: Ulysses SP, AutoTP
            if hasattr(dataset, "tokens_per_source") and getattr(dataset, "keeps_order", False)
            else None
        )

    def __init__(self, dataset, ranks_per_row: int = 1):
        self.dataset = dataset
        self.ranks_per_row = ranks_per_row  # the ranks of an SP or TP group share each row: one batch a group
        self.samples_per_step = 0

    def on_train_begin(self, args, state, control, **kwargs):
        groups = args.world_size // self.ranks_per_row
        self.samples_per_step = args.per_device_train_batch_size * groups * args.gradient_accumulation_steps

    def metrics_for_log(self, state) -> dict[str, float]:
        tokens = self.dataset.tokens_per_source(state.global_step * self.samples_per_step)
        total = sum(tokens.values())
        targets = self.dataset.target_weights(total)
        out: dict[str, float] = {}
        for name, count in tokens.items():
            out[f"mixture/{name}/tokens"] = count
            out[f"mixture/{name}/share"] = count / total if total else 0.0
            out[f"mixture/{name}/target"] = targets[name]
        return out
