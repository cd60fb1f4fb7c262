"""Recipes as data: each part of hf_pretrain reads a recipe's fields from the one registry."""

from types import SimpleNamespace

import pytest

from hf_pretrain import PretrainingArguments
from hf_pretrain.distributed.memory import PRECISIONS, estimate_memory
from hf_pretrain.modeling.accounting import count_parameters
from hf_pretrain.plan.hardware import PLANNED_RECIPES
from hf_pretrain.precision import RECIPES, get_recipe
from hf_pretrain.precision.recipes import LOW_PRECISION
from hf_pretrain.presets import get_preset
from hf_pretrain.telemetry.throughput import precision_of
from hf_pretrain.training.arguments import accelerator_available

# What the recipes promised before they were data (the spec column MFU divides by, bytes per parameter).
SPEC = {"fp32": "fp32", "bf16": "bf16", "fp8": "fp8", "te-fp8": "fp8", "te-mxfp8": "fp8", "te-nvfp4": "fp4"}


@pytest.mark.parametrize("name", list(RECIPES))
def test_arguments_throughput_and_memory_read_the_recipe(name, tmp_path):
    recipe = RECIPES[name]
    args = PretrainingArguments(output_dir=str(tmp_path), precision=name, report_to="none")
    assert precision_of(args) == recipe.spec_key == SPEC[name]
    assert args.bf16 == (name == "bf16" or (name != "fp32" and accelerator_available()))
    config = get_preset("tiny")
    estimate = estimate_memory(config, 0, 1, name)
    weight, grad, optim, _ = recipe.bytes_per_parameter
    psi = count_parameters(config)
    assert (estimate.parameters, estimate.gradients, estimate.optimizer_states) == (
        weight * psi,
        grad * psi,
        optim * psi,
    )
    assert (weight, grad, optim) == ((4, 4, 8) if name == "fp32" else (2, 2, 12))
    assert recipe.converts_linears == (name in LOW_PRECISION) == (name not in ("fp32", "bf16"))
    assert any(recipe.library.label in note for note in estimate.notes) if recipe.library else not estimate.notes


def test_plain_arguments_without_a_recipe_use_the_autocast_flags():
    assert precision_of(SimpleNamespace(bf16=False, fp16=True)) == "fp16"
    assert precision_of(SimpleNamespace(precision=None, bf16=False, fp16=False)) == "fp32"


def test_the_planner_and_the_estimator_take_their_lists_from_the_registry():
    assert (
        PLANNED_RECIPES
        == tuple(n for n, r in RECIPES.items() if r.autocast == "bf16")
        == tuple(n for n in RECIPES if n != "fp32")
    )
    assert set(PRECISIONS) == {*RECIPES, "fp16"}  # fp16: transformers' own flag, priced by the estimator


def test_an_unknown_recipe_is_one_clear_error():
    with pytest.raises(ValueError, match=r"precision='fp6' is unknown; use one of \['fp32', 'bf16'"):
        get_recipe("fp6")
    with pytest.raises(ValueError, match="precision='fp6' is invalid"):
        PretrainingArguments(output_dir="x", precision="fp6")
