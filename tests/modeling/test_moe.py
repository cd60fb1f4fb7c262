import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from datasets import Dataset
from torch.overrides import TorchFunctionMode
from transformers import (
    AutoModelForCausalLM,
    MixtralForCausalLM,
    Qwen2MoeForCausalLM,
    TrainerCallback,
    default_data_collator,
)

from hf_pretrain import PretrainForCausalLM, PretrainTrainer, export_hf, get_preset
from hf_pretrain.modeling.accounting import flops_per_token, matmul_parameters
from hf_pretrain.modeling.configuration import moe_layer_indices
from hf_pretrain.modeling.moe import (
    PretrainMoE,
    capacity_mask,
    expert_capacity,
    route,
    routing_statistics,
)
from hf_pretrain.telemetry.moe import KEYS, MoECallback
from tests.conftest import quick_args, small_config

E, K = 4, 2


def moe_config(**overrides):
    return small_config(**{"num_experts": E, "num_experts_per_tok": K, "moe_intermediate_size": 32, **overrides})


def moe_layer(seed=0, **overrides):
    torch.manual_seed(seed)
    layer = PretrainMoE(moe_config(**overrides))
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return layer


def reference(layer, x, dropped=None):
    """Token by token (the loop the module must not have): sum_j w_j SwiGLU_{e_j}(x_t) over kept pairs."""
    weights, experts = route(layer.gate(x), layer.top_k, layer.norm_topk_prob)
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(layer.top_k):
            if dropped is not None and dropped[t, j]:
                continue
            e = experts[t, j]
            gate, up = F.linear(x[t], layer.experts.gate_up_proj[e]).chunk(2)
            out[t] += weights[t, j] * F.linear(F.silu(gate) * up, layer.experts.down_proj[e])
    return out


# --- configuration ---------------------------------------------------------------------------------------------


def test_dense_by_default_and_which_layers_are_moe():
    assert small_config().num_experts == 0 and small_config().mlp_layer_types == ["dense"] * 4
    assert moe_config().mlp_layer_types == ["sparse"] * 4
    assert moe_config(moe_every=2).mlp_layer_types == ["dense", "sparse", "dense", "sparse"]
    assert moe_config(moe_layer_fraction=0.25).mlp_layer_types == ["dense", "dense", "dense", "sparse"]
    assert moe_layer_indices(20, moe_layer_fraction=0.1) == [9, 19]  # 10 % of 20 layers, spread, last one MoE
    assert moe_layer_indices(24, moe_layer_fraction=0.25) == moe_layer_indices(24, moe_every=4)
    assert moe_config().moe_intermediate_size == 32 and small_config(num_experts=2).moe_intermediate_size == 160
    model = PretrainForCausalLM(moe_config(moe_every=2))
    assert [type(layer.mlp).__name__ for layer in model.model.layers] == ["LlamaMLP", "PretrainMoE"] * 2


@pytest.mark.parametrize(
    "overrides, field, hint",
    [
        (dict(num_experts_per_tok=5), "num_experts_per_tok", "<= num_experts=4"),
        (dict(num_experts_per_tok=0), "num_experts_per_tok", "positive"),
        (dict(num_experts=-1), "num_experts", "0 (dense MLPs)"),
        (dict(moe_every=5), "moe_every", "<= num_hidden_layers=4"),
        (dict(moe_layer_fraction=1.5), "moe_layer_fraction", "(0, 1]"),
        (dict(moe_layer_fraction=0.5, moe_every=2), "moe_layer_fraction", "either moe_every=2 or"),
        (dict(moe_capacity_factor=0.0), "moe_capacity_factor", "None for dropless"),
        (dict(router_aux_loss_coef=-0.1), "router_aux_loss_coef", ">= 0"),
        (dict(moe_intermediate_size=0), "moe_intermediate_size", "positive"),
        (dict(mlp_bias=True), "mlp_bias", "mlp_bias=False"),
        (dict(num_experts=0, moe_capacity_factor=1.25), "moe_capacity_factor", "set num_experts > 0"),
    ],
)
def test_invalid_moe_settings_name_the_field_and_the_fix(overrides, field, hint):
    with pytest.raises(ValueError) as err:
        moe_config(**overrides)
    assert f"PretrainConfig.{field}=" in str(err.value) and hint in str(err.value)


# --- routing -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("norm", [True, False])
def test_routing_respects_top_k_and_matches_the_token_by_token_math(norm):
    layer = moe_layer(norm_topk_prob=norm)
    x = torch.randn(2, 24, 64)
    out, logits = layer(x)
    weights, experts = route(logits, K, norm)
    combine = torch.zeros(48, E).scatter(1, experts, weights)  # each token's weight per expert
    assert ((combine > 0).sum(-1) == K).all()
    sums = combine.sum(-1)
    assert torch.allclose(sums, torch.ones(48)) if norm else (sums < 1).all()
    assert torch.allclose(out.view(48, 64), reference(layer, x.view(48, 64)), atol=1e-5)


