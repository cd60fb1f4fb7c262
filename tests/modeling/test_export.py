import json

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM, MinistralForCausalLM

from hf_pretrain import PretrainForCausalLM, export_hf
from tests.conftest import small_config


@pytest.mark.parametrize(
    "pattern, model_type, cls",
    [
        ("L", "llama", LlamaForCausalLM),
        ("SSSL", "ministral", MinistralForCausalLM),
        ("SL", "ministral", MinistralForCausalLM),
    ],
)
def test_export_loads_in_plain_transformers_with_same_logits(tmp_path, pattern, model_type, cls):
    torch.manual_seed(0)
    model = PretrainForCausalLM(small_config(window_pattern=pattern, sliding_window=6)).eval()
    model.save_pretrained(tmp_path / "ours")
    export_hf(tmp_path / "ours", tmp_path / "plain")
    saved = json.loads((tmp_path / "plain" / "config.json").read_text())
    assert saved["model_type"] == model_type and "window_pattern" not in saved
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "plain").eval()
    assert type(plain) is cls
    ids = torch.randint(0, 128, (2, 50))  # longer than the window, so windows matter
    with torch.no_grad():
        assert (model(ids).logits - plain(ids).logits).abs().max().item() <= 1e-5


def test_export_from_a_model_object_and_copies_nothing_it_lacks(tmp_path):
    model = PretrainForCausalLM(small_config())
    out = export_hf(model, tmp_path / "plain")
    assert (out / "model.safetensors").exists() and not (out / "tokenizer.json").exists()


def test_windowed_model_with_biases_has_no_target():
    model = PretrainForCausalLM(small_config(window_pattern="SL", sliding_window=4, attention_bias=True))
    with pytest.raises(ValueError, match="attention_bias/mlp_bias"):
        export_hf(model, "unused")
