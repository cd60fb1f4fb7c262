"""`MoECallback`: the routing health of an MoE model in every training log.

An MoE `PretrainForCausalLM` adds the statistics of each training forward to `model.moe_metrics`
(running sums kept on the device, so no host sync per step). At each logging step this callback
pops them (means over the forwards since the previous log) and `PretrainTrainer.log` merges them
into the log, like the other telemetry callbacks, so they reach the console, `report_to` and
`telemetry.jsonl`. Keys:

- `moe_aux_loss`: load-balancing loss E x sum_e f_e P_e, mean over MoE layers, before its
  coefficient (1.0 when balanced; E / k when every token picks the same k experts)
- `moe_z_loss`: router z-loss, mean of logsumexp(router logits)^2, before its coefficient
- `moe_expert_load_max` / `moe_expert_load_min`: largest / smallest fraction of the routed
  (token, expert) pairs that went to one expert, over all MoE layers and experts (uniform: 1 / E;
  a collapse shows as max -> 1 / k and min -> 0)
- `moe_dropped_fraction`: dropped pairs / routed pairs under `moe_capacity_factor` (0.0 dropless)
- with `per_layer=True` also `moe_expert_load_max_layer{j}` / `moe_expert_load_min_layer{j}` for
  the j-th MoE layer (j counts MoE layers only, in depth order)

The full (MoE layers x experts) load of the last interval stays readable as
`model.moe_metrics.last_expert_load`. The values are this rank's (no collective at log time).
Forwards without gradients (evaluation, generation) are not counted; the loss the Trainer logs as
`loss` includes router_aux_loss_coef x moe_aux_loss + router_z_loss_coef x moe_z_loss.
"""

from __future__ import annotations

from ..callback import PretrainCallback

KEYS = ("moe_aux_loss", "moe_z_loss", "moe_expert_load_max", "moe_expert_load_min", "moe_dropped_fraction")


def _moe_metrics(model):
    while model is not None and getattr(model, "moe_metrics", None) is None and hasattr(model, "module"):
        model = model.module  # DDP / DeepSpeed wrappers
    return getattr(model, "moe_metrics", None)


class MoECallback(PretrainCallback):
    @classmethod
    def from_arguments(cls, trainer, built=()) -> MoECallback | None:
        """For MoE models, unless the user attached one already."""
        experts = getattr(getattr(trainer.model, "config", None), "num_experts", 0)
        attached = any(isinstance(c, MoECallback) for c in trainer.callback_handler.callbacks)
        return cls(trainer.model) if experts and not attached else None

    def __init__(self, model=None, per_layer: bool = False):
        self.model = model
        self.per_layer = per_layer

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.model = model if model is not None else self.model
        metrics = _moe_metrics(self.model)
        if metrics is not None:
            metrics.reset()  # forwards before training (a preflight, an evaluation) are not this run's

    def metrics_for_log(self, state) -> dict[str, float]:
        """The MoE metrics since the previous call; empty for a dense model or when no training forward ran."""
        metrics = _moe_metrics(self.model)
        return metrics.pop(self.per_layer) if metrics is not None else {}
