"""Tensor and context parallelism on CPU processes are refused in one line, before any work (docs/distributed.md):
accelerate refuses a ParallelismConfig under DistributedType.MULTI_CPU, and torch's context parallel has no CPU
SDPA sharding rule. DeepSpeed Ulysses sequence parallelism runs on gloo (tests/distributed/test_sequence_parallel.py);
what breaks under it is refused in one line, and the mask its attention drops is rebuilt for the whole sequence
(hf_pretrain/training/sequence_parallel.py). So does DeepSpeed AutoTP tensor parallelism
(tests/distributed/test_tensor_parallel.py; refusals in hf_pretrain/training/tensor_parallel.py)."""

import types
from pathlib import Path

import pytest
import torch
from accelerate import ParallelismConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from hf_pretrain import PretrainForCausalLM
from hf_pretrain.modeling.attention import build_attention_masks
from hf_pretrain.training import tensor_parallel
from hf_pretrain.training.sequence_parallel import (
    FullSequenceSdpa,
    PositionIds,
    check_arguments,
    check_run,
    data_parallel_groups,
)
from tests.conftest import quick_args, small_config

ZERO3 = str(Path(__file__).resolve().parents[2] / "ds_configs" / "zero3.json")


@pytest.mark.parametrize("field", ["tp_size", "cp_size"])
def test_tensor_and_context_parallelism_are_refused_on_a_cpu(tmp_path, field):
    with pytest.raises(ValueError, match=rf"^parallelism_config\.{field}=2 needs GPUs: .*; set {field}=1 on a CPU"):
        quick_args(tmp_path, use_cpu=True, parallelism_config=ParallelismConfig(**{field: 2}))


def test_the_launch_config_parallelism_is_refused_too(tmp_path, monkeypatch):
    """`accelerate launch` with parallelism_config_tp_size in its config: accelerate builds it from the environment."""
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_TP_SIZE", "2")
    with pytest.raises(ValueError, match=r"^parallelism_config\.tp_size=2 needs GPUs"):
        quick_args(tmp_path, use_cpu=True)


def test_a_trivial_config_passes(tmp_path):
    config = ParallelismConfig(tp_size=1, cp_size=1)
    assert quick_args(tmp_path, use_cpu=True, parallelism_config=config).parallelism_config is config


def test_sequence_parallelism_without_deepspeed_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"^parallelism_config\.sp_size=2: Ulysses .* runs inside DeepSpeed"):
        quick_args(tmp_path, use_cpu=True, parallelism_config=ParallelismConfig(sp_size=2))


def test_sequence_parallelism_must_divide_the_processes(monkeypatch):
    args = types.SimpleNamespace(deepspeed=ZERO3, parallelism_config=ParallelismConfig(sp_size=2))
    monkeypatch.setenv("WORLD_SIZE", "3")
    with pytest.raises(ValueError, match=r"^parallelism_config\.sp_size=2: it does not divide the 3 processes"):
        check_arguments(args)
    monkeypatch.setenv("WORLD_SIZE", "4")
    check_arguments(args)  # SP=2 x data parallel 2


def test_the_launch_config_keys_are_read(monkeypatch):
    """`accelerate launch` with parallelism_config_sp_size: 2 but no DeepSpeed: the environment says it."""
    monkeypatch.setenv("ACCELERATE_USE_PARALLELISM_CONFIG", "true")
    monkeypatch.setenv("PARALLELISM_CONFIG_SP_SIZE", "2")
    with pytest.raises(ValueError, match="runs inside DeepSpeed"):
        check_arguments(types.SimpleNamespace(deepspeed=None, parallelism_config=None))