def test_capacity_caps_every_expert_and_counts_the_overflow():
    layer = moe_layer(moe_capacity_factor=1.0)
    with torch.no_grad():
        layer.gate.weight[0] += 5 * layer.gate.weight.abs().max()  # expert 0 wanted by far too many tokens
    x = torch.randn(40, 64).abs()
    out, logits = layer(x)
    _, experts = route(logits, K, True)
    capacity = expert_capacity(40, K, E, 1.0)  # ceil(1.0 * 40 * 2 / 4) = 20
    keep = capacity_mask(experts, E, capacity)
    kept_per_expert = torch.bincount(experts[keep], minlength=E)
    assert capacity == 20 and (kept_per_expert <= capacity).all()
    wanted = torch.bincount(experts.reshape(-1), minlength=E)
    assert wanted[0] > capacity  # the test does overflow
    assert (~keep).sum() == (wanted - capacity).clamp(min=0).sum()  # every overflowing pair dropped, no other
    first_choice_kept = keep[:, 0][experts[:, 0] == 0].sum()
    assert first_choice_kept == min(capacity, (experts[:, 0] == 0).sum())  # top-1 pairs served before top-2 pairs
    assert torch.allclose(out, reference(layer, x, dropped=~keep), atol=1e-5)  # dropped pairs add nothing
    stats = routing_statistics([logits], K, True, 1.0)
    assert stats.dropped == (~keep).sum() and stats.dropped_fraction == pytest.approx((~keep).sum().item() / 80)


def test_dropless_routing_drops_nothing_however_skewed():
    layer = moe_layer()
    with torch.no_grad():
        layer.gate.weight[0] += 5 * layer.gate.weight.abs().max()
    x = torch.randn(40, 64).abs()
    out, logits = layer(x)
    stats = routing_statistics([logits], K, True, None)
    assert stats.dropped == 0 and stats.expert_load[0, 0] > 0.45  # skewed, yet every pair computed
    assert torch.allclose(out, reference(layer, x), atol=1e-5)


def test_aux_loss_is_minimised_by_a_uniform_router():
    tokens = 256
    uniform = routing_statistics([torch.zeros(tokens, 8)], K).aux_loss
    collapsed = torch.zeros(tokens, 8)
    collapsed[:, :2] = 10.0  # every token picks experts 0 and 1
    g = torch.Generator().manual_seed(0)
    random_routers = [
        routing_statistics([torch.randn(tokens, 8, generator=g) * s + torch.randn(8, generator=g) * s], K).aux_loss
        for s in (0.1, 1.0, 3.0, 10.0)
        for _ in range(10)
    ]
    assert uniform.item() == pytest.approx(1.0)
    assert routing_statistics([collapsed], K).aux_loss.item() == pytest.approx(8 / K, rel=1e-3)  # E / k
    assert min(a.item() for a in random_routers) > uniform.item()
    # and its gradient moves a collapsed router towards balance
    torch.manual_seed(0)
    x = torch.randn(tokens, 16) + 1.0
    weight = torch.nn.Parameter(
        torch.randn(8, 16) * 0.01 + torch.outer(torch.tensor([3.0, 2.9] + [0.0] * 6), x.mean(0))
    )
    optimizer = torch.optim.Adam([weight], lr=0.05)
    first = routing_statistics([x @ weight.t()], K)
    for _ in range(100):
        loss = routing_statistics([x @ weight.t()], K).aux_loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    last = routing_statistics([x @ weight.t()], K)
    assert first.aux_loss > 3.5 and last.aux_loss < 1.5
    assert first.expert_load.max() == 0.5 and last.expert_load.max() < 0.3


def test_z_loss_grows_with_the_router_logit_scale():
    logits = torch.randn(64, E, generator=torch.Generator().manual_seed(0))
    z = [routing_statistics([logits * s], K).z_loss.item() for s in (0.5, 1.0, 2.0, 4.0, 8.0)]
    assert z == sorted(z) and z[-1] > 10 * z[0]
    assert routing_statistics([torch.zeros(8, E)], K).z_loss.item() == pytest.approx(torch.log(torch.tensor(E)) ** 2)


def test_padding_is_left_out_of_losses_and_load():
    logits = torch.randn(6, E)
    logits[3:] = torch.tensor([50.0, 49.0, 0.0, 0.0])  # padding rows, all on experts 0 and 1
    mask = torch.tensor([1, 1, 1, 0, 0, 0]).bool()
    masked, real_only = routing_statistics([logits], K, token_mask=mask), routing_statistics([logits[:3]], K)
    assert torch.allclose(masked.expert_load, real_only.expert_load)
    assert torch.allclose(masked.aux_loss, real_only.aux_loss) and torch.allclose(masked.z_loss, real_only.z_loss)


