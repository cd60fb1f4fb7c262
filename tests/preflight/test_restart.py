import pytest
import torch

from hf_pretrain import PretrainForCausalLM, PretrainingArguments, PretrainTrainer
from hf_pretrain.cli import main as cli
from hf_pretrain.data import PackedDocumentCollator
from hf_pretrain.preflight.restart import advise_restart
from tests.conftest import small_config
from tests.training.test_trainer import dataset


def hours(advice):
    return {o.name: o.finishes_in_hours for o in advice.options}


def test_restart_pays_only_early_in_the_run():
    week = 7 * 24
    early = advise_restart(elapsed_hours=12, remaining_hours=week - 12, speedup=0.2)
    assert early.recommendation == "restart from scratch"
    assert hours(early) == pytest.approx({"continue": 156, "restart from scratch": 134.4})
    assert early.restart_pays_until_elapsed_hours == pytest.approx(0.2 * week)  # ~1.4 days of a 7-day run
    late = advise_restart(elapsed_hours=48, remaining_hours=week - 48, speedup=0.2)
    assert late.recommendation == "continue"
    with_overhead = advise_restart(elapsed_hours=30, remaining_hours=week - 30, speedup=0.2, overhead_hours=6)
    assert (
        with_overhead.recommendation == "continue"
        and with_overhead.restart_pays_until_elapsed_hours == pytest.approx(27.6)
    )


def test_resuming_on_the_faster_path_beats_both():
    advice = advise_restart(elapsed_hours=100, remaining_hours=68, speedup=0.2, hours_since_checkpoint=0.5)
    assert advice.recommendation == "resume from last checkpoint"
    assert hours(advice)["resume from last checkpoint"] == pytest.approx(68.5 * 0.8)
    assert "recommendation: resume from last checkpoint" in advice.table()


@pytest.mark.parametrize(
    "kwargs, field",
    [(dict(speedup=1.0), "speedup"), (dict(speedup=-0.1), "speedup"), (dict(elapsed_hours=-1), "elapsed_hours")],
)
def test_bad_inputs_name_the_field(kwargs, field):
    args = dict(elapsed_hours=1, remaining_hours=1, speedup=0.1) | kwargs
    with pytest.raises(ValueError, match=f"{field}="):
        advise_restart(**args)


def test_cli(capsys):
    assert cli(["advise-restart", "--elapsed-hours", "24", "--remaining-hours", "144", "--speedup", "0.2"]) == 0
    assert "recommendation: restart from scratch" in capsys.readouterr().out
    assert cli(["advise-restart", "--elapsed-hours", "1", "--remaining-hours", "1", "--speedup", "2"]) == 2
    assert "speedup=2.0 is invalid" in capsys.readouterr().err
    assert cli(["doctor", "--config", "tiny", "--seq-len", "128"]) == 0
    assert "attention preflight: cpu" in capsys.readouterr().out


def run(tmp_path, backend, steps, resume=None):
    torch.manual_seed(0)
    config = small_config(window_pattern="SL", sliding_window=8, attention_backend=backend)
    args = PretrainingArguments(
        output_dir=str(tmp_path),
        max_steps=steps,
        per_device_train_batch_size=4,
        logging_steps=1,
        report_to="none",
        save_strategy="steps",
        save_steps=3,
        seed=3,
        disable_tqdm=True,
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
