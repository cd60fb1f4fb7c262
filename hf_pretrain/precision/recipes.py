"""Precision recipes behind one API: `apply_precision(model, recipe, **options)`.

| recipe | what runs | needs |
|---|---|---|
| `fp32` | everything in fp32 | - |
| `bf16` | autocast to bf16, fp32 master weights (the Trainer's `bf16=True`) | - |
| `fp8` | PyTorch-native FP8 linears from torchao (`tensorwise` or `rowwise` scaling), bf16 elsewhere on a GPU | torchao; on a GPU compute capability >= 8.9 (on a CPU torchao emulates it, so its logic runs here) |
| `te-fp8` | Transformer Engine `Linear` under TE's autocast (forward hooks on the model), `delayed` or `current` scaling | transformer_engine, CUDA, capability >= 8.9 |
| `te-mxfp8` | TE `Linear` with MXFP8 block scaling | transformer_engine, Blackwell (capability >= 10.0) |
| `te-nvfp4` | TE `Linear` with NVFP4 block scaling | transformer_engine, Blackwell (capability >= 10.0) |

Why torchao for `fp8`: it is PyTorch's own float8 training (the path nanochat and torchtitan
use); the field notes measured it 20 % faster and 30 % lighter than TE FP8 on one machine pair,
which is why `hf-pretrain trial` runs both before a long run commits to one.

Native or emulated (`emulated(recipe, device)`): fp8 has native kernels only on fp8 tensor cores
(CUDA compute capability >= 8.9); anywhere else torchao casts to fp8 and back and runs the matmul
in a wider type, which gets fp8's numerics at more than bf16's cost. `apply_precision` says so at
run time (a warning, and `PrecisionReport.emulated`), and the trial marks such rows and never
recommends them over a native recipe. bf16 is emulated on a CPU without bf16 instructions
(oneDNN's check) and on a GPU before compute capability 8.0.

The conversion itself (which linears, the torchao / Transformer Engine swaps, and back for evaluation
and saving) is `convert.py`.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import torch
from torch import nn
from transformers.utils import logging

from .convert import (
    MIN_FEATURES,
    PrecisionReport,
    convert_torchao,
    convert_transformer_engine,
    expert_groups,
    select_linears,
)

logger = logging.get_logger(__name__)


@dataclass(frozen=True)
class Library:
    """A package a recipe converts linears with."""

    module: str  # what is imported
    label: str
    install: str  # the hint a missing package's message gives
    cuda_only: bool = False


TORCHAO = Library("torchao", "torchao", "pip install torchao")
TRANSFORMER_ENGINE = Library(
    "transformer_engine", "Transformer Engine", "pip install transformer-engine[pytorch], needs CUDA", cuda_only=True
)


@dataclass(frozen=True)
class Recipe:
    """What every part of hf_pretrain needs to know about a precision recipe, read as fields (never by name).

    - `autocast`: the dtype the Trainer autocasts to (`"bf16"`; None: fp32). `autocast_on_cpu=False`: on a
      machine without an accelerator the recipe runs around fp32 instead (fp8 is emulated there).
    - `spec_key`: the chip-table precision column its matmuls run in (`chips.py`), MFU's denominator.
    - `bytes_per_parameter`: (weights, gradients, Adam states, activation element) in the memory estimator
      (`distributed/memory.py`); low-precision recipes keep 16-bit weights and cast per matmul.
    - requirements: `library` (None: nothing to convert), the CUDA compute capability its kernels need
      (`min_capability`).
    """

    name: str
    autocast: str | None
    spec_key: str
    bytes_per_parameter: tuple[int, int, int, int]
    library: Library | None = None
    min_capability: tuple[int, int] | None = None
    autocast_on_cpu: bool = True

    @property
    def needs(self) -> str:
        """The GPU its kernels need, in words (`min_capability` set)."""
        major, minor = self.min_capability
        gpu = f"compute capability >= {major}.{minor}"
        return f"{self.name} needs " + (f"a Blackwell GPU ({gpu})" if self.min_capability >= BLACKWELL else gpu)

    @property
    def converts_linears(self) -> bool:
        """Whether `apply_precision` swaps the model's linears (a low-precision recipe)."""
        return self.library is not None


MIXED = (2, 2, 12, 2)  # 16-bit weights and gradients, fp32 master weights + Adam m, v, 16-bit activations
LOW = dict(autocast="bf16", bytes_per_parameter=MIXED, autocast_on_cpu=False)  # low-precision linears in bf16
ADA, BLACKWELL = (8, 9), (10, 0)  # fp8 tensor cores; MX / NV block-scaled formats
_RECIPES = (
    Recipe("fp32", autocast=None, spec_key="fp32", bytes_per_parameter=(4, 4, 8, 4)),
    Recipe("bf16", autocast="bf16", spec_key="bf16", bytes_per_parameter=MIXED),
    Recipe("fp8", spec_key="fp8", library=TORCHAO, min_capability=ADA, **LOW),
    Recipe("te-fp8", spec_key="fp8", library=TRANSFORMER_ENGINE, min_capability=ADA, **LOW),
    Recipe("te-mxfp8", spec_key="fp8", library=TRANSFORMER_ENGINE, min_capability=BLACKWELL, **LOW),
    Recipe("te-nvfp4", spec_key="fp4", library=TRANSFORMER_ENGINE, min_capability=BLACKWELL, **LOW),
)
RECIPES: dict[str, Recipe] = {r.name: r for r in _RECIPES}
LOW_PRECISION = tuple(name for name, r in RECIPES.items() if r.converts_linears)
# transformers' own `fp16=True`: not a recipe of `precision=`, but priced by the memory estimator.
FP16 = Recipe("fp16", "fp16", "fp16", MIXED)


