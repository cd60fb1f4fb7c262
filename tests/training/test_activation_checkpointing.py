"""Activation checkpointing (`gradient_checkpointing`, transformers' `every_n_layers` for the selective policy)
on PretrainForCausalLM: the same losses and gradients as without, with sliding windows, packed documents and
MoE (the aux losses come from the router logits of the first forward; the recompute must not count twice), and
under PretrainTrainer. The memory estimator's checkpointed activations against the tensors autograd keeps."""

from collections import defaultdict

import pytest
import torch

from hf_pretrain import PretrainForCausalLM, PretrainTrainer, get_preset
from hf_pretrain.distributed.memory import activation_bytes
from tests.conftest import quick_args, small_config

VARIANTS = {
    "dense": {},
    "windows": dict(window_pattern="SL", sliding_window=8),
    "moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, router_z_loss_coef=1e-3),
}


def batch(packed: bool) -> dict:
    ids = torch.randint(0, 128, (2, 32), generator=torch.Generator().manual_seed(3))
    inputs = dict(input_ids=ids, labels=ids)
    if packed:
        inputs["position_ids"] = torch.cat([torch.arange(20), torch.arange(12)]).unsqueeze(0).expand(2, -1)
    return inputs


def loss_and_grads(model, inputs):
    loss = model(**inputs).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    return loss.detach(), grads


def layer_forwards(model) -> list[int]:
    """Forward calls of each layer's q_proj: 2 per step for a recomputed layer, 1 otherwise."""
    calls = [0] * len(model.model.layers)
    for i, layer in enumerate(model.model.layers):
        layer.self_attn.q_proj.register_forward_hook(lambda *_, i=i: calls.__setitem__(i, calls[i] + 1))
    return calls


@pytest.mark.parametrize("every", [1, 2])
@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_checkpointing_gives_the_same_losses_and_gradients(variant, packed, every):
    torch.manual_seed(0)
    model = PretrainForCausalLM(small_config(**VARIANTS[variant])).train()
    inputs = batch(packed)
    plain = loss_and_grads(model, inputs)
    metrics_before = model.moe_metrics.forwards if model.moe_metrics else 0
    model.activation_checkpointing_enable(every_n_layers=every)
    calls = layer_forwards(model)
    checkpointed = loss_and_grads(model, inputs)
    assert calls == [2 if i % every == 0 else 1 for i in range(4)]  # the chosen layers were recomputed
    torch.testing.assert_close(checkpointed[0], plain[0], rtol=0, atol=0)
    for name, grad in plain[1].items():
        torch.testing.assert_close(checkpointed[1][name], grad, rtol=1e-6, atol=1e-7, msg=name)
    if model.moe_metrics:  # one more forward counted, not two (the recompute is inside the layers)
        assert model.moe_metrics.forwards == metrics_before + 1


@pytest.mark.parametrize("kwargs", [None, {"every_n_layers": 2}], ids=["full", "every-2"])
def test_trainer_run_with_checkpointing_matches_without(tmp_path, kwargs):
    from datasets import Dataset

    ids = torch.randint(0, 128, (16, 32), generator=torch.Generator().manual_seed(1))
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})

    def run(out, **args):
        torch.manual_seed(0)
        model = PretrainForCausalLM(small_config(**VARIANTS["moe"], window_pattern="SL", sliding_window=8))
        arguments = quick_args(out, max_steps=4, per_device_train_batch_size=4, learning_rate=1e-3, seed=7, **args)
        trainer = PretrainTrainer(model=model, args=arguments, train_dataset=data)
        trainer.train()
        return trainer, [h["loss"] for h in trainer.state.log_history if "loss" in h]

    _, plain = run(tmp_path / "plain")
    trainer, checkpointed = run(tmp_path / "ckpt", gradient_checkpointing=True, gradient_checkpointing_kwargs=kwargs)
    assert checkpointed == pytest.approx(plain, rel=1e-6)
    every = (kwargs or {}).get("every_n_layers", 1)
    assert [layer.gradient_checkpointing for layer in trainer.model.model.layers] == [i % every == 0 for i in range(4)]


def saved_bytes(model, inputs) -> tuple[int, dict[int, int]]:
    """Bytes of the tensors the forward saves for backward (unique storages, weights left out), in total and per
    decoder layer. A checkpointed layer saves only its inputs here (torch keeps the rest for the recompute)."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved, per_layer, current = {}, defaultdict(dict), [None]
    for i, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(lambda *_, i=i: current.__setitem__(0, i))
        layer.register_forward_hook(lambda *_: current.__setitem__(0, None))

    def pack(tensor):
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            saved[storage.data_ptr()] = storage.nbytes()
            if current[0] is not None:
                per_layer[current[0]][storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(**inputs)
    return sum(saved.values()), {i: sum(s.values()) for i, s in per_layer.items()}


@pytest.mark.parametrize("every", [None, 1, 2, 3], ids=["none", "full", "every-2", "every-3"])
def test_estimator_matches_the_activations_autograd_keeps(every):
    """Peak of the saved activations: what the forward leaves for backward, plus, with checkpointing, the largest
    working set one checkpointed layer rebuilds in backward (measured as that layer's saves without checkpointing).
    The estimate must be within 10 % (it is within 1 %: the rest are int64 ids and labels)."""
    config = get_preset(
        "tiny",
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=1000,
    )
    seq, batch_size = 128, 2
    ids = torch.randint(0, config.vocab_size, (batch_size, seq), generator=torch.Generator().manual_seed(0))
    inputs = dict(input_ids=ids, labels=ids)
    torch.manual_seed(0)
    model = PretrainForCausalLM(config).train()
    total, per_layer = saved_bytes(model, inputs)
    if every is not None:
        model = PretrainForCausalLM(config).train()
        model.activation_checkpointing_enable(every_n_layers=every)
        retained, _ = saved_bytes(model, inputs)
        total = retained + max(per_layer[i] for i in range(0, config.num_hidden_layers, every))
    # the chunked loss saves no logits and not the head's input (it holds their gradients outside autograd)
    expected = activation_bytes(config, seq, batch_size, "fp32", checkpointing=every or False)
    expected -= seq * batch_size * config.hidden_size * 4
    assert total == pytest.approx(expected, rel=0.1)
    assert total == pytest.approx(expected, rel=0.01)