class CountLinear(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls += func is F.linear
        return func(*args, **(kwargs or {}))


def test_no_python_loop_over_tokens_the_matmul_count_does_not_grow_with_tokens():
    layer = moe_layer()
    counts = []
    for tokens in (64, 4096):
        with torch.no_grad(), CountLinear() as counter:
            layer(torch.randn(1, tokens, 64))
        counts.append(counter.calls)
    assert counts[0] == counts[1] == 1 + 2 * E  # the router, then gate_up and down once per expert


# --- the model: loss, training, logging, save/load, export, FLOPs ---------------------------------------------------


def test_aux_losses_join_the_lm_loss_in_training_weighted_by_the_micro_batch_token_share():
    torch.manual_seed(0)
    model = PretrainForCausalLM(moe_config(router_aux_loss_coef=0.5, router_z_loss_coef=0.1))
    ids = torch.randint(0, 128, (2, 16))
    out = model.train()(ids, labels=ids, skip_logits=False)  # the logits, to check the LM part by hand
    lm = F.cross_entropy(out.logits[:, :-1].reshape(-1, 128), ids[:, 1:].reshape(-1))
    assert out.loss.item() == pytest.approx((lm + 0.5 * out.aux_loss + 0.1 * out.z_loss).item(), rel=1e-5)
    assert out.aux_loss.requires_grad and out.expert_load.shape == (4, E) and out.dropped_fraction == 0
    half = model(ids, labels=ids, num_items_in_batch=2 * 30)  # half the step's 60 tokens; the chunked loss
    assert half.logits is None
    assert half.loss.item() == pytest.approx((lm / 2 + (0.5 * out.aux_loss + 0.1 * out.z_loss) / 2).item(), rel=1e-5)
    with torch.no_grad():
        evaluated = model.eval()(ids, labels=ids)  # evaluation: the LM loss alone, comparable with dense models
    assert evaluated.loss.item() == pytest.approx(lm.item(), rel=1e-5)


def synthetic(n=64, seq=32):
    g = torch.Generator().manual_seed(1)
    ids = (torch.randint(0, 128, (n, 1), generator=g) + 3 * torch.arange(seq)) % 128  # each token = previous + 3
    return Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": [[1] * seq] * n, "labels": ids.tolist()})


def test_tiny_moe_trains_on_cpu_and_logs_routing(tmp_path):
    torch.manual_seed(0)
    model = PretrainForCausalLM(moe_config(moe_intermediate_size=64))
    args = quick_args(
        tmp_path,
        max_steps=30,
        per_device_train_batch_size=8,
        learning_rate=3e-3,
        seed=7,
        measure_peak_tflops=False,
        telemetry=False,
    )
    attached = []

    class Count(TrainerCallback):
        def on_train_end(self, args, state, control, **kwargs):
            attached.append(sum(isinstance(c, MoECallback) for c in trainer.callback_handler.callbacks))

    trainer = PretrainTrainer(
        model=model,
        args=args,
        train_dataset=synthetic(),
        data_collator=default_data_collator,
        callbacks=[Count()],
    )
    trainer.train()  # PretrainTrainer attaches MoECallback itself for an MoE model
    logs = [h for h in trainer.state.log_history if "loss" in h]
    losses = [h["loss"] for h in logs]
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    print(f"MoE training loss: first 5 steps {first:.3f}, last 5 steps {last:.3f}")
    assert len(losses) == 30 and last < 0.65 * first
    assert all(set(KEYS) <= set(h) for h in logs)
    for h in logs:
        assert 1 / K >= h["moe_expert_load_max"] >= 1 / E >= h["moe_expert_load_min"] >= 0
        assert h["moe_aux_loss"] >= 0.99 and h["moe_z_loss"] > 0 and h["moe_dropped_fraction"] == 0
    assert len(model.moe_metrics.last_expert_load) == 4  # the full (MoE layers x experts) load of the last log
    assert attached == [1]  # once, during train()
    assert not any(isinstance(c, MoECallback) for c in trainer.callback_handler.callbacks)  # detached after


def test_moe_callback_logs_nothing_for_a_dense_model():
    assert MoECallback(PretrainForCausalLM(small_config())).metrics_for_log(None) == {}


def test_save_and_load_round_trip_with_identical_logits(tmp_path):
    torch.manual_seed(0)
    model = PretrainForCausalLM(moe_config(moe_every=2, moe_capacity_factor=1.5, norm_topk_prob=False)).eval()
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert type(loaded) is PretrainForCausalLM
    for field in ("num_experts", "num_experts_per_tok", "moe_every", "moe_capacity_factor", "norm_topk_prob"):
        assert getattr(loaded.config, field) == getattr(model.config, field)
    ids = torch.randint(0, 128, (2, 40))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, loaded(ids).logits)


