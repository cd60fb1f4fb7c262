"""Precision recipes: fp32, bf16, PyTorch-native FP8 (torchao) and Transformer Engine FP8 / MXFP8 / NVFP4."""

from .recipes import (
    RECIPES,
    LinearDecision,
    PrecisionReport,
    RecipeUnavailableError,
    apply_precision,
    available_recipes,
    check_recipe,
    high_precision,
    remove_precision,
)

__all__ = [
    "RECIPES",
    "LinearDecision",
    "PrecisionReport",
    "RecipeUnavailableError",
    "apply_precision",
    "available_recipes",
    "check_recipe",
    "high_precision",
    "remove_precision",
]
