import pytest
import torch

from hf_pretrain import PretrainForCausalLM, PretrainTrainer
from hf_pretrain.cli import main as cli
from hf_pretrain.data import PackedDocumentCollator
from tests.conftest import quick_args, small_config
from tests.training.test_trainer import dataset


def test_cli(capsys):
    args = ["advise-restart", "--elapsed-hours", "20", "--remaining-hours", "148", "--speedup", "20%"]
    assert cli(args + ["--hours-since-checkpoint", "20"]) == 0
    assert "recommendation: restart from scratch" in capsys.readouterr().out
    assert cli(args) == 0  # a checkpoint right now: resuming wins
    assert "recommendation: resume from last checkpoint" in capsys.readouterr().out
    assert cli(["advise-restart", "--elapsed-hours", "1", "--remaining-hours", "1", "--speedup", "fast"]) == 2
    assert "speedup='fast' is invalid" in capsys.readouterr().err
    assert cli(["doctor", "--config", "tiny", "--seq-len", "128"]) == 0
    assert "attention preflight: cpu" in capsys.readouterr().out
    # Planning for an H100 without FlashAttention: windows fall back, exit code 1 and a warning.
    assert cli(["doctor", "--config", "0.9b", "--seq-len", "2048", "--capability", "9.0"]) == 1
    out = capsys.readouterr().out
    assert "cuda, capability 9.0, bfloat16" in out and "WARNING:" in out
    assert cli(["doctor", "--config", "0.9b", "--capability", "9.0", "--assume-kernels", "flash_attn_interface"]) == 0
    assert "flash_attention_3" in capsys.readouterr().out
    assert cli(["doctor", "--config", "nope"]) == 2


def run(tmp_path, backend, steps, resume=None):
    torch.manual_seed(0)
    config = small_config(window_pattern="SL", sliding_window=8, attention_backend=backend)
    args = quick_args(
        tmp_path,
        max_steps=steps,
        per_device_train_batch_size=4,
        save_strategy="steps",
        save_steps=3,
        seed=3,
        learning_rate=3e-3,
    )
    trainer = PretrainTrainer(
        model=PretrainForCausalLM(config), args=args, train_dataset=dataset(), data_collator=PackedDocumentCollator(1)
    )
    trainer.train(resume_from_checkpoint=resume)
    assert {c.backend for c in trainer.model.attention_plan.values()} == {backend}
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


def test_checkpoint_from_sdpa_resumes_under_eager_with_the_same_losses(tmp_path):
    straight = run(tmp_path / "sdpa", "sdpa", 6)
    resumed = run(tmp_path / "sdpa", "eager", 6, resume=str(tmp_path / "sdpa" / "checkpoint-3"))
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6]  # 1-3 come from the checkpoint's trainer state
    for step in (4, 5, 6):
        assert resumed[step] == pytest.approx(straight[step], abs=1e-5)
