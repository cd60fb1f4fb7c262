import copy

import pytest
import torch
from torch import nn

from hf_pretrain import PretrainForCausalLM, PretrainingArguments
from hf_pretrain.precision import (
    RecipeUnavailableError,
    apply_precision,
    available_recipes,
    high_precision,
    remove_precision,
)
from hf_pretrain.precision.recipes import select_linears, why_unavailable
from tests.conftest import small_config

pytest.importorskip("torchao", reason="the fp8 recipe runs through torchao")

FP8_REL_ERR = 0.10  # e4m3 keeps 3 mantissa bits: ~5 % relative error per matmul output, measured


def rel_err(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_fp8_linear_output_and_gradients_are_close_to_fp32(scaling):
    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 128))
    fp8 = copy.deepcopy(reference)
    report = apply_precision(fp8, "fp8", scaling=scaling, device="cpu")
    assert len(report.converted) == 2 and type(fp8[0]).__name__ == "Float8Linear"
    x = torch.randn(64, 128)
    out_ref, out_fp8 = reference(x), fp8(x)
    assert 0 < rel_err(out_fp8, out_ref) < FP8_REL_ERR  # not identical (it is fp8) but close
    out_ref.square().sum().backward()
    out_fp8.square().sum().backward()
    for p_ref, p_fp8 in zip(reference.parameters(), fp8.parameters()):
        assert rel_err(p_fp8.grad, p_ref.grad) < 2 * FP8_REL_ERR


def test_swap_and_unswap_round_trip_is_exact():
    torch.manual_seed(0)
    model = PretrainForCausalLM(small_config(hidden_size=128, intermediate_size=256))
    ids = torch.randint(0, 128, (2, 16))
    with torch.no_grad():
        before = model(ids).logits
    weights = {n: p for n, p in model.named_parameters()}
    apply_precision(model, "fp8", device="cpu")
    assert any(type(m).__name__ == "Float8Linear" for m in model.modules())
    removed = remove_precision(model)
    assert removed and not any(type(m).__name__ == "Float8Linear" for m in model.modules())
    assert all(p is weights[n] for n, p in model.named_parameters())  # the same tensors, never copied
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before, rtol=0, atol=0)


def test_filter_skips_and_continues_with_a_reason_for_every_linear():
    model = PretrainForCausalLM(small_config(hidden_size=128, intermediate_size=200, num_hidden_layers=3))
    decisions = {d.name: d for d in select_linears(model, min_features=96, keep_first_last_blocks=True)}
    assert decisions["lm_head"].reason == "LM head kept in high precision"
    assert decisions["model.layers.1.mlp.up_proj"].reason == "dims not divisible by 16"  # 200 % 16 != 0
    assert decisions["model.layers.0.self_attn.q_proj"].reason == "first/last block kept in high precision"
    assert decisions["model.layers.2.self_attn.o_proj"].reason == "first/last block kept in high precision"
    assert decisions["model.layers.1.self_attn.q_proj"].converted
    assert decisions["model.layers.1.self_attn.k_proj"].reason == "smaller than min_features=96"  # 2 kv heads x 32 = 64
    report = apply_precision(model, "fp8", min_features=96, keep_first_last_blocks=True, device="cpu")
    assert len(report.linears) == 3 * 7 + 1 and 0 < len(report.converted) < len(report.linears)
    converted = {n for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"}
    assert converted == {d.name for d in report.converted}  # skipped ones did not stop the others
    assert "kept in high precision" in report.summary()


def test_high_precision_context_runs_plain_linears_and_restores():
    model = PretrainForCausalLM(small_config(hidden_size=128, intermediate_size=256))
    apply_precision(model, "fp8", device="cpu")
    fp8_modules = {n: m for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"}
    with high_precision(model):
        assert not any(type(m).__name__ == "Float8Linear" for m in model.modules())
        model.generate(torch.randint(0, 128, (1, 4)), max_new_tokens=3, do_sample=False)
    assert {n: m for n, m in model.named_modules() if type(m).__name__ == "Float8Linear"} == fp8_modules


def test_fp8_checkpoint_loads_into_a_plain_model_with_the_same_weights(tmp_path):
    model = PretrainForCausalLM(small_config(hidden_size=128, intermediate_size=256))
    apply_precision(model, "fp8", device="cpu")
    with high_precision(model):
        model.save_pretrained(tmp_path)
    plain = PretrainForCausalLM.from_pretrained(tmp_path)
    assert not any(type(m).__name__ == "Float8Linear" for m in plain.modules())
    for (name, p), (_, q) in zip(model.named_parameters(), plain.named_parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)


def test_recipes_that_cannot_run_fail_before_training_and_name_what_is_missing():
    assert set(available_recipes("cpu")) >= {"fp32", "bf16", "fp8"}
    assert "transformer_engine" in why_unavailable("te-fp8", "cpu")
    with pytest.raises(
        RecipeUnavailableError,
        match=r"te-nvfp4.*transformer_engine.*Available on this machine: \['fp32', 'bf16', 'fp8'",
    ):
        apply_precision(PretrainForCausalLM(small_config()), "te-nvfp4", device="cpu")
    with pytest.raises(ValueError, match="precision='fp4' is invalid"):
        PretrainingArguments(output_dir="unused", precision="fp4")
    with pytest.raises(ValueError, match="scaling='blockwise' is invalid"):
        apply_precision(
            PretrainForCausalLM(small_config(hidden_size=128, intermediate_size=256)),
            "fp8",
            scaling="blockwise",
            device="cpu",
        )


def test_precision_argument_sets_mixed_precision_for_the_trainer():
    args = PretrainingArguments(output_dir="unused", precision="bf16")
    assert args.bf16 and args.mixed_precision == "bf16"
    assert not PretrainingArguments(output_dir="unused", precision="fp32").bf16
    fp8 = PretrainingArguments(output_dir="unused", precision="fp8")
    assert (
        fp8.bf16 == torch.cuda.is_available()
    )  # fp8 linears inside bf16 autocast on a GPU; emulated around fp32 on CPU
