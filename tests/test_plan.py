"""`hf-pretrain plan`: the arithmetic against hand-computed cases and the published fits, the refusals, plans that
fit their memory per the estimator, and launch files that the example, accelerate and the schedules accept."""

import importlib.util
import json
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hf_pretrain import PretrainConfig
from hf_pretrain.chips import device_memory_bytes
from hf_pretrain.cli import main as cli
from hf_pretrain.distributed.memory import estimate_memory
from hf_pretrain.modeling.accounting import count_parameters, flops_per_token
from hf_pretrain.plan import PlanRefused, PlanRequest, make_plan, write_plan
from hf_pretrain.plan.hardware import LINK_EFFICIENCY, MFU_ASSUMPTIONS, resolve_hardware
from hf_pretrain.plan.output import launch_command
from hf_pretrain.plan.planner import CHECKPOINTING_COST, STRATEGIES, candidate_strategies, fit_sequence_parallel
from hf_pretrain.plan.resilience import checkpoint_plan
from hf_pretrain.plan.scaling import (
    ASPECTS,
    compute_optimal_shape,
    deepseek_batch_tokens,
    deepseek_peak_lr,
    family,
    non_embedding_flops_per_token,
    shape,
    shape_for_parameters,
    widths,
)
from hf_pretrain.presets import get_preset, load_config
from hf_pretrain.training.schedules import build_schedule
from hf_pretrain.trial import summarize

ROOT = Path(__file__).resolve().parents[1]
GiB = 1024**3


