"""Precision recipes: fp32, bf16, PyTorch-native FP8 (torchao) and Transformer Engine FP8 / MXFP8 / NVFP4."""

from .convert import LinearDecision, PrecisionReport, high_precision, remove_precision
from .recipes import (
    RECIPES,
    Recipe,
    RecipeUnavailableError,
    apply_precision,
    available_recipes,
    check_recipe,
    get_recipe,
)

__all__ = [
    "RECIPES",
    "LinearDecision",
    "PrecisionReport",
    "Recipe",
    "RecipeUnavailableError",
    "apply_precision",
    "available_recipes",
    "check_recipe",
    "get_recipe",
    "high_precision",
    "remove_precision",
]
