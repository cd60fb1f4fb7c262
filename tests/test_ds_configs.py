"""The DeepSpeed presets parse through transformers' integration and DeepSpeed's own parser."""

import json
from pathlib import Path

import pytest

deepspeed_config = pytest.importorskip("deepspeed.runtime.config", reason="deepspeed is not installed")

from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig  # noqa: E402

from hf_pretrain import PretrainForCausalLM, PretrainingArguments, get_preset  # noqa: E402

PRESETS = sorted((Path(__file__).resolve().parents[1] / "ds_configs").glob("*.json"))


def test_presets_exist():
    assert {p.stem for p in PRESETS} == {"zero1_autotp", "zero2", "zero3", "zero3_offload", "zero3_zeropp"}


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.stem)
def test_trainer_fills_every_auto_and_deepspeed_accepts_the_result(path, tmp_path):
    args = PretrainingArguments(
        output_dir=str(tmp_path), per_device_train_batch_size=4, gradient_accumulation_steps=2, max_grad_norm=0.5
    )
    config = HfTrainerDeepSpeedConfig(str(path))
    config.trainer_config_process(args)
    config.trainer_config_finalize(args, PretrainForCausalLM(get_preset("tiny")), num_training_steps=100)
    assert '"auto"' not in json.dumps(config.config)  # no value left "auto" (autotp_size is a key)
    parsed = deepspeed_config.DeepSpeedConfig(config.config)
    assert parsed.train_micro_batch_size_per_gpu == 4 and parsed.gradient_accumulation_steps == 2
    assert parsed.gradient_clipping == 0.5
    assert parsed.zero_optimization_stage == int(path.stem[4])
    if parsed.zero_optimization_stage == 3 or "autotp" in path.stem:
        # Save full weights (in the training dtype), not near-empty shards or one TP rank's slices.
        assert parsed.zero_config.gather_16bit_weights_on_model_save
    if "autotp" in path.stem:  # DeepSpeed AutoTP of 2 (hf_pretrain/training/tensor_parallel.py)
        assert parsed.tensor_parallel_config.autotp_size == 2


def test_offload_and_compressed_presets_say_what_they_do(tmp_path):
    args = PretrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2)
    parsed = {}
    for name in ("zero3_offload", "zero3_zeropp"):
        config = HfTrainerDeepSpeedConfig(str(PRESETS[0].parent / f"{name}.json"))
        config.trainer_config_process(args)
        config.trainer_config_finalize(args, PretrainForCausalLM(get_preset("tiny")), num_training_steps=10)
        parsed[name] = deepspeed_config.DeepSpeedConfig(config.config).zero_config
    offload = parsed["zero3_offload"]
    assert offload.offload_optimizer.device == "cpu" and offload.offload_param.device == "cpu"
    zeropp = parsed["zero3_zeropp"]
    assert zeropp.zero_quantized_weights and zeropp.zero_quantized_gradients and zeropp.zero_hpz_partition_size == 8


def test_one_bit_adam_is_not_offered_because_this_deepspeed_has_none():
    # Checked against DeepSpeed's own optimizer list: 1-bit Adam / 0/1 Adam / 1-bit LAMB are gone from it
    # (and never composed with ZeRO: "1bit-Adam is not compatible with ZeRO"). ZeRO++ is the compressed preset.
    names = {name.lower() for name in deepspeed_config.DEEPSPEED_OPTIMIZERS}
    assert not names & {"onebitadam", "zerooneadam", "onebitlamb"}
