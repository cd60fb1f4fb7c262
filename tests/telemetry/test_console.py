"""The printed training line keeps what a person reads; every metric still reaches telemetry.jsonl and the state."""

import ast

import pytest
import torch
from transformers.trainer_callback import PrinterCallback, ProgressCallback

from hf_pretrain import PretrainForCausalLM, PretrainTrainer
from hf_pretrain.telemetry.console import PRINTED
from tests.conftest import quick_args, small_config, training_logs
from tests.training.test_trainer import dataset


@pytest.mark.parametrize("disable_tqdm", [True, False], ids=["printer", "progress-bar"])
def test_the_printed_line_keeps_what_a_person_reads(tmp_path, capsys, disable_tqdm):
    torch.manual_seed(0)
    args = quick_args(tmp_path, max_steps=3, per_device_train_batch_size=8, disable_tqdm=disable_tqdm)
    trainer = PretrainTrainer(model=PretrainForCausalLM(small_config()), args=args, train_dataset=dataset())
    trainer.train()
    printed = [ast.literal_eval(line) for line in capsys.readouterr().out.splitlines() if line.startswith("{'loss'")]
    logged = training_logs(tmp_path)
    assert len(printed) == 3 and len(logged) == 3
    for shown, full in zip(printed, logged):
        assert {"loss", "learning_rate", "grad_norm", "tokens_per_second"} <= set(shown)
        assert set(shown) == {k for k in full if k in PRINTED or isinstance(full[k], str)} - {"step", "time"}
        assert "tokens_per_second_per_rank" in full and "tokens_per_second_per_rank" not in shown
    assert "sensors_unavailable" in printed[0]  # a note, printed (this CPU has no GPU sensors)
    history = [h for h in trainer.state.log_history if "loss" in h]
    assert all(set(h) - {"step"} <= set(full) and "tokens_per_second" not in h for h, full in zip(history, logged))
    console = ProgressCallback if not disable_tqdm else PrinterCallback
    assert any(type(c) is console for c in trainer.callback_handler.callbacks)  # transformers' own again
