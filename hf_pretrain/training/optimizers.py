"""Muon for the hidden matrices, AdamW for the rest: `optim="muon"` of `PretrainingArguments`.

Muon (Keller Jordan 2024; Moonshot 2025) replaces each 2-D weight's update by the orthogonalised momentum, so every
direction of the matrix moves at the same rate. `torch.optim.Muon` implements it; `split_parameters` decides, for
any model, what it gets: every trainable 2-D weight (attention and MLP projections, GPT-2's `Conv1D`) but the
embeddings (a row is a lookup), the output embeddings (logits into a softmax) and MoE routers (a few expert
logits per token: an orthogonalised step would move every expert's logit alike), which stay on AdamW with the
tensors that are not 2-D (norms, biases, stacked experts) and `Trainer`'s weight-decay split, as in
modded-nanogpt and nanochat. Muon's lr is `muon_lr` scaled by torch's `adjust_lr_fn` (`match_rms_adamw`:
AdamW's learning rate and weight decay carry over; `original`: Keller's rule).

`MuonWithAdamW` is one `torch.optim.Optimizer` whose `param_groups` and `state` are the two inner optimizers' own
objects, because `Trainer` drives one optimizer with one scheduler and saves one `optimizer.pt`: the scheduler
and the loss guard set the groups in place, `state_dict()` is the standard one, `load_state_dict` re-links the
inner optimizers. Written by hand: neither torch nor transformers ships Muon + AdamW as one optimizer. Newton-Schulz
needs whole matrices, so DeepSpeed and FSDP (flat or sharded parameters) are refused when the trainer is built.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
from torch import nn
from torch.optim import AdamW, Optimizer

MUON_OPTIMIZERS = ("muon",)  # hf_pretrain's names for `optim`; the rest are transformers'
ADJUST_LR = ("match_rms_adamw", "original")
ROUTER_NAME = re.compile(r"(^|\.)(router|gate)\.weight$")


@dataclass
class MuonConfig:
    """Muon's settings; the defaults live here. `lr=None`: the AdamW learning rate."""

    lr: float | None = None
    momentum: float = 0.95
    adjust_lr: str = "match_rms_adamw"
    nesterov: bool = True
    ns_steps: int = 5

    def __post_init__(self):
        if self.adjust_lr not in ADJUST_LR:
            raise ValueError(f"muon_adjust_lr={self.adjust_lr!r} is invalid; use one of {list(ADJUST_LR)}.")
        if self.lr is not None and self.lr <= 0:
            raise ValueError(f"muon_lr={self.lr} is invalid; use a positive learning rate (or None: learning_rate).")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"muon_momentum={self.momentum} is invalid; use a momentum in [0, 1), e.g. 0.95.")

    @classmethod
    def from_arguments(cls, args) -> MuonConfig:
        given = {"lr": args.muon_lr, "momentum": args.muon_momentum, "adjust_lr": args.muon_adjust_lr}
        return cls(**{k: v for k, v in given.items() if v is not None})


def split_parameters(model: nn.Module) -> tuple[list[str], list[str]]:
    """Names of the trainable parameters for Muon and for AdamW (see the module docstring for the rule)."""
    adamw_ids = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is not None and getattr(head, "weight", None) is not None:
        adamw_ids.add(id(head.weight))
    muon, adamw = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        hidden_matrix = p.ndim == 2 and id(p) not in adamw_ids and not ROUTER_NAME.search(name)
        (muon if hidden_matrix else adamw).append(name)
    return muon, adamw


