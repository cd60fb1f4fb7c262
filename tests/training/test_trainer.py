import pytest
import torch
from datasets import Dataset
from transformers import Trainer, TrainingArguments, default_data_collator

from hf_pretrain import PretrainForCausalLM, PretrainingArguments, PretrainTrainer
from tests.conftest import quick_args, small_config, training_logs


def dataset(n=64, seq=32):
    g = torch.Generator().manual_seed(1)
    starts = torch.randint(0, 128, (n, 1), generator=g)
    ids = (starts + 3 * torch.arange(seq)) % 128  # a learnable rule: each token is the previous + 3
    mask = torch.ones_like(ids)
    mask[::4, -5:] = 0  # some padding, to check that tokens seen counts only real tokens
    labels = ids.masked_fill(mask == 0, -100)
    return Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": mask.tolist(), "labels": labels.tolist()})


def run(trainer_cls, args_cls, tmp_path, **extra):
    torch.manual_seed(0)
    model = PretrainForCausalLM(small_config())
    args = args_cls(
        output_dir=str(tmp_path),
        max_steps=8,
        per_device_train_batch_size=8,
        learning_rate=3e-3,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=7,
        use_cpu=True,
        disable_tqdm=True,
        **extra,
    )
    trainer = trainer_cls(model=model, args=args, train_dataset=dataset(), data_collator=default_data_collator)
    trainer.train()
    return trainer, [h["loss"] for h in trainer.state.log_history if "loss" in h]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run(Trainer, TrainingArguments, tmp_path_factory.mktemp("ref"))[1]


def test_drop_in_with_plain_training_arguments_gives_the_same_losses(tmp_path, reference):
    trainer, losses = run(PretrainTrainer, TrainingArguments, tmp_path)
    assert len(losses) == 8 and losses == reference
    assert losses[-1] < losses[0]


def test_extras_off_is_transformers_trainer(tmp_path, reference):
    trainer, losses = run(PretrainTrainer, PretrainingArguments, tmp_path, pretrain_extras=False)
    assert losses == reference
    assert "tokens_per_second" not in trainer.state.log_history[0]


def test_extras_count_real_tokens_and_log_throughput(tmp_path):
    trainer, _ = run(PretrainTrainer, PretrainingArguments, tmp_path)
    data = dataset()
    real_tokens_per_epoch = sum(sum(m) for m in data["attention_mask"])
    # 8 steps x 8 rows = one pass over the 64 rows
    assert trainer.state.num_input_tokens_seen == real_tokens_per_epoch < 64 * 32
    logs = training_logs(tmp_path)
    assert len(logs) == 8 and all(
        h["tokens_per_second"] > 0 and h["tokens_per_second_per_rank"] == h["tokens_per_second"] for h in logs
    )


def test_pretraining_arguments_detect_cpu_and_keep_trainer_fields(tmp_path):
    args = PretrainingArguments(output_dir=str(tmp_path), learning_rate=1e-4, report_to="none")
    assert args.use_cpu is (not torch.cuda.is_available())
    assert args.include_num_input_tokens_seen == "non_padding" and args.learning_rate == 1e-4


def test_refuses_silent_single_process_training(tmp_path, monkeypatch):
    args = PretrainingArguments(output_dir=str(tmp_path), report_to="none", max_steps=1)
    assert args.world_size == 1  # the Trainer's state is set up as one process...
    monkeypatch.setenv("WORLD_SIZE", "2")  # ...while the launcher says two
    with pytest.raises(RuntimeError, match="started 2 processes but the Trainer runs with world_size=1"):
        PretrainTrainer(model=PretrainForCausalLM(small_config()), args=args, train_dataset=dataset())


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory):
    """A run that "died" after step 6 (checkpoint-4, logs of steps 1-6, a last log line cut in half), resumed
    from checkpoint-4 to step 8: the telemetry of both sessions, in one output_dir."""
    out = tmp_path_factory.mktemp("resumed")

    def train(steps, resume=None):
        torch.manual_seed(0)
        args = quick_args(out, max_steps=steps, save_strategy="steps", save_steps=4, measure_peak_tflops=False)
        PretrainTrainer(model=PretrainForCausalLM(small_config()), args=args, train_dataset=dataset()).train(
            resume_from_checkpoint=resume
        )

    train(6)
    first = {h["step"]: h for h in training_logs(out)}
    with (out / "telemetry.jsonl").open("a") as stream:
        stream.write('{"step": 7, "loss": 1.')  # the line a kill cut in half
    train(8, resume=str(out / "checkpoint-4"))
    return first, training_logs(out)