@pytest.mark.parametrize(
    "overrides, model_type, cls",
    [
        (dict(), "mixtral", MixtralForCausalLM),  # every layer MoE, no windows, renormalised top-k
        (dict(moe_every=2, window_pattern="SL", sliding_window=6, head_dim=32), "qwen2_moe", Qwen2MoeForCausalLM),
        (dict(norm_topk_prob=False, num_experts_per_tok=1), "qwen2_moe", Qwen2MoeForCausalLM),
    ],
)
def test_export_to_a_transformers_moe_with_the_same_logits(tmp_path, overrides, model_type, cls):
    torch.manual_seed(0)
    model = PretrainForCausalLM(moe_config(**overrides)).eval()
    model.save_pretrained(tmp_path / "ours")
    export_hf(tmp_path / "ours", tmp_path / "plain")
    saved = json.loads((tmp_path / "plain" / "config.json").read_text())
    assert saved["model_type"] == model_type and "moe_every" not in saved and "router_z_loss_coef" not in saved
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "plain").eval()
    assert type(plain) is cls
    ids = torch.randint(0, 128, (2, 50))  # longer than the window
    with torch.no_grad():
        diff = (model(ids).logits - plain(ids).logits).abs().max().item()
    print(f"export {model_type} {overrides}: max abs logits diff {diff:.2e}")
    assert diff < 1e-5


LOAD_WITHOUT_HF_PRETRAIN = """
import sys, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1]).eval()
assert not any(name.startswith("hf_pretrain") for name in sys.modules)
with torch.no_grad():
    torch.save(model(torch.load(sys.argv[2])).logits, sys.argv[3])
print(type(model).__name__)
"""


def test_exported_moe_loads_in_a_process_without_hf_pretrain(tmp_path):
    torch.manual_seed(0)
    model = PretrainForCausalLM(moe_config(moe_layer_fraction=0.5, window_pattern="SL", sliding_window=6)).eval()
    export_hf(model, tmp_path / "plain")
    ids = torch.randint(0, 128, (1, 30))
    torch.save(ids, tmp_path / "ids.pt")
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            LOAD_WITHOUT_HF_PRETRAIN,
            str(tmp_path / "plain"),
            str(tmp_path / "ids.pt"),
            str(tmp_path / "out.pt"),
        ],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == "Qwen2MoeForCausalLM"
    with torch.no_grad():
        assert (model(ids).logits - torch.load(tmp_path / "out.pt")).abs().max().item() < 1e-5


@pytest.mark.parametrize(
    "overrides, match",
    [
        (dict(moe_capacity_factor=1.25), "moe_capacity_factor=1.25 drops the tokens"),
        (dict(attention_bias=True), "attention_bias=True"),
    ],
)
def test_export_refuses_what_no_transformers_moe_computes(overrides, match):
    with pytest.raises(ValueError, match=match):
        export_hf(PretrainForCausalLM(moe_config(**overrides)), "unused")


@pytest.mark.parametrize(
    "overrides", [dict(), dict(moe_every=2), dict(num_experts_per_tok=1, tie_word_embeddings=True)]
)
def test_flops_count_active_parameters(overrides):
    config = moe_config(**overrides)
    model = PretrainForCausalLM(config)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    routers = sum(layer.mlp.gate.weight.numel() for layer in model.model.layers if layer.is_moe)
    experts = sum(p.numel() for layer in model.model.layers if layer.is_moe for p in layer.mlp.experts.parameters())
    k = config.num_experts_per_tok
    assert matmul_parameters(config) == linear + routers + experts * k // E  # k of the E experts per token
    all_experts = moe_config(**{**overrides, "num_experts_per_tok": E})
    assert flops_per_token(config, 256) < flops_per_token(all_experts, 256)


def test_flops_of_dense_models_are_unchanged_and_tiny_moe_costs_about_tiny():
    dense = small_config()
    assert matmul_parameters(dense) == 4 * (64 * 64 * 2 + 2 * 64 * 32 + 3 * 64 * 160) + 64 * 128
    tiny, tiny_moe = get_preset("tiny"), get_preset("tiny-moe")
    assert flops_per_token(tiny_moe, 1024) == pytest.approx(flops_per_token(tiny, 1024), rel=0.01)
    with torch.device("meta"):
        assert sum(p.numel() for p in PretrainForCausalLM(tiny_moe).parameters()) > 1.9 * 1.8e6
