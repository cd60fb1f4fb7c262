"""The linear conversion of the low-precision recipes: which linears, the swap, and back.

Linear selection (both libraries): a `nn.Linear` is converted only when both dimensions are
divisible by 16 and at least `min_features`, it is not the LM head, and (optionally,
`keep_first_last_blocks`) not in the first or last decoder block. Every linear gets a
`LinearDecision` with the reason; an unsupported one is skipped and the conversion continues
(accelerate's TE conversion stops at the first one instead).

MoE experts: the experts of an MoE layer are 3D parameters (E x out x in) multiplied in the MoE
module's own forward, not `nn.Linear` modules, so no recipe converts them; the report counts them
as kept in high precision (with their share of the parameters), rather than reporting "16 of 17
linears converted" for a model whose weights are mostly experts.

Evaluation, generation and saving run without the low-precision path: `high_precision(model)`
swaps every converted linear back to a plain `nn.Linear` sharing the same weight tensors (exact,
no copy) and restores them on exit; `remove_precision` does it for good. torchao keeps its master
weights in high precision, so a saved checkpoint is plain weights that load without torchao or TE.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass, field

from torch import nn

MIN_FEATURES = 64  # narrower linears stay in high precision (`precision_min_features`)


@dataclass
class LinearDecision:
    name: str
    shape: tuple[int, int]  # (out_features, in_features)
    converted: bool
    reason: str


@dataclass
class ExpertGroup:
    """The experts of one MoE layer: 3D weights (E x out x in) no recipe converts."""

    name: str
    num_experts: int
    parameters: int


@dataclass
class PrecisionReport:
    recipe: str
    options: dict
    linears: list[LinearDecision] = field(default_factory=list)
    experts: list[ExpertGroup] = field(default_factory=list)  # kept in high precision
    emulated: str | None = None  # why the recipe runs emulated on this device, None when native
    converted_parameters: int = 0
    total_parameters: int = 0

    @property
    def converted(self) -> list[LinearDecision]:
        return [d for d in self.linears if d.converted]

    def summary(self) -> str:
        skipped = [d for d in self.linears if not d.converted]
        reasons = sorted({d.reason for d in skipped})
        text = f"precision {self.recipe}: {len(self.converted)} of {len(self.linears)} linears converted" + (
            f"; kept in high precision: {len(skipped)} ({'; '.join(reasons)})" if skipped else ""
        )
        if self.experts:
            counts = sorted({g.num_experts for g in self.experts})
            kept = sum(g.parameters for g in self.experts)
            text += (
                f"; MoE experts kept in high precision: {len(self.experts)} layers x "
                f"{'/'.join(map(str, counts))} experts ({self._share(kept)} of the parameters: 3D expert weights, "
                "not nn.Linear)"
            )
        if self.total_parameters and self.linears:
            text += f"; {self._share(self.converted_parameters)} of the parameters run in {self.recipe}"
        if self.emulated:
            text += f"; EMULATED here: {self.emulated}"
        return text

    def _share(self, parameters: int) -> str:
        return f"{parameters / self.total_parameters:.0%}" if self.total_parameters else "?"


def _block_index(name: str) -> int | None:
    match = re.search(r"layers\.(\d+)\.", name)
    return int(match.group(1)) if match else None


def select_linears(
    model: nn.Module, min_features: int = MIN_FEATURES, keep_first_last_blocks: bool = False, divisible_by: int = 16
) -> list[LinearDecision]:
    """A decision for every `nn.Linear` of the model: convert, or keep and why."""
    blocks = [i for n, _ in model.named_modules() if (i := _block_index(n + ".")) is not None]
    last = max(blocks) if blocks else None
    decisions = []
    for name, module in model.named_modules():
        if type(module) is not nn.Linear:
            continue
        out_f, in_f = module.out_features, module.in_features
        block = _block_index(name + ".")
        if name.endswith("lm_head"):
            reason = "LM head kept in high precision"
        elif out_f % divisible_by or in_f % divisible_by:
            reason = f"dims not divisible by {divisible_by}"
        elif min(out_f, in_f) < min_features:
            reason = f"smaller than min_features={min_features}"
        elif keep_first_last_blocks and block in (0, last):
            reason = "first/last block kept in high precision"
        else:
            reason = ""
        decisions.append(LinearDecision(name, (out_f, in_f), not reason, reason or "converted"))
    return decisions


def _swap(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def _has_bias(module: nn.Module) -> bool:
    # TE's Linear(bias=False) keeps an empty tensor as `bias`, not None
    return isinstance(module.bias, nn.Parameter) and module.bias.numel() > 0


def _plain_linear(module: nn.Module) -> nn.Linear:
    """A plain nn.Linear sharing `module`'s weight and bias tensors (no copy)."""
    bias = _has_bias(module)
    plain = nn.Linear(module.in_features, module.out_features, bias=bias, device="meta")
    plain.weight = module.weight
    plain.bias = module.bias if bias else None
    return plain