@pytest.mark.parametrize(
    "case, overrides, seq_len, zero, message",
    [
        ("zero2", {}, 32, 2, "checked only with DeepSpeed ZeRO-3"),
        ("no deepspeed stage", {}, 32, None, "checked only with DeepSpeed ZeRO-3"),
        ("heads", {"num_attention_heads": 2, "num_key_value_heads": 2, "hidden_size": 64}, 32, 3, None),
        ("kv heads", {"num_key_value_heads": 1}, 32, 3, None),
        ("seq len", {}, 33, 3, "sequence length 33 is not divisible"),
        ("eval", {}, 32, 3, "sp_disable_in_eval=False: evaluation batches are whole rows"),
    ],
)
def test_what_breaks_under_sequence_parallelism_is_refused(case, overrides, seq_len, zero, message):
    sp = 4 if case == "heads" else 2
    model = PretrainForCausalLM(small_config(**overrides))
    if case == "kv heads":  # 1 KV head: a divisor of sp, DeepSpeed replicates it; passes
        assert check_run(ParallelismConfig(sp_size=2), model, seq_len, zero) == "sdpa"
        return
    if message is None:
        message = "num_attention_heads=2 must be divisible"
    config = ParallelismConfig(sp_size=sp)
    config.sp_handler.sp_disable_in_eval = case != "eval"
    with pytest.raises(ValueError, match=rf"^parallelism_config\.sp_size={sp}: .*{message}"):
        check_run(config, model, seq_len, zero)


@pytest.mark.parametrize(
    "overrides", [{"window_pattern": "SL", "sliding_window": 8}, {"num_experts": 4, "num_experts_per_tok": 2}]
)
def test_windows_and_moe_pass_under_sequence_parallelism(overrides):
    """Windows (and packed documents, which check_run no longer looks at) run: FullSequenceSdpa rebuilds the mask;
    MoE runs: the router's losses are summed over the SP group (tests/distributed/test_sequence_parallel.py follows
    the one-process curve with all three)."""
    model = PretrainForCausalLM(small_config(**overrides))
    assert check_run(ParallelismConfig(sp_size=2), model, 32, 3) == "sdpa"


def test_the_mask_ulysses_drops_is_rebuilt_from_the_whole_positions():
    """Each layer's kernel, given no mask (what DeepSpeed's wrapper passes) and the gathered positions of two
    documents a row, computes what SDPA computes with the model's own mask: windows on the window layers, no attention
    across the boundary; plain causal SDPA (the old behaviour) differs on both layer types."""
    torch.manual_seed(0)
    model = PretrainForCausalLM(small_config(window_pattern="SL", sliding_window=4)).eval()
    positions = torch.cat([torch.arange(10), torch.arange(14)]).repeat(2, 1)  # 2 rows: documents of 10 and 14
    with torch.no_grad():  # plans the kernels: SDPA for both layer types on a CPU
        model(input_ids=torch.randint(3, 100, (2, 24)), position_ids=positions)
    config, dim = model.config, model.model.layers[0].self_attn.head_dim
    query = torch.randn(2, config.num_attention_heads, 24, dim)
    key, value = torch.randn(2, 2, config.num_key_value_heads, 24, dim).unbind(0)
    embeds = torch.empty(2, 24, 0)
    masks = build_attention_masks(model.model._mask_configs, embeds, None, None, positions)
    kernel = FullSequenceSdpa()
    for layer in model.model.layers[:2]:  # "S" then "L"
        attention = layer.self_attn
        window = attention.sliding_window
        expected, _ = sdpa_attention_forward(attention, query, key, value, masks[layer.layer_type])
        plain, _ = sdpa_attention_forward(attention, query, key, value, None)
        rebuilt, _ = kernel(attention, query, key, value, None, position_ids=positions, sliding_window=window)
        assert torch.allclose(rebuilt, expected, atol=1e-6, rtol=0), layer.layer_type
        assert not torch.allclose(plain, expected, atol=1e-3), layer.layer_type
    assert [window for window, _ in kernel._masks] == [4, None]
    mask = kernel.mask(attention, query, positions.clone(), None)  # equal positions: the same mask, not a rebuild
    assert mask is kernel.mask(attention, query, positions.clone(), None)
    assert kernel.mask(attention, query, torch.arange(24).repeat(2, 1), None) is None  # one document: is_causal


def test_the_kernel_follows_the_model():
    model = PretrainForCausalLM(small_config())
    assert check_run(ParallelismConfig(sp_size=2), model, 32, 3) == model.config._attn_implementation == "sdpa"
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    config = ParallelismConfig(
        sp_size=2, sp_handler=DeepSpeedSequenceParallelConfig(sp_attn_implementation="flash_attention_2")
    )
    with pytest.raises(ValueError, match=r"sp_attn_implementation='flash_attention_2' but the model runs 'sdpa'"):
        check_run(config, model, 32, 3)


