import pytest
from transformers import AutoConfig, LlamaConfig

from hf_pretrain import PretrainConfig
from hf_pretrain.modeling.configuration import layer_types_from_pattern
from tests.conftest import small_config


def test_is_a_llama_config_with_own_model_type_and_untied_default():
    config = small_config()
    assert isinstance(config, LlamaConfig)
    assert config.model_type == "hf_pretrain" != LlamaConfig.model_type
    assert config.tie_word_embeddings is False
    assert config.layer_types == ["full_attention"] * 4


@pytest.mark.parametrize(
    "pattern, layers, expected",
    [
        ("SSSL", 8, "SSSLSSSL"),
        ("SSSL", 6, "SSSLSL"),  # tiled, then the last layer forced full
        ("S", 3, "SSL"),
        ("L", 2, "LL"),
        ("SL", 5, "SLSLL"),
    ],
)
def test_window_pattern_tiles_and_last_layer_is_full(pattern, layers, expected):
    letters = {"sliding_attention": "S", "full_attention": "L"}
    assert "".join(letters[t] for t in layer_types_from_pattern(pattern, layers)) == expected
    config = small_config(window_pattern=pattern, num_hidden_layers=layers, sliding_window=16)
    assert "".join(letters[t] for t in config.layer_types) == expected
    assert config.window_sizes == [16 if c == "S" else None for c in expected]


@pytest.mark.parametrize(
    "overrides, field, hint",
    [
        (dict(window_pattern="SXL"), "window_pattern", "'S'"),
        (dict(window_pattern=""), "window_pattern", "'L'"),
        (dict(window_pattern="S", sliding_window=0), "sliding_window", "positive"),
        (dict(window_pattern="SL", sliding_window=-4), "sliding_window", "positive"),
        (dict(window_pattern="SL", sliding_window=None), "sliding_window", "positive"),
        (dict(window_pattern="L", sliding_window=-3), "sliding_window", "positive"),
        (dict(window_pattern="S", sliding_window=True), "sliding_window", "positive"),
        (dict(head_dim=0), "head_dim", "positive"),
        (dict(max_position_embeddings=0), "max_position_embeddings", "positive"),
        (dict(hidden_act="nope"), "hidden_act", "'silu'"),
        (dict(rms_norm_eps=-1.0), "rms_norm_eps", "> 0"),
        (dict(attention_dropout=2.0), "attention_dropout", "[0, 1)"),
        (dict(attention_backend="cuda_magic"), "attention_backend", "'auto'"),
        (dict(num_attention_heads=5), "num_attention_heads", "divide hidden_size"),
        (dict(num_key_value_heads=3), "num_key_value_heads", "allowed: [1, 2, 4]"),
        (dict(hidden_size=0), "hidden_size", "positive"),
        (dict(num_hidden_layers=0), "num_hidden_layers", "positive"),
        (
            dict(layer_types=["full_attention"] * 3 + ["sliding_attention"]),
            "layer_types",
            "derived from window_pattern",
        ),
    ],
)
def test_invalid_values_name_the_field_and_the_fix(overrides, field, hint):
    with pytest.raises(ValueError) as err:
        small_config(**overrides)
    assert f"PretrainConfig.{field}=" in str(err.value)
    assert hint in str(err.value)


def test_save_load_round_trip_and_auto_config(tmp_path):
    config = small_config(window_pattern="SSL", sliding_window=32)
    config.save_pretrained(tmp_path)
    loaded = AutoConfig.from_pretrained(tmp_path)
    assert type(loaded) is PretrainConfig
    assert loaded.layer_types == config.layer_types and loaded.sliding_window == 32
    assert loaded.window_pattern == "SSL"
