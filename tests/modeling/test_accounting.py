"""The one accounting of a model's shape: the model, the kernel planner and the FLOPs read the same windows."""

from types import SimpleNamespace

import pytest
from transformers import LlamaConfig, MinistralConfig

from hf_pretrain import PretrainForCausalLM
from hf_pretrain.modeling.accounting import (
    FULL,
    SLIDING,
    attention_flops_per_token,
    attention_widths,
    head_dim,
    layer_windows,
    mean_keys_per_query,
    mlp_kinds,
)
from hf_pretrain.modeling.attention import layer_needs
from tests.conftest import small_config


def test_one_window_per_layer_for_the_model_the_planner_and_the_flops():
    config = small_config(window_pattern="SSSL", sliding_window=16)
    windows = layer_windows(config)
    assert windows == [16, 16, 16, None] == config.window_sizes
    model = PretrainForCausalLM(config)
    assert [layer.self_attn.sliding_window for layer in model.model.layers] == windows
    assert {t: need.window for t, need in layer_needs(config, packed=False).items()} == {SLIDING: 16, FULL: None}
    per_layer = sum(mean_keys_per_query(64, w) for w in windows)
    assert attention_flops_per_token(config, 64) == 12 * config.num_attention_heads * head_dim(config) * per_layer


def test_configs_of_other_families():
    shape = dict(hidden_size=64, num_attention_heads=4, num_hidden_layers=2, intermediate_size=128)
    llama = LlamaConfig(**shape)
    assert layer_windows(llama) == [None, None] and mlp_kinds(llama) == ["dense", "dense"]
    assert layer_windows(MinistralConfig(**shape, sliding_window=8, layer_types=[SLIDING, FULL])) == [8, None]
    mixtral_like = SimpleNamespace(num_hidden_layers=3, num_experts=4)  # experts, no per-layer list: every layer
    assert mlp_kinds(mixtral_like) == ["sparse"] * 3


@pytest.mark.parametrize(
    "shape, expected",
    [
        (dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2), (16, 64, 32)),
        (dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=None), (16, 64, 64)),  # MHA
        (dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=1, head_dim=32), (32, 128, 32)),
    ],
)
def test_head_dim_and_attention_widths(shape, expected):
    config = SimpleNamespace(**shape)
    assert (head_dim(config), *attention_widths(config)) == expected