class MuonWithAdamW(Optimizer):
    """`torch.optim.Muon` and `torch.optim.AdamW` behind one `Optimizer` (see the module docstring)."""

    def __init__(self, muon_groups: list[dict], adamw_groups: list[dict], muon_kwargs: dict, adamw_kwargs: dict):
        self.muon = torch.optim.Muon(muon_groups, **muon_kwargs)
        self.adamw = AdamW(adamw_groups, **adamw_kwargs) if adamw_groups else None
        for group in self.muon.param_groups:
            group["use_muon"] = True
        adamw_param_groups = self.adamw.param_groups if self.adamw else []
        for group in adamw_param_groups:
            group["use_muon"] = False
        super().__init__(adamw_param_groups + self.muon.param_groups, defaults={})  # AdamW first: the logged lr
        self._link()

    def _link(self) -> None:
        """The inner optimizers work on this optimizer's groups and state (the same objects)."""
        self.muon.param_groups = [g for g in self.param_groups if g["use_muon"]]
        self.muon.state = self.state
        if self.adamw is not None:
            self.adamw.param_groups = [g for g in self.param_groups if not g["use_muon"]]
            self.adamw.state = self.state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.muon.step()
        if self.adamw is not None:
            self.adamw.step()
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        super().load_state_dict(state_dict)  # replaces self.param_groups and self.state
        self._link()


def build_optimizer(trainer, model: nn.Module) -> Optimizer | None:
    """The optimizer `args.pretrain_optimizer` names, or None for the Trainer's own (`optim`)."""
    args = trainer.args
    if getattr(args, "pretrain_optimizer", None) != "muon":
        return None
    config = MuonConfig.from_arguments(args)
    muon_names, adamw_names = split_parameters(model)
    if not muon_names:
        raise ValueError(
            f"optim='muon': {type(model).__name__} has no trainable hidden 2-D weight for Muon; use optim='adamw_torch'."
        )
    params = dict(model.named_parameters())
    decay = set(trainer.get_decay_parameter_names(model))
    adamw_groups = [
        {"params": [params[n] for n in adamw_names if (n in decay) == decays], "weight_decay": wd}
        for decays, wd in ((True, args.weight_decay), (False, 0.0))
    ]
    adamw_kwargs = {"lr": args.learning_rate, "betas": (args.adam_beta1, args.adam_beta2), "eps": args.adam_epsilon}
    muon_kwargs = {
        "lr": config.lr if config.lr is not None else args.learning_rate,
        "weight_decay": args.weight_decay,
        "momentum": config.momentum,
        "nesterov": config.nesterov,
        "ns_steps": config.ns_steps,
        "adjust_lr_fn": config.adjust_lr,
    }
    optimizer = MuonWithAdamW(
        [{"params": [params[n] for n in muon_names]}],
        [g for g in adamw_groups if g["params"]],
        muon_kwargs,
        adamw_kwargs,
    )
    if trainer.is_world_process_zero():
        print(describe(model, muon_names, adamw_names, muon_kwargs), flush=True)
    return optimizer


def describe(model: nn.Module, muon_names: list[str], adamw_names: list[str], muon_kwargs: dict) -> str:
    """One line: what each side holds."""
    params = dict(model.named_parameters())
    count = lambda names: sum(params[n].numel() for n in names) / 1e6  # noqa: E731
    return (
        f"optimizer: Muon for {len(muon_names)} hidden matrices ({count(muon_names):.2f} M parameters, "
        f"lr {muon_kwargs['lr']:g}, {muon_kwargs['adjust_lr_fn']}, momentum {muon_kwargs['momentum']:g}); "
        f"AdamW for {len(adamw_names)} other tensors ({count(adamw_names):.2f} M parameters)"
    )


def check_optimizer_supported(trainer) -> None:
    """Refuse Muon where the weights are not whole on each rank (DeepSpeed, FSDP), or beside an optimizer the
    user passed (`optimizers=`), which would win and leave `optim='muon'` unused without a word."""
    if getattr(trainer.args, "pretrain_optimizer", None) != "muon":
        return
    if trainer.optimizer is not None:
        raise ValueError(
            "optim='muon' and an optimizer passed in optimizers=(...) both name the optimizer: drop one "
            "(optim='adamw_torch' to keep yours, or optimizers=(None, scheduler) to train with Muon)."
        )
    sharding = "DeepSpeed" if trainer.is_deepspeed_enabled else "FSDP" if trainer.is_fsdp_enabled else None
    if sharding:
        raise ValueError(
            f"optim='muon' needs each hidden weight whole on every rank, and {sharding} shards or flattens them: "
            "train with DDP (no deepspeed/fsdp), or use optim='adamw_torch' under sharding."
        )
