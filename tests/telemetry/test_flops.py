import pytest
import torch

from hf_pretrain import PretrainForCausalLM, get_preset
from hf_pretrain.modeling.accounting import (
    attention_flops_per_token,
    flops_per_token,
    matmul_parameters,
    mean_keys_per_query,
)
from tests.conftest import small_config


@pytest.mark.parametrize(
    "seq_len, window", [(1, None), (7, None), (2048, None), (2048, 512), (100, 1), (100, 100), (50, 80)]
)
def test_mean_keys_per_query_counts_attended_keys(seq_len, window):
    brute = sum(min(i + 1, window or seq_len) for i in range(seq_len)) / seq_len
    assert mean_keys_per_query(seq_len, window) == pytest.approx(brute)


def test_dense_mask_for_a_512_window_at_2048_does_about_4x_the_work():
    assert 2048 / mean_keys_per_query(2048, 512) == pytest.approx(4.571, abs=1e-3)


@pytest.mark.parametrize("config", [small_config(), small_config(tie_word_embeddings=True), get_preset("tiny")])
def test_matmul_parameters_are_the_model_linear_weights(config):
    model = PretrainForCausalLM(config)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert matmul_parameters(config) == linear


def test_windows_lower_the_attention_term_and_nothing_else():
    full, windowed = small_config(), small_config(window_pattern="SSSL", sliding_window=64)
    assert matmul_parameters(full) == matmul_parameters(windowed)
    assert attention_flops_per_token(windowed, 1024) < attention_flops_per_token(full, 1024)
    # 12 * heads * head_dim * keys, summed over layers: 3 window layers and 1 full layer
    expected = 12 * 4 * 16 * (3 * mean_keys_per_query(1024, 64) + mean_keys_per_query(1024))
    assert attention_flops_per_token(windowed, 1024) == pytest.approx(expected)
    assert flops_per_token(full, 1024) == pytest.approx(
        6 * matmul_parameters(full) + attention_flops_per_token(full, 1024)
    )