def test_throughput_after_resume_counts_only_this_session(resumed_run):
    first, logs = resumed_run
    typical = [h["tokens_per_second"] for step, h in first.items() if step > 1]
    first_after_resume = next(h for h in logs if h["step"] == 5)
    # One step's tokens over one step's time, not the 4 restored steps' tokens as well.
    assert first_after_resume["tokens_per_second"] < 3 * max(typical)
    assert first_after_resume["step_time_s"] > 0 and first_after_resume["eta_seconds"] >= 0


def test_telemetry_after_a_resume_holds_each_step_once(resumed_run):
    first, logs = resumed_run
    assert [h["step"] for h in logs] == list(range(1, 9))  # 5 and 6 replayed once, no zig-zag
    assert all(h["time"] == first[h["step"]]["time"] for h in logs[:4]) and logs[4]["time"] > first[6]["time"]


def test_mfu_is_logged_against_the_measured_ceiling_and_left_out_without_a_spec(tmp_path):
    run(PretrainTrainer, PretrainingArguments, tmp_path)
    logs = training_logs(tmp_path)
    assert 0 < logs[0].get("mfu_measured", 0.5) <= 1 and logs[0]["peak_tflops_measured"] > 0  # or withheld (below)
    assert "peak_tflops_measured" not in logs[1]  # once
    assert all("mfu_spec" not in h for h in logs)  # no spec for a CPU: unavailable, never 0.00
    run(PretrainTrainer, PretrainingArguments, tmp_path / "peak", peak_tflops=0.05)
    log = training_logs(tmp_path / "peak")[0]
    assert log["mfu_spec"] == pytest.approx(log["model_tflops_per_second_per_rank"] / 0.05)


def test_an_mfu_above_1_is_never_logged_but_flagged_as_a_measurement_problem(tmp_path, monkeypatch):
    """A peak below what the run reaches (a ceiling measured while the machine was busier, a wrong peak_tflops)."""
    import hf_pretrain.telemetry.throughput as throughput

    monkeypatch.setattr(throughput, "matmul_ceiling", lambda device, dtype: 1e-9)  # measured while busy
    run(PretrainTrainer, PretrainingArguments, tmp_path, peak_tflops=1e-9)
    logs = training_logs(tmp_path)
    assert all(h.get(k, 0) <= 1 for h in logs for k in ("mfu_spec", "mfu_measured"))
    warnings = [h[k] for h in logs for k in ("mfu_spec_warning", "mfu_measured_warning") if k in h]
    assert len(warnings) == 2 and "tokens_per_second" in logs[-1]  # said once for each peak; throughput stands
    assert (
        warnings[0].startswith("mfu_spec withheld: the run reaches ") and "pass this device's dense peak" in warnings[0]
    )
    assert (
        warnings[1].startswith("mfu_measured withheld: ") and "an MFU above 1 is a measurement problem" in warnings[1]
    )


def test_iterable_dataset_runs_as_with_trainer(tmp_path):
    data = dataset().to_iterable_dataset()
    torch.manual_seed(0)
    args = quick_args(
        tmp_path,
        max_steps=2,
        per_device_train_batch_size=4,
        measure_peak_tflops=False,
    )
    trainer = PretrainTrainer(
        model=PretrainForCausalLM(small_config()), args=args, train_dataset=data, data_collator=default_data_collator
    )
    assert trainer.train().global_step == 2