def test_position_ids_are_added_to_batches_without_them():
    collate = PositionIds(lambda rows: {"input_ids": torch.tensor(rows), "labels": torch.tensor(rows)})
    batch = collate([[5, 6, 7, 8], [9, 10, 11, 12]])
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3], [0, 1, 2, 3]]
    kept = PositionIds(lambda rows: {"input_ids": torch.tensor(rows), "position_ids": torch.tensor([[0, 1, 0, 1]])})
    assert kept([[5, 6, 7, 8]])["position_ids"].tolist() == [[0, 1, 0, 1]]


def test_left_padding_is_refused_under_sequence_parallelism():
    """Ulysses drops the padding mask: right padding needs none (causal), left padding would be attended to."""

    def padded(mask):
        return PositionIds(lambda rows: {"input_ids": torch.tensor(rows), "attention_mask": torch.tensor(mask)})

    assert padded([[1, 1, 1, 0], [1, 1, 1, 1]])([[5, 6, 7, 0], [5, 6, 7, 8]])["position_ids"].shape == (2, 4)
    with pytest.raises(ValueError, match=r"^attention_mask: padding before tokens \(left padding\)"):
        padded([[0, 1, 1, 1], [1, 1, 1, 1]])([[0, 6, 7, 8], [5, 6, 7, 8]])


@pytest.mark.parametrize(
    "case, overrides, message",
    [
        ("world", {"world": 3}, "it does not divide the 3 processes; launch a multiple of 2 processes"),
        (
            "zero3",
            {"zero_stage": 3},
            "DeepSpeed's AutoTP training runs with ZeRO stage 0, 1 or 2, not 3 .* use ds_configs/zero1_autotp.json",
        ),
        ("sp", {"sp_size": 2}, r"not checked with Ulysses sequence parallelism \(sp_size=2\)"),
        ("two tp", {"parallel_tp_size": 2}, "parallelism_config.tp_size=2 would split the model a second time"),
        ("fp8", {"precision": "fp8"}, "AutoTP replaces the linears precision='fp8' converted"),
        ("te-fp8", {"precision": "te-fp8"}, "AutoTP replaces the linears precision='te-fp8' converted"),
    ],
)
def test_what_breaks_under_autotp_is_refused(case, overrides, message):
    """Each found by running 2 gloo ranks (hf_pretrain/training/tensor_parallel.py): ZeRO-3's batch assertion, fp8
    layers replaced by AutoTP's fp32 ones (the losses of the fp32 run, to the bit)."""
    run = {"world": 2, "zero_stage": 1, "sp_size": 1, "parallel_tp_size": 1, "precision": None}
    with pytest.raises(ValueError, match=rf"^tensor_parallel\.autotp_size=2: {message}"):
        tensor_parallel.check_run(2, **{**run, **overrides})


@pytest.mark.parametrize("zero_stage, precision", [(0, None), (1, "bf16"), (2, "fp32")])
def test_what_runs_under_autotp_passes(zero_stage, precision):
    tensor_parallel.check_run(2, world=4, zero_stage=zero_stage, sp_size=1, parallel_tp_size=1, precision=precision)


def test_the_data_parallel_groups_are_named_for_deepspeed_s_batch_check():
    """accelerate sizes DeepSpeed's train_batch_size by the config's data-parallel size under SP (1 unless named):
    SP 2 on 8 processes must say 4 groups, else DeepSpeed stops at the first prepare."""
    assert data_parallel_groups(ParallelismConfig(sp_size=2), 8) == 4
    assert data_parallel_groups(ParallelismConfig(sp_size=2, dp_shard_size=4), 8) == 4
    assert data_parallel_groups(ParallelismConfig(sp_size=2), 2) == 1
    with pytest.raises(ValueError, match=r"^parallelism_config\.sp_size=2: dp_replicate_size=1 x dp_shard_size=3"):
        data_parallel_groups(ParallelismConfig(sp_size=2, dp_shard_size=3), 8)