def fp8_matmul_native(device: torch.device | str) -> bool:
    """Whether `device` has fp8 tensor cores: a CUDA GPU of compute capability >= `ADA` (on ROCm: MI300 and newer)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device) >= ADA


def fp8_dtype() -> torch.dtype:
    """The e4m3 float8 type of this build: `float8_e4m3fnuz` on ROCm, `float8_e4m3fn` elsewhere."""
    return torch.float8_e4m3fnuz if torch.version.hip else torch.float8_e4m3fn


def get_recipe(name: str, field: str = "precision") -> Recipe:
    """The recipe called `name`; a ValueError naming `field` and the recipes when there is none."""
    if name not in RECIPES:
        raise ValueError(f"{field}={name!r} is unknown; use one of {list(RECIPES)}.")
    return RECIPES[name]


class RecipeUnavailableError(RuntimeError):
    """The recipe cannot run on this machine; the message names what is missing and what is available."""


def why_unavailable(recipe: str, device: torch.device | str) -> str | None:
    """What this machine lacks for `recipe`, or None when it can run."""
    spec = get_recipe(recipe)
    device = torch.device(device)
    capability = (
        torch.cuda.get_device_capability(device) if device.type == "cuda" and torch.cuda.is_available() else None
    )
    library = spec.library
    if library is not None:
        if importlib.util.find_spec(library.module) is None:
            return f"package {library.module} is not installed ({library.install})"
        if library.cuda_only and capability is None:
            return f"{library.label} needs a CUDA GPU"
    if spec.min_capability and capability is not None and capability < spec.min_capability:
        return f"{spec.needs} (this GPU is {capability[0]}.{capability[1]})"
    if spec.autocast == "bf16" and device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return "this GPU has no bf16 support"
    return None


def emulated(recipe: str, device: torch.device | str) -> str | None:
    """Why `recipe` has no native kernels on `device` (it runs emulated: its numerics, not its speed), or None."""
    device = torch.device(device)
    spec_key = get_recipe(recipe).spec_key
    if spec_key == "fp8" and not fp8_matmul_native(device):
        where = "a CPU" if device.type != "cuda" else f"this GPU (compute capability < {ADA[0]}.{ADA[1]})"
        return f"{where} has no fp8 tensor cores: torchao casts to fp8 and back and multiplies in a wider type"
    if spec_key == "bf16":
        if device.type == "cpu" and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
            return "this CPU has no bf16 instructions (avx512_bf16 / AMX): bf16 matmuls are emulated"
        if device.type == "cuda" and torch.cuda.is_available() and not torch.cuda.is_bf16_supported(False):
            return "this GPU has no bf16 tensor cores (compute capability < 8.0): bf16 is emulated"
    return None


def available_recipes(device: torch.device | str) -> list[str]:
    return [r for r in RECIPES if why_unavailable(r, device) is None]


def check_recipe(recipe: str, device: torch.device | str) -> None:
    """Fail before training, naming what is missing and the recipes that run here."""
    reason = why_unavailable(recipe, device)
    if reason:
        raise RecipeUnavailableError(
            f"precision={recipe!r} cannot run here: {reason}. Available on this machine: {available_recipes(device)}."
        )


def apply_precision(
    model: nn.Module,
    recipe: str,
    scaling: str | None = None,
    min_features: int = MIN_FEATURES,
    keep_first_last_blocks: bool = False,
    device: torch.device | str | None = None,
) -> PrecisionReport:
    """Convert the selected linears of `model` for `recipe` (a no-op for fp32/bf16); returns the report.

    `scaling`: `tensorwise` (default) or `rowwise` for `fp8`; `delayed` or `current` (default) for `te-fp8`.
    """
    device = device or next(model.parameters()).device
    check_recipe(recipe, device)
    report = PrecisionReport(
        recipe, {"scaling": scaling, "min_features": min_features, "keep_first_last_blocks": keep_first_last_blocks}
    )
    report.emulated = emulated(recipe, device)
    library = RECIPES[recipe].library
    if library is None:
        return report
    report.linears = select_linears(model, min_features, keep_first_last_blocks)
    report.experts = expert_groups(model)
    report.total_parameters = sum(p.numel() for p in model.parameters())
    chosen = {d.name for d in report.linears if d.converted}
    report.converted_parameters = sum(model.get_submodule(name).weight.numel() for name in chosen)
    if report.emulated:
        logger.warning(
            f"precision={recipe!r} runs EMULATED on {device}: {report.emulated}. Its numerics are fp8's, its speed "
            "is not: slower than fp32/bf16 here. Time recipes on the GPU they will run on."
        )
    if library is TORCHAO:
        convert_torchao(model, chosen, scaling or "tensorwise")
    else:
        convert_transformer_engine(model, chosen, recipe, scaling or "current")
    model.precision_report = report
    return report