def test_defaults_follow_a_7b_recipe_and_explicit_values_win(tmp_path):
    args = PretrainingArguments(output_dir=str(tmp_path), report_to="none")
    recipe = (args.learning_rate, args.warmup_steps, args.weight_decay, args.adam_beta2, args.adam_epsilon)
    assert recipe == (3e-4, 0.008, 0.1, 0.95, 1e-8) and args.max_grad_norm == 1.0
    assert args.pretrain_schedule == "cosine_restarts"  # cosine to 10 % of the peak (the schedule's floor default)
    plain = TrainingArguments(output_dir=str(tmp_path), report_to="none")
    off = PretrainingArguments(output_dir=str(tmp_path), report_to="none", pretrain_extras=False)
    for name in ("learning_rate", "warmup_steps", "weight_decay", "adam_beta2", "lr_scheduler_type"):
        assert getattr(off, name) == getattr(plain, name), name
    mine = PretrainingArguments(output_dir=str(tmp_path), report_to="none", learning_rate=1e-3, weight_decay=0.0)
    assert (mine.learning_rate, mine.weight_decay, mine.adam_beta2) == (1e-3, 0.0, 0.95)


def deepspeed_one_process(tmp_path, steps: int, *extra: str) -> str:
    """`python -m tests.training.deepspeed_one_process`: DeepSpeed without a launcher; its standard output."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env.update(PYTHONPATH=str(root))
    command = [sys.executable, "-m", "tests.training.deepspeed_one_process", str(tmp_path), str(steps), *extra]
    result = subprocess.run(command, cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"trained to step {steps}" in result.stdout
    return result.stdout


def staged_figures(printed: str) -> tuple[int, int]:
    """(bytes the last save copied into host memory, the estimate the host-memory guard judged)."""
    line = next(line for line in printed.splitlines() if line.startswith("staged "))
    _, staged, _, estimate = line.split()
    return int(staged), int(estimate)


def assert_estimate_holds_the_copy(staged: int, estimate: int) -> None:
    """The guard's estimate is what the save copies, less the small objects (scheduler, RNG: a few KiB)."""
    assert staged > 0 and staged - 64 * 1024 <= estimate <= staged, (staged, estimate)


def test_one_deepspeed_process_without_a_launcher_trains(tmp_path):
    from hf_pretrain.training.resume.check import check_checkpoint

    printed = deepspeed_one_process(tmp_path, 3)
    assert printed.count("{'loss'") == 3
    assert check_checkpoint(tmp_path / "checkpoint-3", deepspeed=True).ok  # DeepSpeed's own state, checked as such
    # ZeRO-2: the model file, the module's weights again in DeepSpeed's model states, the fp32 master partition and
    # AdamW's two states (the estimate counted the weights and states only: 0.60x of the copy)
    assert_estimate_holds_the_copy(*staged_figures(printed))


@pytest.mark.slow
def test_a_zero3_saves_host_copy_is_what_the_memory_guard_estimated(tmp_path):
    """ZeRO-3: the 16-bit weights gathered onto rank 0 for the model file, the fp32 master partitions and the
    optimizer states (the estimate left out the master partitions: 0.75x of the copy, so the guard could admit an
    asynchronous save that ran the host out of memory)."""
    printed = deepspeed_one_process(tmp_path, 2, "--config", "ds_configs/zero3.json")
    assert_estimate_holds_the_copy(*staged_figures(printed))


@pytest.mark.exhaustive
def test_one_deepspeed_process_without_a_launcher_resumes(tmp_path):
    deepspeed_one_process(tmp_path, 3)
    assert deepspeed_one_process(tmp_path, 4, "resume").count("{'loss'") == 1  # the resume trained step 4 only
