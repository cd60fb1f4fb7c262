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
from tests.conftest import quick_args, small_config

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
    x_ref = torch.randn(64, 128, requires_grad=True)
    x_fp8 = x_ref.detach().clone().requires_grad_()
    out_ref, out_fp8 = reference(x_ref), fp8(x_fp8)
    assert 0 < rel_err(out_fp8, out_ref) < FP8_REL_ERR  # not identical (it is fp8) but close
    out_ref.square().sum().backward()
    out_fp8.square().sum().backward()
    for p_ref, p_fp8 in zip(reference.parameters(), fp8.parameters()):
        assert rel_err(p_fp8.grad, p_ref.grad) < FP8_REL_ERR
    assert rel_err(x_fp8.grad, x_ref.grad) < FP8_REL_ERR


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


def test_trainer_saves_plain_weights_and_evaluates_on_plain_linears(tmp_path):
    from datasets import Dataset

    from hf_pretrain import PretrainTrainer
    from hf_pretrain.data import PackedDocumentCollator

    torch.manual_seed(0)
    data = Dataset.from_dict({"input_ids": torch.randint(2, 128, (16, 32)).tolist()})
    args = quick_args(
        tmp_path,
        max_steps=2,
        per_device_train_batch_size=4,
        precision="fp8",
        measure_peak_tflops=False,
    )
    model = PretrainForCausalLM(small_config(hidden_size=128, intermediate_size=256))
    trainer = PretrainTrainer(
        model=model, args=args, train_dataset=data, eval_dataset=data, data_collator=PackedDocumentCollator(1)
    )
    assert trainer.precision_report.converted
    seen = []
    hook = model.register_forward_pre_hook(
        lambda m, a: seen.append(any(type(x).__name__ == "Float8Linear" for x in m.modules()))
    )
    trainer.train()
    trainer.evaluate()
    hook.remove()
    assert seen[0] is True and seen[-1] is False  # training on fp8 linears, evaluation on plain ones
    trainer.save_model(str(tmp_path / "saved"))
    plain = PretrainForCausalLM.from_pretrained(tmp_path / "saved")
    for (name, p), (_, q) in zip(model.named_parameters(), plain.named_parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=0, msg=name)


def fake_transformer_engine(monkeypatch):
    """A stand-in for transformer_engine with TE's documented Linear / autocast / recipe surface."""
    import sys
    import types

    entered = []

    class Linear(nn.Module):
        def __init__(self, in_features, out_features, bias=True, params_dtype=None, device=None):
            super().__init__()
            self.in_features, self.out_features = in_features, out_features
            self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=params_dtype, device=device))
            self.bias = nn.Parameter(torch.zeros(out_features)) if bias else torch.Tensor()  # TE keeps an empty tensor

        def forward(self, x):
            assert entered and entered[-1] == "in", "TE Linear called outside autocast"
            return nn.functional.linear(x, self.weight, self.bias if self.bias.numel() else None)

    class Autocast:
        def __init__(self, enabled=True, recipe=None):
            self.recipe = recipe

        def __enter__(self):
            entered.append("in")

        def __exit__(self, *exc):
            entered.append("out")

    Linear.__module__ = "transformer_engine.pytorch.module.linear"
    pytorch = types.ModuleType("transformer_engine.pytorch")
    pytorch.Linear, pytorch.autocast = Linear, Autocast
    recipe = types.ModuleType("transformer_engine.common.recipe")
    for name in ("DelayedScaling", "Float8CurrentScaling", "MXFP8BlockScaling", "NVFP4BlockScaling"):
        setattr(recipe, name, type(name, (), {}))
    common = types.ModuleType("transformer_engine.common")
    common.recipe = recipe
    root = types.ModuleType("transformer_engine")
    root.pytorch, root.common = pytorch, common
    for name, module in {
        "transformer_engine": root,
        "transformer_engine.pytorch": pytorch,
        "transformer_engine.common": common,
        "transformer_engine.common.recipe": recipe,
    }.items():
        monkeypatch.setitem(sys.modules, name, module)
    return entered


def test_transformer_engine_path_keeps_the_signature_and_unswaps_bias_free_linears(monkeypatch):
    import inspect

    from hf_pretrain.precision.convert import convert_transformer_engine

    entered = fake_transformer_engine(monkeypatch)
    torch.manual_seed(0)
    model = PretrainForCausalLM(small_config(hidden_size=128, intermediate_size=256))
    ids = torch.randint(0, 128, (1, 8))
    with torch.no_grad():
        before = model(ids).logits
    signature = inspect.signature(model.forward)
    chosen = {d.name for d in select_linears(model) if d.converted}
    with pytest.raises(ValueError, match="scaling='rowwise' is invalid"):
        convert_transformer_engine(model, chosen, "te-fp8", "rowwise")
    assert not any(
        type(m).__name__ == "Linear" and type(m).__module__.startswith("transformer_engine") for m in model.modules()
    )
    convert_transformer_engine(model, chosen, "te-fp8", "current")
    assert inspect.signature(model.forward) == signature  # the Trainer reads it to keep input_ids
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before)  # ran inside the autocast hooks
    assert entered[-2:] == ["in", "out"]
    with high_precision(model), torch.no_grad():
        torch.testing.assert_close(model(ids).logits, before)  # bias-free TE linears swap back to plain ones
    remove_precision(model)
    entered.clear()
    with torch.no_grad():
        model(ids)
    assert entered == []  # hooks gone with the TE modules


def test_fp8_on_a_cpu_is_emulated_and_says_so_at_run_time(caplog):
    import logging

    from hf_pretrain.precision.recipes import emulated

    assert "no fp8 tensor cores" in emulated("fp8", "cpu") and emulated("fp32", "cpu") is None
    model = PretrainForCausalLM(small_config(hidden_size=128, intermediate_size=256))
    with caplog.at_level(logging.WARNING):
        report = apply_precision(model, "fp8", device="cpu")
    assert "precision='fp8' runs EMULATED on cpu" in caplog.text
    assert report.emulated and "EMULATED here" in report.summary()


def test_the_report_counts_moe_experts_kept_in_high_precision():
    from hf_pretrain import get_preset

    model = PretrainForCausalLM(get_preset("tiny-moe"))
    report = apply_precision(model, "fp8", device="cpu")
    config = model.config
    experts = 3 * config.hidden_size * config.moe_intermediate_size * config.num_experts  # per MoE layer
    assert [g.num_experts for g in report.experts] == [config.num_experts] * config.mlp_layer_types.count("sparse")
    assert all(g.parameters == experts for g in report.experts)
    # the expert tensors are untouched (3D parameters, not nn.Linear), and the summary says how much they weigh
    assert not any(type(m).__name__ == "Float8Linear" for n, m in model.named_modules() if ".experts" in n)
    total = sum(p.numel() for p in model.parameters())
    share = f"{experts * len(report.experts) / total:.0%}"
    summary = report.summary()
    assert f"MoE experts kept in high precision: {len(report.experts)} layers x {config.num_experts} experts" in summary
    assert f"({share} of the parameters" in summary
    converted = sum(model.get_submodule(d.name).weight.numel() for d in report.converted)
    assert report.converted_parameters == converted and converted / total < 0.5  # most weights are experts
    dense = apply_precision(PretrainForCausalLM(get_preset("tiny")), "fp8", device="cpu")
    assert dense.experts == [] and "MoE experts" not in dense.summary()
