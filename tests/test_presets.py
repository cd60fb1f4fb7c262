import pytest
import torch

from hf_pretrain import PRESETS, PretrainForCausalLM, get_preset
from hf_pretrain.modeling import accounting
from hf_pretrain.presets import load_config, nominal_parameters


def count_parameters(config) -> int:
    with torch.device("meta"):
        model = PretrainForCausalLM(config)
    return sum(p.numel() for p in model.parameters())  # shared (tied) tensors counted once


def test_registry_has_the_required_presets():
    assert {"tiny", "gpt2-124m", "0.9b", "1.4b", "llama2-7b"} <= set(PRESETS)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_parameter_count_matches_the_name(name):
    count = count_parameters(get_preset(name))
    assert abs(count / nominal_parameters(name) - 1) < 0.05, f"{name}: {count:,} parameters"
    assert accounting.count_parameters(get_preset(name)) == count  # the estimator's and planner's count is the model's


def test_presets_have_the_advertised_shapes():
    assert get_preset("0.9b").num_hidden_layers == 20 and "sliding_attention" in get_preset("0.9b").layer_types
    assert get_preset("1.4b").num_hidden_layers == 24
    seven = get_preset("llama2-7b")
    assert (seven.hidden_size, seven.intermediate_size, seven.num_hidden_layers, seven.vocab_size) == (
        4096,
        11008,
        32,
        32000,
    )
    assert get_preset("tiny").tie_word_embeddings is False


def test_overrides_and_unknown_names():
    assert get_preset("tiny", window_pattern="SL", sliding_window=64).layer_types[0] == "sliding_attention"
    with pytest.raises(ValueError, match="preset='gpt5' is unknown; choose one of"):
        get_preset("gpt5")


def test_a_saved_config_is_loaded_with_overrides_and_its_layer_types_derived_again(tmp_path):
    get_preset("tiny", window_pattern="L").save_pretrained(tmp_path)
    assert load_config(str(tmp_path / "config.json")).layer_types == get_preset("tiny", window_pattern="L").layer_types
    windowed = load_config(str(tmp_path), window_pattern="SL", sliding_window=64)
    assert windowed.layer_types == get_preset("tiny", window_pattern="SL", sliding_window=64).layer_types
    assert load_config("tiny", vocab_size=300).vocab_size == 300  # a preset: get_preset's overrides
    with pytest.raises(ValueError, match="config='no/such' is neither a preset"):
        load_config("no/such", vocab_size=300)