def load_example():
    spec = importlib.util.spec_from_file_location("pretrain_example", ROOT / "examples" / "pretrain.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(module)
    return module


# ---------------------------------------------------------------- the published fits


def test_deepseek_fits_hand_computed():
    # log10 B = log10(0.2920) + 21 x 0.3271 = -0.53462 + 6.86910 = 6.33448 -> 2.1601e6 tokens
    assert deepseek_batch_tokens(1e21) == pytest.approx(2.1601e6, rel=1e-4)
    # log10 eta = log10(0.3118) - 21 x 0.1250 = -0.50613 - 2.62500 = -3.13113 -> 7.394e-4
    assert deepseek_peak_lr(1e21) == pytest.approx(7.394e-4, rel=1e-3)


@pytest.mark.parametrize(
    "layers, width, ffn, heads, kv, batch_sequences, lr",
    [(30, 4096, 11008, 32, 32, 2304, 4.2e-4), (95, 8192, 22016, 64, 8, 4608, 3.2e-4)],
    ids=["7B", "67B"],
)
def test_deepseek_fits_reproduce_the_papers_own_choices(layers, width, ffn, heads, kv, batch_sequences, lr):
    """DeepSeek LLM (arXiv 2401.02954) trained its 7B and 67B on 2T tokens at 4096 with these batch sizes and
    peak learning rates; its fits at C = non-embedding FLOPs per token x tokens land within 10 % of them."""
    config = PretrainConfig(
        vocab_size=102400,
        hidden_size=width,
        intermediate_size=ffn,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        max_position_embeddings=4096,
    )
    compute = non_embedding_flops_per_token(config, 4096) * 2e12
    assert deepseek_batch_tokens(compute) == pytest.approx(batch_sequences * 4096, rel=0.10)
    assert deepseek_peak_lr(compute) == pytest.approx(lr, rel=0.10)


def test_non_embedding_flops_leave_out_only_the_lm_head():
    config = get_preset("1.4b")
    head = 6 * 2048 * 65536
    assert flops_per_token(config, 2048) - non_embedding_flops_per_token(config, 2048) == head


def test_compute_optimal_shape_is_the_closest_chinchilla_run_of_the_family():
    budget = 1e21

    def distance(c):
        return abs(math.log(flops_per_token(c, 2048) * 20 * count_parameters(c) / budget))

    config = compute_optimal_shape(budget, 20.0, 2048, vocab_size=65536)
    members = family(65536, 2048)
    assert distance(config) <= min(distance(c) for c in members)  # no member closer (the depth is refined after)
    assert distance(config) < math.log(1.05)
    sizes = [count_parameters(c) for c in members if count_parameters(c) > 1e8]
    assert max(b / a for a, b in zip(sizes, sizes[1:])) < 1.12  # no gap where the width steps by whole heads


def test_shapes_follow_the_presets_recipe():
    c = shape(32, 65536, 2048)  # width 96 x 32 = 3072: 24 heads of 128, 8 KV (Llama 3.2 3B)
    assert (c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads) == (3072, 128, 24, 8)
    assert c.intermediate_size == 8192  # 8/3 x 3072 = 8192, a multiple of 256
    qwen = shape(37, 65536, 2048)  # 96 x 37 = 3552 -> 3584: 28 heads, 4 KV (Qwen 2.5 7B)
    assert (qwen.hidden_size, qwen.num_attention_heads, qwen.num_key_value_heads) == (3584, 28, 4)
    small = shape(4, 4096, 256)  # 384 wide: head_dim 64, 6 heads -> plain multi-head
    assert (small.hidden_size, small.head_dim, small.num_key_value_heads) == (384, 64, 6)
    gpt2 = shape(8, 4096, 256)  # 768 wide: 12 heads of 64 (GPT-2 small), 4 KV
    assert (gpt2.num_attention_heads, gpt2.num_key_value_heads) == (12, 4) and not gpt2.tie_word_embeddings


@pytest.mark.parametrize(
    "params, layers, width, heads", [(7e9, 36, 4096, 32), (8e9, 42, 4096, 32), (70e9, 99, 8192, 64)]
)
def test_large_shapes_have_llama_heads_that_sequence_and_tensor_parallelism_split(params, layers, width, heads):
    """7B was 40 x 3840 with 30 heads / 15 KV and 70B 88 x 8448 with 66 / 33: no SP (or TP) degree of 8 GPUs split
    them. Now Llama's: 4096 wide with 32 heads / 8 KV at 7-8B, 8192 with 64 / 8 at 70B, head_dim 128."""
    c = shape_for_parameters(params, vocab_size=65536, seq_len=4096)
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim) == (
        layers, width, heads, 8, 128
    )  # fmt: skip
    assert count_parameters(c) == pytest.approx(params, rel=0.02)
    for width in widths(20480):  # every family width: whole heads, KV a power of two dividing them
        c = shape(max(2, width // 96), 65536, 2048, width=width)
        n, kv = c.num_attention_heads, c.num_key_value_heads
        assert n * c.head_dim == width and (kv == n < 8 or (not n % kv and kv & (kv - 1) == 0 and kv <= 8))
        if width >= 4096:  # SP / TP 2, 4 and 8 all split heads and KV heads
            assert not n % 8 and kv == 8, width
    for c in family(65536, 2048):
        assert ASPECTS[0] <= c.hidden_size / c.num_hidden_layers <= ASPECTS[1]


# ---------------------------------------------------------------- MFU assumptions and their sources


def test_gb10_mfu_assumption_is_the_field_notes_run_recomputed():
    """Field notes A, run 1: the 0.9b preset, 5.2B tokens, 6 days 21 hours on one GB10 (125 TFLOP/s bf16)."""
    achieved = 5.2e9 * flops_per_token(get_preset("0.9b"), 2048) / (165 * 3600)
    assert achieved / 125e12 == pytest.approx(MFU_ASSUMPTIONS["gb10"][0], abs=0.01)


def test_a100_mfu_assumption_is_the_field_notes_run_recomputed():
    """Field notes B: a 7B at 4K on 8 x A100 (312 TFLOP/s bf16), ~1.1B tokens a day."""
    achieved = 1.1e9 / 86400 / 8 * flops_per_token(get_preset("llama2-7b"), 4096)
    assert achieved / 312e12 == pytest.approx(MFU_ASSUMPTIONS["a100"][0], abs=0.01)


# ---------------------------------------------------------------- the plan's arithmetic


def test_hours_budget_hand_computed_and_spent():
    plan = make_plan(PlanRequest("h100", gpus=8, hours=24, data_tokens=50e9))
    # 24 h x 3600 s x 8 GPUs x 989.4 TFLOP/s (H100 SXM dense bf16) x MFU 0.40 = 2.7355e20 FLOPs
    assert plan.budget["flops"] == pytest.approx(2.7355e20, rel=1e-4)
    assert plan.hardware.mfu == 0.40 and "assumption" in plan.hardware.mfu_source
    fpt = flops_per_token(plan.config, 2048)
    assert plan.tokens_per_second == pytest.approx(8 * 989.4e12 * 0.40 / fpt)
    assert plan.global_batch_tokens == 8 * plan.micro_batch * plan.grad_accum * 2048
    assert plan.tokens == plan.steps * plan.global_batch_tokens
    assert plan.step_seconds == pytest.approx(plan.global_batch_tokens / plan.tokens_per_second)
    assert abs(plan.hours - 24) <= plan.step_seconds / 3600  # spent to within one step
    assert plan.gpu_hours == pytest.approx(8 * plan.hours)
    assert plan.epochs == pytest.approx(plan.tokens / 50e9)
    # compute-optimal: ~20 tokens per parameter, up to the family's step between depths
    assert 15 < plan.tokens / plan.parameters < 27
    # batch and learning rate: DeepSeek's fits at C = non-embedding FLOPs x tokens, batch rounded to the GPUs
    compute = non_embedding_flops_per_token(plan.config, 2048) * plan.tokens
    assert plan.peak_lr == pytest.approx(0.3118 * compute**-0.125, rel=1e-3)
    assert plan.global_batch_tokens == pytest.approx(0.2920 * compute**0.3271, rel=0.25)


def test_tokens_and_params_budget_hand_computed():
    plan = make_plan(PlanRequest("h100", tokens=20e9, params=1e9, mfu=0.5))
    assert count_parameters(plan.config) == pytest.approx(1e9, rel=0.1)
    assert plan.tokens == pytest.approx(20e9, abs=plan.global_batch_tokens / 2)
    fpt = flops_per_token(plan.config, 2048)
    assert plan.hours == pytest.approx(plan.tokens * fpt / (989.4e12 * 0.5) / 3600)
    assert plan.hardware.mfu_source == "--mfu (your assumption)"


def test_flops_budget_and_schedule_positions_in_tokens():
    plan = make_plan(PlanRequest("h200", gpus=8, flops=1e21, schedule="wsd"))
    assert plan.model_flops == pytest.approx(1e21, rel=0.02)  # rounded to whole steps
    kwargs = plan.schedule_kwargs
    assert kwargs["total_tokens"] == plan.tokens and kwargs["warmup_tokens"] == round(0.008 * plan.tokens)
    assert kwargs["decay_fraction"] == 0.2 and kwargs["shape"] == "1-sqrt"


def test_checkpointing_only_when_nothing_fits_without_it_and_it_costs_a_forward():
    plan = make_plan(PlanRequest("h100", params=3e9, seq_len=8192, tokens=60e9))
    assert plan.checkpointing
    strategy = STRATEGIES["single"]
    assert estimate_memory(plan.config, 0, 1, "bf16", 8192, 1).total > plan.usable_bytes  # not without it
    assert strategy.name == plan.strategy.name
    fpt = flops_per_token(plan.config, 8192)
    assert plan.tokens_per_second == pytest.approx(989.4e12 * 0.40 / (fpt * 4 / 3))


def test_with_checkpointing_the_model_is_compute_optimal_for_the_recompute_it_pays():
    """1024 H100 for 720 h: the model is sized for the FLOPs left after the recompute, so ~20 tokens per parameter
    (sized for the whole budget, then paying the recompute from the tokens, it was 98B at 13.4)."""
    plan = make_plan(PlanRequest("h100", gpus=8, nodes=128, hours=720))
    assert plan.checkpointing and 17 < plan.tokens / plan.parameters < 23
    assert abs(plan.hours - 720) <= plan.step_seconds / 3600  # the hours still spent, recompute included


def test_a_larger_model_that_fits_without_checkpointing_is_taken_at_full_speed():
    plan = make_plan(PlanRequest("h100", gpus=8, hours=720, seq_len=8192, sharding="fsdp2"))  # no SP under FSDP2
    [warning] = [w for w in plan.warnings if "largest shape without it" in w]
    optimal = float(warning.split("compute-optimal ")[1].split("B")[0]) * 1e9
    assert not plan.checkpointing and plan.parameters < optimal  # smaller than the optimum, larger than its resize
    assert plan.parameters > optimal / CHECKPOINTING_COST**0.5 and plan.tokens / plan.parameters > 20


def test_windows_are_planned_and_priced():
    plan = make_plan(PlanRequest("h100", gpus=8, hours=48, seq_len=8192, window_pattern="SSSL", sliding_window=1024))
    layers = plan.config.num_hidden_layers
    assert plan.config.layer_types[:4] == ["sliding_attention"] * 3 + ["full_attention"]
    plain = shape(
        layers, 65536, 8192, width=plan.config.hidden_size
    )  # the same shape without windows attends to more keys
    assert plan.flops_per_token == flops_per_token(plan.config, 8192) < flops_per_token(plain, 8192)


def test_low_precision_uses_its_own_peak_and_scaled_mfu():
    plan = make_plan(PlanRequest("h100", hours=10, precision="fp8"))
    assert plan.hardware.peak_tflops == 1978.9
    assert plan.hardware.mfu == pytest.approx(0.40 * 1.3 / 2)  # ~1.3x bf16's speed against a 2x peak
    assert plan.memory.precision == "fp8"


def test_trial_gives_the_measured_mfu_and_the_recipe(tmp_path):
    def row(recipe, step, loss, mfu):
        return {"recipe": recipe, "status": "ok", "median_step_s": step, "peak_memory_gib": 50.0,
                "final_loss": loss, "mfu_spec": mfu}  # fmt: skip

    trial = tmp_path / "trial.json"
    trial.write_text(json.dumps(summarize([row("bf16", 4.0, 3.10, 0.31), row("fp8", 3.1, 3.11, 0.20)], 30, 5, 0.05)))
    plan = make_plan(PlanRequest("h100", gpus=8, hours=24, trial=str(trial)))
    assert plan.hardware.precision == "fp8" and plan.hardware.mfu == 0.20 and "trial" in plan.hardware.mfu_source
    fpt = flops_per_token(plan.config, 2048)
    assert plan.tokens_per_second == pytest.approx(8 * 1978.9e12 * 0.20 / fpt)
    forced = make_plan(PlanRequest("h100", gpus=8, hours=24, trial=str(trial), precision="bf16"))
    assert forced.hardware.mfu == 0.31 and forced.hardware.peak_tflops == 989.4


# ---------------------------------------------------------------- plans fit their memory


HARDWARE = {
    "1x H100": dict(device="h100", gpus=1, nodes=1),
    "8x H100": dict(device="h100", gpus=8, nodes=1),
    "16x H100": dict(device="h100", gpus=8, nodes=2),
    "GB10 pair": dict(device="gb10", gpus=1, nodes=2),
}


@pytest.mark.parametrize("hours", [24, 24 * 30])
@pytest.mark.parametrize("name", list(HARDWARE))
def test_plans_fit_their_memory_per_the_estimator(name, hours):
    hw = HARDWARE[name]
    plan = make_plan(PlanRequest(**hw, hours=hours, data_tokens=1e12))
    world = hw["gpus"] * hw["nodes"]
    device = device_memory_bytes(hw["device"])
    estimate = estimate_memory(
        plan.config, plan.strategy.zero, world, "bf16", 2048, plan.micro_batch, checkpointing=plan.checkpointing
    )
    assert estimate.total <= 0.85 * device, (name, plan.strategy, estimate.total / GiB)
    # the largest micro-batch the strategy holds, unless the batch needs no more per GPU
    per_gpu = plan.micro_batch * plan.grad_accum
    bigger = estimate_memory(
        plan.config, plan.strategy.zero, world, "bf16", 2048, 2 * plan.micro_batch, checkpointing=plan.checkpointing
    )
    assert bigger.total > 0.85 * device or 2 * plan.micro_batch > per_gpu or plan.micro_batch == 64
    if not plan.checkpointing:  # checkpointing only when nothing fits without it
        return
    for strategy in candidate_strategies(plan.hardware, "deepspeed"):
        assert estimate_memory(plan.config, strategy.zero, world, "bf16", 2048, 1).total > 0.85 * device


def test_a_month_on_sixteen_h100_shards_and_a_day_on_one_does_not():
    month = make_plan(PlanRequest("h100", gpus=8, nodes=2, hours=720))
    day = make_plan(PlanRequest("h100", hours=24))
    assert month.strategy.zero >= 2 and month.parameters > 5e9
    assert day.strategy.name == "single" and day.parameters < 1e9


def test_strategy_is_the_cheapest_communication_that_holds_8k_tokens_per_micro_batch():
    day = make_plan(PlanRequest("h100", gpus=8, hours=24))
    assert day.strategy.name == "ddp" and day.micro_batch * 2048 >= 8192
    week = make_plan(PlanRequest("h100", gpus=8, hours=168))
    usable = week.usable_bytes
    assert estimate_memory(week.config, 0, 8, "bf16", 2048, 4).total > usable  # DDP does not hold 8K tokens
    assert week.strategy.name == "zero2" and week.micro_batch >= 4 and not week.checkpointing
    fsdp = make_plan(PlanRequest("h100", gpus=8, hours=168, sharding="fsdp2"))
    assert fsdp.strategy.name == "fsdp2" and fsdp.strategy.zero == 3


# ---------------------------------------------------------------- refusals


def test_checkpoint_interval_is_young_daly_from_the_stall_and_llama3_failure_rate():
    eight = checkpoint_plan(16e9, 8)  # 16 GB staged at 16 GB/s: a 1 s stall
    mtbf = 54 * 24 * 16384 / 419 / 8  # GPU-hours per failure in Llama 3's pretraining, over 8 GPUs: 6,335 h
    assert eight.stall_s == pytest.approx(1.0) and eight.mtbf_hours == pytest.approx(mtbf)
    assert eight.interval_s == pytest.approx(math.sqrt(2 * 1.0 * mtbf * 3600))  # ~1.9 h
    assert eight.lost_share == pytest.approx(1 / eight.interval_s + eight.interval_s / (2 * mtbf * 3600))
    many = checkpoint_plan(16e9, 8192)
    assert many.interval_s == pytest.approx(eight.interval_s / 32)  # 1024x the failures: sqrt(1024) = 32x as often
    given = checkpoint_plan(16e9, 8, checkpoint_seconds=8.0, mtbf_hours=2.0)
    assert (
        given.interval_s == pytest.approx(math.sqrt(2 * 8.0 * 2.0 * 3600))
        and given.stall_source == "--checkpoint-seconds"
    )
    plan = make_plan(PlanRequest("h100", gpus=8, hours=168, mtbf_hours=24))
    command = launch_command(plan, "plan", "DATA", "runs/x")
    save_steps = int(command[command.index("--save_steps") + 1])
    assert save_steps == round(plan.checkpoints.interval_s / plan.step_seconds)
    assert command[command.index("--resume_from_checkpoint") + 1] == "auto" and "--max_restarts" in command


def test_goodput_from_a_run_gives_the_measured_stall_and_failure_rate_and_flags_win(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    logs = [  # the keys GoodputCallback logs (telemetry/goodput.py), the last log of a 10 h run with 2 restarts
        {"step": 100, "goodput": 0.9, "goodput_wall_s": 1800.0, "goodput_saves": 1, "goodput_checkpoint_s": 9.0},
        {"step": 900, "goodput": 0.8, "goodput_wall_s": 36000.0, "goodput_productive_s": 28800.0,
         "goodput_saves": 12, "goodput_checkpoint_s": 60.0, "goodput_restarts": 2, "goodput_restart_s": 3000.0},
        {"step": 901, "loss": 2.0},  # a later log without goodput
    ]  # fmt: skip
    (run / "telemetry.jsonl").write_text("".join(json.dumps(r) + "\n" for r in logs))
    plan = make_plan(PlanRequest("h100", gpus=8, hours=168, goodput_from=str(run)))
    ckpt = plan.checkpoints
    assert ckpt.stall_s == pytest.approx(5.0) and ckpt.mtbf_hours == pytest.approx(5.0)  # 60 s / 12, 10 h / 2
    assert ckpt.interval_s == pytest.approx(math.sqrt(2 * 5.0 * 5.0 * 3600))
    assert ckpt.stall_source == f"measured in {run} (12 saves, 5.00 s each)"
    assert ckpt.mtbf_source == f"measured in {run} (2 restarts in 10.00 h)"
    flags = make_plan(PlanRequest("h100", gpus=8, hours=168, goodput_from=str(run), mtbf_hours=24.0))
    assert flags.checkpoints.mtbf_source == "--mtbf-hours" and flags.checkpoints.stall_s == pytest.approx(5.0)
    logs[1]["goodput_restarts"] = 0  # no failure seen: the default failure rate stays
    (run / "telemetry.jsonl").write_text(json.dumps(logs[1]) + "\n")
    quiet = make_plan(PlanRequest("h100", gpus=8, hours=168, goodput_from=str(run))).checkpoints
    assert quiet.mtbf_source == "Llama 3's failure rate over 8 GPUs" and quiet.stall_s == pytest.approx(5.0)
    assert cli(["plan", "--device", "h100", "--gpus", "8", "--hours", "168", "--goodput-from", str(run),
                "--out", str(tmp_path / "plan")]) == 0  # fmt: skip
    assert f"stall: measured in {run} (12 saves, 5.00 s each)" in capsys.readouterr().out
    (run / "telemetry.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    with pytest.raises(ValueError, match=r"--goodput-from .*: no goodput in its telemetry.jsonl"):
        make_plan(PlanRequest("h100", gpus=8, hours=168, goodput_from=str(run)))


def test_refuses_a_model_that_cannot_fit_and_names_the_largest_that_does():
    with pytest.raises(PlanRefused) as refused:
        make_plan(PlanRequest("h100", params=7e9, tokens=140e9))
    message = str(refused.value)
    assert "does not fit one training step on h100" in message and "67.7 GiB usable" in message
    assert "one GPU (nothing to shard)" in message and "full activation checkpointing" in message
    suggested = float(message.split("pass --params ")[1].split(",")[0])
    plan = make_plan(PlanRequest("h100", params=suggested, tokens=140e9))  # the suggestion plans
    assert plan.memory.total <= plan.usable_bytes


def test_refuses_a_budget_below_the_smallest_shape():
    with pytest.raises(PlanRefused, match=r"smallest shape .* raise the budget, lower --vocab-size"):
        make_plan(PlanRequest("h100", hours=0.001))


def test_refuses_a_budget_below_one_optimizer_step():
    with pytest.raises(PlanRefused, match="less than one optimizer step"):
        make_plan(PlanRequest("h100", gpus=8, nodes=2, params=40e6, tokens=10_000))


def test_refuses_chips_without_a_peak_or_an_mfu_and_recipes_they_lack():
    with pytest.raises(PlanRefused, match=r"no recorded MFU .* --mfu"):
        make_plan(PlanRequest("l40s", hours=24))
    assert make_plan(PlanRequest("l40s", hours=24, mfu=0.35)).hardware.peak_tflops == 362.1
    with pytest.raises(PlanRefused, match=r"no dense bf16 peak .* --peak-tflops"):
        make_plan(PlanRequest("tpu-v5", hours=24, mfu=0.4, device_memory_gb=16))
    with pytest.raises(PlanRefused, match="no dense fp8 peak"):
        make_plan(PlanRequest("a100", hours=24, precision="fp8"))  # no FP8 tensor cores


def test_refuses_a_trial_without_an_mfu_against_spec(tmp_path):
    """A trial on a CPU (or a chip missing from peaks.py) has mfu_spec n/a: no MFU to plan with."""
    with pytest.raises(PlanRefused, match="unreadable"):
        make_plan(PlanRequest("h100", hours=24, trial=str(tmp_path / "missing.json")))
    for recipe in ("fp32", "bf16"):
        row = {"recipe": recipe, "status": "ok", "median_step_s": 1.0, "peak_memory_gib": 1.0, "final_loss": 5.0}
        trial = tmp_path / f"{recipe}.json"
        trial.write_text(json.dumps(summarize([row], 6, 2, 0.05)))
        with pytest.raises(PlanRefused, match=rf"the {recipe} row has no MFU against a spec peak \(mfu_spec n/a"):
            make_plan(PlanRequest("h100", hours=24, trial=str(trial)))
    withheld = {**row, "mfu_spec_warning": "mfu_spec 1.7 > 1: the peak is too low or the step timing short"}
    trial.write_text(json.dumps(summarize([withheld], 6, 2, 0.05)))
    with pytest.raises(PlanRefused, match=r"MFU was withheld as impossible \(mfu_spec 1.7 > 1"):
        make_plan(PlanRequest("h100", hours=24, trial=str(trial)))
    trial.write_text(json.dumps(summarize([{**row, "mfu_spec": 1.4}], 6, 2, 0.05)))  # an older file
    with pytest.raises(PlanRefused, match=r"mfu_spec 1.4 is not in \(0, 1\]"):
        make_plan(PlanRequest("h100", hours=24, trial=str(trial)))


def test_bad_requests_name_the_flag():
    with pytest.raises(ValueError, match="exactly one budget"):
        PlanRequest("h100", hours=1, tokens=1e9)
    with pytest.raises(ValueError, match=r"--mfu=1.5"):
        PlanRequest("h100", hours=1, mfu=1.5)
    with pytest.raises(ValueError, match=r"--seq-len=0"):
        PlanRequest("h100", hours=1, seq_len=0)
    with pytest.raises(ValueError, match="needs --sliding-window"):
        PlanRequest("h100", hours=1, window_pattern="SSSL")
    with pytest.raises(ValueError, match=r"--vocab-size=10 is too small for the byte-level BPE .* at least 259"):
        PlanRequest("h100", hours=1, vocab_size=10)


def test_warns_past_four_epochs_of_repeated_data():
    plan = make_plan(PlanRequest("h100", gpus=8, hours=24, data_tokens=2e9))
    [warning] = [w for w in plan.warnings if "epochs over" in w]
    assert "Muennighoff" in warning and f"{plan.epochs:.1f} epochs" in warning
    assert "8e+09 tokens (4 epochs) suit a model of ~4e+08 parameters (--tokens 8e+09)" in warning
    small = make_plan(PlanRequest("h100", tokens=1e9, data_tokens=5e7))  # 20 epochs; 4 suit no shape
    [tiny] = [w for w in small.warnings if "epochs" in w]
    assert "even the planner's smallest shape (1.73e+07 parameters) wants 3.46e+08 tokens: find more data" in tiny
    assert not any("epochs over" in w for w in make_plan(PlanRequest("h100", hours=24, data_tokens=1e12)).warnings)


@pytest.mark.parametrize("data", [1, 1e6, 4e8])
def test_refuses_a_plan_past_sixty_epochs_of_its_data(data, tmp_path, capsys):
    """28.4B tokens planned on 1 token of data was written as 28,447,866,880 epochs with exit 0 (30.0B now)."""
    flags = ["plan", "--device", "h100", "--gpus", "8", "--hours", "24", "--data-tokens", str(data)]
    assert cli([*flags, "--out", str(tmp_path / "plan")]) == 2
    error = capsys.readouterr().err
    planned = make_plan(PlanRequest("h100", gpus=8, hours=24)).tokens  # the same plan without --data-tokens
    epochs = planned / data
    assert error.startswith(
        f"error: --data-tokens {data:.3g}: the plan trains {planned:.3g} tokens, {epochs:,.0f} epochs"
    )
    assert error.count("\n") == 1 and "past 60 epochs" in error and "find more data" in error
    assert not (tmp_path / "plan").exists()  # nothing written
    assert make_plan(PlanRequest("h100", gpus=8, hours=24, data_tokens=planned / 60)).epochs == 60  # the edge


def test_cli_refusal_is_an_error_with_the_reason(capsys, tmp_path):
    assert cli(["plan", "--device", "h100", "--params", "7B", "--tokens", "140B", "--out", str(tmp_path)]) == 2
    assert "does not fit one training step" in capsys.readouterr().err


# ---------------------------------------------------------------- the files


@pytest.mark.parametrize(
    "flags, distributed_type",
    [
        (["--gpus", "1", "--hours", "24"], "NO"),
        (["--gpus", "8", "--hours", "24"], "MULTI_GPU"),
        (["--gpus", "8", "--nodes", "2", "--hours", "720"], "DEEPSPEED"),
        (["--gpus", "8", "--hours", "720", "--sharding", "fsdp2"], "FSDP"),
    ],
    ids=["one", "ddp", "zero2-two-nodes", "fsdp2"],
)
def test_cli_writes_files_accelerate_and_the_example_accept(flags, distributed_type, tmp_path, capsys):
    from accelerate.commands.config.config_args import load_config_from_file

    out = tmp_path / "plan"
    assert cli(["plan", "--device", "h100", *flags, "--data-tokens", "300B", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "predicted" in printed and "MFU 0.400" in printed and "accelerate launch" in printed
    saved = json.loads((out / "plan.json").read_text())
    every, count, share = re.search(
        r"--downstream_every (\d+): (\d+) evaluations, ~([\d.]+)% of the run", printed
    ).groups()
    assert int(every) * int(count) <= saved["batch"]["steps"] and float(share) <= 1.0  # the suite within 1 % of the run
    accel = load_config_from_file(str(out / "accelerate_config.yaml"))  # accelerate's own loader
    assert accel.distributed_type.value == distributed_type and accel.num_processes == saved["batch"]["gpus"]
    if distributed_type == "DEEPSPEED":
        assert (ROOT / accel.deepspeed_config["deepspeed_config_file"]).exists()
        assert accel.num_machines == 2 and accel.main_process_ip
    model = load_config(str(out / "model"))
    assert {k: getattr(model, k) for k in saved["model"]["config"]} == saved["model"]["config"]
    assert count_parameters(model) == saved["model"]["parameters"]
    script = (out / "launch.sh").read_text()
    assert saved["command"].split("examples/pretrain.py ")[1] in script

    # The example parses the command and builds the planned model; the schedule runs in tokens.
    argv = saved["command"].split("examples/pretrain.py ")[1]
    example = load_example()
    model_args, _, args = example.parse_args(shlex.split(argv))
    assert args.per_device_train_batch_size == saved["batch"]["micro_batch"]
    assert args.gradient_accumulation_steps == saved["batch"]["gradient_accumulation"]
    assert args.max_steps == saved["batch"]["steps"] and args.learning_rate == pytest.approx(
        saved["schedule"]["peak_lr"], rel=1e-2
    )
    built = load_config(model_args.preset)
    assert count_parameters(built) == saved["model"]["parameters"]
    kwargs = args.lr_scheduler_kwargs
    tokens = {"seen": 0.0}
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=args.learning_rate)
    assert args.pretrain_schedule == saved["schedule"]["type"]  # PretrainingArguments takes it as its own
    schedule = build_schedule(args.pretrain_schedule, optimizer, args.max_steps, 0, kwargs, lambda: tokens["seen"])
    for seen, factor in ((0, 0.0), (kwargs["warmup_tokens"], 1.0), (kwargs["total_tokens"], kwargs["floor"])):
        tokens["seen"] = seen
        optimizer.step()
        schedule.step()
        assert optimizer.param_groups[0]["lr"] == pytest.approx(args.learning_rate * factor, abs=1e-9)


@pytest.mark.parametrize(
    "flags",
    [
        ["--gpus", "8", "--nodes", "128", "--hours", "720"],
        ["--gpus", "8", "--hours", "24", "--data-tokens", "1B"],
        ["--gpus", "8", "--params", "7B", "--hours", "0.001"],
        ["--hours", "24", "--vocab-size", "300", "--seq-len", "512"],
    ],
    ids=["checkpointing", "little-data", "four-steps", "small-vocabulary"],
)
def test_every_plan_written_passes_the_examples_argument_check(flags, tmp_path, capsys):
    out, data = tmp_path / "plan", tmp_path / "corpus.jsonl"
    data.write_text('{"text": "a document"}\n')
    assert cli(["plan", "--device", "h100", *flags, "--out", str(out), "--dataset-path", str(data)]) == 0
    saved = json.loads((out / "plan.json").read_text())
    example = load_example()
    model_args, data_args, args = example.parse_args(shlex.split(saved["command"].split("examples/pretrain.py ")[1]))
    example.resolve_dtype(model_args, args)
    example.check_arguments(model_args, data_args)  # what the example refuses before any data work
    assert load_config(model_args.preset).vocab_size == data_args.vocab_size
    one_step = saved["batch"]["global_tokens"]
    assert args.lr_scheduler_kwargs["warmup_tokens"] >= one_step  # never a warmup of 0.0 steps


@pytest.mark.slow
def test_the_planned_launch_trains(tmp_path):
    """The plan's own command, on this CPU with one process: the example reads the planned model and schedule."""
    out = tmp_path / "plan"
    plan = make_plan(PlanRequest("h100", params=4e6, tokens=20e6, vocab_size=4096, seq_len=128))
    write_plan(plan, out)
    argv = launch_command(plan, str(out), "unused", str(tmp_path / "run"))
    argv = argv[argv.index("examples/pretrain.py") + 1 :]
    drop = argv.index("--dataset_path")
    del argv[drop : drop + 2]  # the embedded corpus
    fast = ["--max_steps", "4", "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "4",
            "--gradient_accumulation_steps", "1", "--precision", "fp32", "--save_strategy", "no"]  # fmt: skip
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "examples/pretrain.py"]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(
        [*cmd, *argv, *fast, "--data_cache_dir", str(tmp_path / "data")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    summary = json.loads((tmp_path / "run" / "pretrain_summary.json").read_text())
    assert summary["tokens_seen"] > 0 and math.isfinite(summary["train_loss"])
    saved = load_config(str(tmp_path / "run"))
    assert (saved.num_hidden_layers, saved.hidden_size) == (plan.config.num_hidden_layers, plan.config.hidden_size)


# Sequence parallelism: 8B is the family's 42 x 4096 with 32 heads / 8 KV.
def _sp_plan(seq_len: int, **kwargs):
    return make_plan(PlanRequest("h100", gpus=8, params=8e9, tokens=160e9, seq_len=seq_len, **kwargs))


def test_sequence_parallel_only_when_the_sequence_fits_no_data_sharding():
    plan = _sp_plan(131072)
    usable = plan.usable_bytes
    alone = estimate_memory(plan.config, 3, 8, "bf16", 131072, 1, checkpointing=True, device_memory_gb=80.0)
    assert alone.total > usable  # ZeRO-3 + checkpointing alone does not hold the sequence
    assert plan.sp == 2 and plan.strategy.name == "zero3" and plan.memory.sp == 2
    assert plan.memory.total <= usable and plan.data_parallel == 4
    assert plan.global_batch_tokens == 4 * plan.micro_batch * plan.grad_accum * 131072  # rows per SP group
    assert "Ulysses SP 2" in plan.sp_reason and "8 GPUs per node" in plan.sp_reason
    assert plan.checkpointing and not any("not in the predicted tokens/s" in w for w in plan.warnings)
    assert _sp_plan(4096).sp == 1  # fits with data sharding, without checkpointing: no SP


def test_the_all_to_all_is_priced_in_the_step_time():
    """8B at 128K, SP 2 with checkpointing: per layer and pass (3 with the recompute) each GPU sends half of its
    shard's q, k, v and output (2 x 4096 + 2 x 1024 bf16 values a token) over 450 GB/s x 0.8."""
    plan = _sp_plan(131072)
    shard_tokens = 65536 * plan.micro_batch * plan.grad_accum
    sent = 2 * (2 * 4096 + 2 * 1024) / 2 * 3 * 42 * shard_tokens
    assert plan.collective == "all-to-all" and plan.collective_bytes == pytest.approx(sent)
    assert plan.collective_seconds == pytest.approx(sent / (450e9 * LINK_EFFICIENCY))
    compute = plan.global_batch_tokens * plan.flops_per_token * CHECKPOINTING_COST / plan.hardware.sustained_flops
    assert plan.step_seconds == pytest.approx(compute + plan.collective_seconds)  # in the step, not beside it
    slow = _sp_plan(131072, link_gbps=45.0)  # a tenth of the link: ten times the all-to-all
    assert slow.collective_seconds == pytest.approx(10 * plan.collective_seconds * slow.grad_accum / plan.grad_accum)


def test_sequence_parallel_replaces_the_recompute_where_its_all_to_all_costs_less():
    """7B at 32K on 8 x H100: ZeRO-2 holds it only with checkpointing (+1/3 FLOPs); SP without it costs ~2 %."""
    request = dict(gpus=8, params=7e9, tokens=140e9, seq_len=32768)
    plan = make_plan(PlanRequest("h100", **request))
    assert plan.sp > 1 and not plan.checkpointing and plan.strategy.name == "zero3"
    assert estimate_memory(plan.config, 2, 8, "bf16", 32768, 1).total > plan.usable_bytes  # ZeRO-2 needs the recompute
    assert plan.memory.total <= plan.usable_bytes and 1 < plan.cost < CHECKPOINTING_COST
    assert f"Ulysses SP {plan.sp} (ZeRO-3) without activation checkpointing" in plan.sp_reason
    fpt = flops_per_token(plan.config, 32768)
    assert plan.tokens_per_second == pytest.approx(plan.hardware.sustained_flops / (fpt * plan.cost))
    slow = make_plan(PlanRequest("h100", **request, link_gbps=1.0))  # the all-to-all would cost more than 1/3
    assert slow.sp == 1 and slow.checkpointing and "would hold it without, but its all-to-all costs" in slow.sp_reason
    unknown = make_plan(PlanRequest("mi300x", **request, mfu=0.4, device_memory_gb=79.6))  # no link figure
    assert unknown.sp == 1 and unknown.checkpointing and "its all-to-all is not priced" in unknown.sp_reason
    nodes = make_plan(PlanRequest("h100", **{**request, "gpus": 4}, nodes=2))
    assert nodes.sp == 1 and nodes.checkpointing and "not weighed over 2 nodes" in nodes.sp_reason
    windows = make_plan(PlanRequest("h100", **request, window_pattern="SSSL", sliding_window=4096))
    assert windows.sp == 1 and windows.checkpointing and "not weighed for windows" in windows.sp_reason


def test_sequence_parallel_refuses_what_sp_refuses():
    from hf_pretrain.plan.planner import sp_blocker

    masks = r"GiB per GPU \([0-9,.]+ of them the windowed layers' dense masks on SDPA\)"
    autotp = r"nor does DeepSpeed AutoTP with ZeRO-1 \(tensor parallelism 2 / 4 / 8 over a node's GPUs\): at best"
    with pytest.raises(PlanRefused, match=f"{masks}.*{autotp}"):
        _sp_plan(131072, window_pattern="SSSL", sliding_window=4096)  # windows run under SP, on s x s masks
    with pytest.raises(PlanRefused, match="runs inside DeepSpeed ZeRO-3: use --sharding deepspeed"):
        _sp_plan(131072, sharding="fsdp2")
    odd = PretrainConfig(  # the family's old 7B: 30 heads / 15 KV admit no SP degree of 8 GPUs
        vocab_size=65536, hidden_size=3840, intermediate_size=10240, num_hidden_layers=40, num_attention_heads=30,
        num_key_value_heads=15, head_dim=128, max_position_embeddings=131072,
    )  # fmt: skip
    request = PlanRequest("h100", gpus=8, params=7e9, tokens=140e9, seq_len=131072)
    with pytest.raises(PlanRefused, match="the 30 heads and the sequence, and the 15 key/value heads"):
        fit_sequence_parallel(odd, request, resolve_hardware(request), 60 * GiB)
    assert sp_blocker(get_preset("tiny-moe"), "deepspeed") is None  # the router's losses summed over the SP group
    assert sp_blocker(get_preset("tiny"), "fsdp2") is not None


def test_the_sp_launch_carries_sp_and_the_example_accepts_it(tmp_path):
    from accelerate.commands.config.config_args import load_config_from_file

    out, data = tmp_path / "plan", tmp_path / "corpus.jsonl"
    data.write_text('{"text": "a document"}\n')
    write_plan(_sp_plan(131072), out, dataset=str(data))
    accel = load_config_from_file(str(out / "accelerate_config.yaml"))
    assert accel.distributed_type.value == "DEEPSPEED" and accel.num_processes == 8
    assert accel.deepspeed_config["deepspeed_config_file"] == "ds_configs/zero3.json"
    assert accel.parallelism_config["parallelism_config_sp_size"] == 2
    assert accel.parallelism_config["parallelism_config_sp_backend"] == "deepspeed"
    saved = json.loads((out / "plan.json").read_text())
    assert saved["parallelism"]["sp_size"] == 2 and saved["parallelism"]["collective_priced"] is True
    example = load_example()
    model_args, data_args, args = example.parse_args(shlex.split(saved["command"].split("examples/pretrain.py ")[1]))
    example.check_arguments(model_args, data_args)
    assert data_args.separate_documents is False and model_args.attention_backend == "sdpa"


def test_estimate_memory_takes_sp(capsys):
    argv = ["estimate-memory", "--preset", "llama2-7b", "--zero", "3", "--gpus", "8", "--seq", "32768", "--json"]
    cli(argv)
    alone = json.loads(capsys.readouterr().out)
    cli([*argv, "--sp", "2"])
    halved = json.loads(capsys.readouterr().out)
    assert halved["sp"] == 2 and halved["activations"] < 0.51 * alone["activations"]
    assert halved["parameters"] == alone["parameters"]  # ZeRO-3 shards the states over all 8 GPUs either way
    with pytest.raises(SystemExit):
        cli([*argv, "--sp", "3"])
    assert "--sp 3 must divide --gpus 8" in capsys.readouterr().err


# Tensor parallelism (DeepSpeed AutoTP + ZeRO-1). 6B is the family's 41 x 3584, 28 heads / 4 KV; with SSSL windows at
# 128K neither ZeRO-3 + checkpointing (70.9 GiB) nor SP (the windows' dense masks on SDPA) holds a step in 67.7 GiB.
def _tp_plan(seq_len: int = 131072, device: str = "h100", **kwargs):
    windows = dict(window_pattern="SSSL", sliding_window=4096)
    return make_plan(PlanRequest(device, gpus=8, params=6e9, tokens=120e9, seq_len=seq_len, **{**windows, **kwargs}))


def test_tensor_parallel_only_where_data_sharding_and_sp_hold_nothing():
    from hf_pretrain.plan.planner import splits_heads

    plan = _tp_plan()
    c, usable = plan.config, plan.usable_bytes
    assert (c.num_hidden_layers, c.hidden_size, c.num_attention_heads, c.num_key_value_heads) == (41, 3584, 28, 4)
    alone = estimate_memory(c, 3, 8, "bf16", 131072, 1, checkpointing=True, device_memory_gb=79.6)
    assert alone.total > usable  # ZeRO-3 + checkpointing alone does not hold it
    assert plan.tp == 4 and plan.sp == 1 and plan.strategy.name == "zero1_tp" and plan.strategy.zero == 1
    assert plan.memory.total <= usable and plan.checkpointing and plan.data_parallel == 2
    assert plan.memory.total == estimate_memory(c, 1, 8, "bf16", 131072, 1, checkpointing=True, device_memory_gb=79.6,
                                                tp=4).total  # fmt: skip
    assert plan.global_batch_tokens == 2 * plan.micro_batch * plan.grad_accum * 131072  # rows per TP group
    # TP 8 holds it too, but splits the 28 heads unevenly: the even split comes first
    tp8 = estimate_memory(c, 1, 8, "bf16", 131072, 1, checkpointing=True, device_memory_gb=79.6, tp=8)
    assert tp8.total <= usable and not splits_heads(c, 8) and splits_heads(c, 4)
    assert "AutoTP 4 with ZeRO-1" in plan.tp_reason and "dense masks on SDPA" in plan.tp_reason
    assert _tp_plan(65536).tp == 1  # data sharding holds it (with checkpointing): no TP
    assert _sp_plan(131072).tp == 1  # SP holds it: no TP
    with pytest.raises(PlanRefused, match="DeepSpeed AutoTP cannot take it: AutoTP runs inside DeepSpeed"):
        _tp_plan(sharding="fsdp2")


def test_the_all_reduce_is_priced_in_the_step_time():
    """6B at 128K, AutoTP 4 with checkpointing: per layer and pass (3 with the recompute) two all-reduces of the
    micro-batch's hidden states (3584 bf16 values a token), a ring sending 2 x 3/4 of each, over 450 GB/s x 0.8; and
    the untied LM head (6 x 3584 x 65536 FLOPs a token) computed by each of the 4 TP ranks."""
    plan = _tp_plan()
    tokens = plan.micro_batch * plan.grad_accum * 131072  # the micro-batches of a TP group, every rank of it
    sent = 2 * 3584 * 2 * 3 * 41 * 2 * 3 / 4 * tokens
    assert plan.collective == "all-reduce" and plan.collective_bytes == pytest.approx(sent)
    assert plan.collective_seconds == pytest.approx(sent / (450e9 * LINK_EFFICIENCY))
    head = 3 * 6 * 3584 * 65536 / plan.flops_per_token
    compute = (
        plan.global_batch_tokens * plan.flops_per_token * (CHECKPOINTING_COST + head) / plan.hardware.sustained_flops
    )
    assert plan.step_seconds == pytest.approx(compute + plan.collective_seconds)  # in the step, not beside it
    unknown = _tp_plan(device="mi300x", mfu=0.4, device_memory_gb=79.6)  # no link figure
    assert unknown.tp > 1 and unknown.collective_seconds is None
    assert any("AutoTP's all-reduce" in w and "not in the predicted tokens/s" in w for w in unknown.warnings)


def test_the_tp_launch_carries_its_own_deepspeed_json_and_the_example_accepts_it(tmp_path):
    from accelerate.commands.config.config_args import load_config_from_file

    out, data = tmp_path / "plan", tmp_path / "corpus.jsonl"
    data.write_text('{"text": "a document"}\n')
    preset = (ROOT / "ds_configs" / "zero1_autotp.json").read_text()
    files = write_plan(_tp_plan(), out, dataset=str(data))
    accel = load_config_from_file(str(out / "accelerate_config.yaml"))
    assert accel.distributed_type.value == "DEEPSPEED" and accel.num_processes == 8
    assert accel.deepspeed_config["deepspeed_config_file"] == f"{out}/deepspeed_autotp.json" == str(files["deepspeed"])
    assert accel.deepspeed_config["zero3_init_flag"] is False and not accel.parallelism_config
    ds = json.loads(files["deepspeed"].read_text())
    assert ds["tensor_parallel"] == {"autotp_size": 4} and ds["zero_optimization"]["stage"] == 1
    assert (ROOT / "ds_configs" / "zero1_autotp.json").read_text() == preset  # the preset stays as shipped
    saved = json.loads((out / "plan.json").read_text())["parallelism"]
    assert saved["tp_size"] == 4 and saved["collective"] == "all-reduce" and saved["collective_priced"] is True
    assert saved["inter_node_network"] == "one node: nothing crosses the network"
    example = load_example()
    command = json.loads((out / "plan.json").read_text())["command"]
    model_args, data_args, args = example.parse_args(shlex.split(command.split("examples/pretrain.py ")[1]))
    example.check_arguments(model_args, data_args)
    assert args.gradient_checkpointing


# Across nodes: --network-gbps, GB/s each way per GPU between nodes (plan/network.py). 70B is the family's 99 x 8192
# (64 heads / 8 KV); at 8K on 8 nodes of 8 H100s ZeRO-3 holds it with checkpointing, micro-batch 2 x 17.
def _70b(network_gbps=None):
    return make_plan(PlanRequest("h100", gpus=8, nodes=8, params=70e9, tokens=1.4e12, seq_len=8192,
                                 network_gbps=network_gbps))  # fmt: skip


def test_the_data_parallel_traffic_across_nodes_by_hand():
    """7B (36 x 4096, 6.917B parameters), bf16, 16 ranks (2 nodes x 8). ZeRO-3: per micro-step each GPU gathers the
    2-byte weights twice (forward, backward) and reduce-scatters the 2-byte gradients once, a ring sending 15/16 of
    each: 3 x 2 x 6.917e9 x 15/16 = 38.9 GB, 0.973 s at 50 GB/s x 0.8. ZeRO-2: the reduce-scatter per micro-step,
    the gather per optimizer step (13.0 GB each). DDP: an all-reduce per step, 2 x 13.0 GB. ZeRO-1 + AutoTP 8: per
    step a reduce-scatter and a gather of a rank's 1/8 of the linears + the whole embedding and head, over the 2
    data-parallel ranks: (2 + 2) x tp_parameters x 1/2."""
    from hf_pretrain.distributed.memory import tp_parameters
    from hf_pretrain.plan.network import data_parallel_traffic

    config = shape_for_parameters(7e9, vocab_size=65536, seq_len=4096)
    params = count_parameters(config)
    assert params == pytest.approx(6.917e9, rel=1e-3)
    zero3 = data_parallel_traffic(config, "zero3", "bf16", 16)
    assert zero3.micro_step == pytest.approx(3 * 2 * params * 15 / 16) == pytest.approx(38.9e9, rel=1e-3)
    assert zero3.step == 0 and zero3.ranks == 16
    assert zero3.micro_step / (50e9 * LINK_EFFICIENCY) == pytest.approx(0.973, rel=1e-3)
    zero2 = data_parallel_traffic(config, "zero2", "bf16", 16)
    assert zero2.micro_step == zero2.step == pytest.approx(2 * params * 15 / 16)
    ddp = data_parallel_traffic(config, "ddp", "bf16", 16)
    assert (ddp.micro_step, ddp.step) == (0, pytest.approx(2 * 2 * params * 15 / 16))
    tp = data_parallel_traffic(config, "zero1_tp", "bf16", 16, tp=8)
    assert tp.ranks == 2 and tp.micro_step == 0 and tp.step == pytest.approx(4 * tp_parameters(config, 8) / 2)
    assert tp_parameters(config, 8) < params / 4  # AutoTP shards what crosses the network
    assert data_parallel_traffic(config, "fsdp2", "bf16", 16) == zero3  # priced as ZeRO-3, as for memory
    # A micro-step's traffic hides behind its compute; what exceeds it, and the per-step traffic, are added.
    rate = 50e9 * LINK_EFFICIENCY
    assert zero3.exposed_seconds(rate, micro_compute_s=1.0, accumulation=4) == 0.0
    assert zero3.exposed_seconds(rate, micro_compute_s=0.5, accumulation=4) == pytest.approx(
        4 * (0.973 - 0.5), rel=2e-3
    )
    assert zero2.exposed_seconds(rate, micro_compute_s=1.0, accumulation=4) == pytest.approx(zero2.step / rate)


def test_without_the_network_multi_node_plans_as_before_and_says_it_is_unavailable(tmp_path):
    from hf_pretrain.plan import table

    plan = _70b()
    assert plan.strategy.name == "zero3" and plan.checkpointing and plan.tp == plan.sp == 1
    assert plan.network_share is None and plan.network_seconds is None and plan.network_reason is None
    fpt = flops_per_token(plan.config, 8192)
    assert plan.tokens_per_second == pytest.approx(plan.hardware.sustained_flops / (fpt * CHECKPOINTING_COST))
    printed = table(plan)
    assert "network unavailable between nodes (not given: pass --network-gbps" in printed
    assert "multi-node communication is not weighed" in printed and "unavailable (not zero)" in printed
    assert "pass --network-gbps to weigh them" in plan.sp_reason
    write_plan(plan, tmp_path / "plan")
    saved = json.loads((tmp_path / "plan" / "plan.json").read_text())["parallelism"]
    assert saved["inter_node_network"].startswith("unavailable, not priced")
    assert saved["network_gbps_each_way_per_gpu"] is None and saved["network_seconds_per_step"] is None


def test_one_node_is_unchanged_by_the_network():
    request = dict(gpus=8, params=7e9, tokens=140e9, seq_len=32768)
    before, after = (
        make_plan(PlanRequest("h100", **request)),
        make_plan(PlanRequest("h100", **request, network_gbps=50)),
    )
    assert (after.sp, after.tp, after.checkpointing, after.micro_batch, after.grad_accum, after.steps) == (
        before.sp, before.tp, before.checkpointing, before.micro_batch, before.grad_accum, before.steps)  # fmt: skip
    assert after.tokens_per_second == before.tokens_per_second and after.network_seconds == 0.0
    assert after.network_reason is None and not any("multi-node" in w for w in after.warnings)


def test_the_network_is_priced_in_the_step_time_across_nodes():
    """At 12.5 GB/s ZeRO-3's 3 x 2 x 69.6e9 x 63/64 bytes a micro-step take 41 s at 10 GB/s, against the micro-step's
    25 s of compute (2 x 8192 tokens, the recompute included): the difference, 17 times a step, is exposed."""
    from hf_pretrain.plan.planner import network_share

    plan = _70b(50)
    traffic, rate, fpt = plan.network_traffic, 50e9 * LINK_EFFICIENCY, plan.flops_per_token
    micro_compute = 2 * 8192 * fpt * CHECKPOINTING_COST / (plan.hardware.sustained_flops / 64)
    assert traffic.micro_step == pytest.approx(3 * 2 * plan.parameters * 63 / 64)
    assert traffic.micro_step / rate < micro_compute and plan.network_seconds == 0.0  # hidden: as without the flag
    assert plan.tokens_per_second == _70b().tokens_per_second
    slow = (plan.config, 8192, resolve_hardware(PlanRequest("h100", gpus=8, nodes=8, tokens=1, network_gbps=12.5)))
    share = network_share(*slow, plan.fit, 1, 1, plan.micro_batch, plan.grad_accum)
    exposed = 17 * (traffic.micro_step / 10e9 - micro_compute)
    assert share * plan.global_batch_tokens * fpt / plan.hardware.sustained_flops == pytest.approx(exposed)


def test_autotp_inside_the_node_wins_over_zero3_across_nodes_when_the_network_gets_slow(tmp_path):
    from hf_pretrain.plan import table

    fast, slow = _70b(50), _70b(12.5)
    assert fast.strategy.name == "zero3" and fast.tp == 1 and fast.checkpointing
    assert fast.network_reason.startswith("weighed across 8 nodes at 50 GB/s each way per GPU (--network-gbps")
    assert "DeepSpeed ZeRO-3, checkpointing on: 41.8k tokens/s" in fast.network_reason
    assert "the highest; against" in fast.network_reason and "AutoTP 8 (DeepSpeed ZeRO-1)" in fast.network_reason
    assert slow.strategy.name == "zero1_tp" and slow.tp == 8 and slow.data_parallel == 8
    assert slow.memory.total <= slow.usable_bytes and "AutoTP 8 with ZeRO-1" in slow.tp_reason
    assert slow.network_reason.split(", the highest")[0].endswith("per GPU over 8 ranks 31.4 GiB a step after the "
                                                                 "backward, 3.37 s)")  # fmt: skip
    # ZeRO-3 at 12.5 GB/s, by hand: every micro-step waits for its gathers (41 s against 25 s of compute)
    traffic, fpt = fast.network_traffic, fast.flops_per_token
    micro_compute = 2 * 8192 * fpt * CHECKPOINTING_COST / (fast.hardware.sustained_flops / 64)
    zero3 = fast.tokens_per_second * micro_compute / (traffic.micro_step / 10e9)
    assert slow.tokens_per_second > zero3 and f"ZeRO-3, checkpointing on: {zero3 / 1e3:,.1f}k" in slow.network_reason
    assert slow.tokens_per_second < fast.tokens_per_second  # the slow network still costs
    printed = table(slow)
    assert (
        "DeepSpeed ZeRO-1 across nodes, per GPU over 8 ranks 31.4 GiB a step after the backward, 3.37 s; +3.37 s a step"
        in printed
    )
    write_plan(slow, tmp_path / "plan")
    saved = json.loads((tmp_path / "plan" / "plan.json").read_text())["parallelism"]
    assert saved["tp_size"] == 8 and saved["inter_node_network"].startswith("priced")
    assert saved["network_bytes_per_gpu_step"] == pytest.approx(slow.network_traffic.step)


def test_without_a_link_figure_autotp_and_sp_are_not_weighed_across_nodes():
    """MI300X has no link figure: AutoTP's all-reduce would weigh nothing and win over the slow network unfairly."""
    request = dict(gpus=8, nodes=8, params=70e9, tokens=1.4e12, seq_len=8192, mfu=0.4, network_gbps=12.5)
    plan = make_plan(PlanRequest("mi300x", **request, device_memory_gb=79.6))
    assert plan.tp == plan.sp == 1 and plan.network_seconds > 0
    assert plan.network_reason.startswith("priced across 8 nodes")
    assert "AutoTP and Ulysses SP inside a node not weighed: their collectives are not priced" in plan.network_reason
    assert make_plan(PlanRequest("mi300x", **request, device_memory_gb=79.6, link_gbps=450)).tp == 8  # priced: weighed


@pytest.mark.parametrize("value", ["abc", "0", "-50", "inf", "nan"])
def test_a_bad_network_figure_is_one_line_naming_the_flag(value, capsys, tmp_path):
    argv = ["plan", "--device", "h100", "--gpus", "8", "--nodes", "2", "--hours", "24", "--out", str(tmp_path)]
    assert cli([*argv, "--network-gbps", value]) == 2
    error = capsys.readouterr().err
    assert error.startswith("error: ") and error.count("\n") == 1 and "--network-gbps" in error
    assert not (tmp_path / "plan.json").exists()