def expert_groups(model: nn.Module) -> list[ExpertGroup]:
    """Modules holding 3D expert weights (hf_pretrain's and transformers' MoE layout: E x out x in)."""
    groups = []
    for name, module in model.named_modules():
        weights = [p for p in module.parameters(recurse=False) if p.dim() == 3]
        if weights:
            groups.append(ExpertGroup(name, weights[0].shape[0], sum(p.numel() for p in weights)))
    return groups


def convert_torchao(model: nn.Module, chosen: set[str], scaling: str) -> None:
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    if scaling not in ("tensorwise", "rowwise"):
        raise ValueError(f"scaling={scaling!r} is invalid for fp8; use 'tensorwise' or 'rowwise'.")
    config = Float8LinearConfig.from_recipe_name(scaling)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda module, fqn: fqn in chosen)


def _te_recipe(recipe: str, scaling: str):
    from transformer_engine.common import recipe as te_recipe

    if recipe == "te-mxfp8":
        return te_recipe.MXFP8BlockScaling()
    if recipe == "te-nvfp4":
        return te_recipe.NVFP4BlockScaling()
    if scaling not in ("delayed", "current"):
        raise ValueError(f"scaling={scaling!r} is invalid for te-fp8; use 'delayed' or 'current'.")
    return te_recipe.DelayedScaling() if scaling == "delayed" else te_recipe.Float8CurrentScaling()


def _te_autocast(te, fp8_recipe):
    """TE's autocast context: `te.autocast(recipe=)` in current releases, `te.fp8_autocast(fp8_recipe=)` before."""
    if hasattr(te, "autocast"):
        return te.autocast(enabled=True, recipe=fp8_recipe)
    return te.fp8_autocast(enabled=True, fp8_recipe=fp8_recipe)


def convert_transformer_engine(model: nn.Module, chosen: set[str], recipe: str, scaling: str) -> None:
    import transformer_engine.pytorch as te

    fp8_recipe = _te_recipe(recipe, scaling)  # first: a bad option must not leave a half-converted model
    for name in chosen:
        old = model.get_submodule(name)
        new = te.Linear(
            old.in_features,
            old.out_features,
            bias=old.bias is not None,
            params_dtype=old.weight.dtype,
            device=old.weight.device,
        )
        new.weight = old.weight  # the same Parameter: the optimizer and the checkpoint keep seeing one tensor
        if old.bias is not None:
            new.bias = old.bias
        _swap(model, name, new)
    # Hooks, not a replaced `forward`: the signature stays (the Trainer reads it), and copies keep working.
    contexts = []

    def enter(module, args):
        contexts.append(_te_autocast(te, fp8_recipe))
        contexts[-1].__enter__()

    def leave(module, args, output):
        contexts.pop().__exit__(None, None, None)

    model._te_hooks = (model.register_forward_pre_hook(enter), model.register_forward_hook(leave, always_call=True))


def _converted_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Module) and _is_low_precision_linear(m)]


def _is_low_precision_linear(module: nn.Module) -> bool:
    kind = type(module)
    return kind.__name__ == "Float8Linear" or (
        kind.__module__.startswith("transformer_engine") and kind.__name__ == "Linear"
    )


def remove_precision(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Swap every converted linear back to a plain `nn.Linear` (same tensors); returns what was removed."""
    removed = _converted_modules(model)
    for name, module in removed:
        _swap(model, name, _plain_linear(module))
    for handle in getattr(model, "_te_hooks", ()):
        handle.remove()
    model._te_hooks = ()
    return removed


@contextlib.contextmanager
def high_precision(model: nn.Module):
    """Run evaluation / generation / saving without the low-precision path; restores it on exit."""
    removed = _converted_modules(model)
    plain = {name: _plain_linear(module) for name, module in removed}
    for name, module in plain.items():
        _swap(model, name, module)
    try:
        yield model
    finally:
        for name, module in removed:
            _swap(model, name, module)
