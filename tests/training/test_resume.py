"""Exact, fast resume and atomic checkpoints (real runs, real checkpoints, a real kill)."""

import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import RandomSampler
from transformers import TrainerCallback
from transformers.trainer_utils import get_last_checkpoint

from hf_pretrain import PretrainForCausalLM, PretrainTrainer
from hf_pretrain.training.resume.sampler import ResumableSampler
from hf_pretrain.training.resume.store import RUN_STATE_NAME
from tests.conftest import quick_args, small_config
from tests.training.faults import SLOW_SAVE_STARTED
from tests.training.test_trainer import dataset

ROOT = Path(__file__).resolve().parents[2]


class Record(TrainerCallback):
    """Per-step loss and learning rate; optionally stops the run at a step (a pre-emption)."""

    def __init__(self, stop_at=None):
        self.losses, self.lrs, self.stop_at = {}, {}, stop_at

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses[state.global_step], self.lrs[state.global_step] = logs["loss"], logs["learning_rate"]

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.stop_at:
            control.should_training_stop = True


def train(output_dir, resume=None, stop_at=None, **overrides):
    torch.manual_seed(0)
    settings = dict(
        max_steps=20,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,  # 8 rows a step: 8 steps an epoch, so step 10 is inside epoch 1
        learning_rate=3e-3,
        save_strategy="steps",
        save_steps=5,
        measure_peak_tflops=False,
        seed=3,
    )
    args = quick_args(output_dir, **{**settings, **overrides})
    record = Record(stop_at)
    trainer = PretrainTrainer(model=PretrainForCausalLM(small_config()), args=args, train_dataset=dataset())
    trainer.add_callback(record)
    trainer.train(resume_from_checkpoint=resume)
    return trainer, record


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    return train(tmp_path_factory.mktemp("straight"))[1]


def test_ten_plus_ten_equals_twenty_straight(tmp_path, straight, monkeypatch):
    _, first = train(tmp_path, stop_at=10)
    assert sorted(first.losses) == list(range(1, 11))
    drawn = draws(monkeypatch, ResumableSampler)
    _, second = train(tmp_path, resume=True)  # a new process would do the same: new model, new trainer
    # fast: the sampler starts at the saved position (epoch 1, 16 samples in), nothing consumed is drawn again
    assert drawn[:48] == ResumableSampler(64, seed=3).order(1)[16:].tolist()
    assert 0 <= len(drawn) - 10 * 8 <= 8  # beyond the 80 samples trained: at most the loader's read-ahead
    assert sorted(second.losses) == list(range(11, 21))
    resumed = {**first.losses, **second.losses}
    assert resumed == straight.losses  # identical floats, across two epoch boundaries
    assert {**first.lrs, **second.lrs} == straight.lrs
    state = json.loads((tmp_path / "checkpoint-10" / RUN_STATE_NAME).read_text())
    assert state["data"]["epoch"] == 1 and state["data"]["samples_consumed_in_epoch"] == 16


@pytest.mark.exhaustive
def test_muon_resumes_exactly(tmp_path):
    """Muon's momentum and AdamW's moments come back from optimizer.pt: 10 + 10 steps equal 20 straight."""
    straight = train(tmp_path / "straight", optim="muon")[1]
    first = train(tmp_path / "run", stop_at=10, optim="muon")[1]
    second = train(tmp_path / "run", resume=True, optim="muon")[1]
    assert sorted(second.losses) == list(range(11, 21))
    assert {**first.losses, **second.losses} == straight.losses


def test_order_is_the_one_transformers_uses(tmp_path, straight):
    recipe = dict(lr_scheduler_type="cosine_restarts", warmup_steps=0.008, weight_decay=0.1, adam_beta2=0.95)
    _, plain = train(tmp_path, pretrain_extras=False, **recipe)
    assert plain.losses == straight.losses  # same sampler order as accelerate's seeded RandomSampler


def draws(monkeypatch, sampler_class):
    drawn = []
    iterate = sampler_class.__iter__

    def counting(self):
        for index in iterate(self):
            drawn.append(index)
            yield index

    monkeypatch.setattr(sampler_class, "__iter__", counting)
    return drawn


@pytest.mark.exhaustive
def test_resume_draws_only_the_samples_it_trains_on(tmp_path, straight, monkeypatch):
    train(tmp_path, stop_at=20)
    extra = {}
    for step in (5, 15):  # early and late in the run: the work to get back there must not grow
        drawn = draws(monkeypatch, ResumableSampler)
        train(tmp_path / "r", resume=str(tmp_path / f"checkpoint-{step}"))
        consumed = (step % 8) * 8
        expected = ResumableSampler(64, seed=3).order(step // 8)[consumed:].tolist()
        assert drawn[: len(expected)] == expected  # starts at the position, in the saved epoch's order
        extra[step] = len(drawn) - (20 - step) * 8  # beyond the samples trained: the loader's read-ahead
        monkeypatch.undo()
    assert extra[5] == extra[15] and 0 <= extra[15] <= 8
    # transformers' own resume walks the sampler through every consumed batch of the epoch
    drawn = draws(monkeypatch, RandomSampler)
    train(tmp_path / "plain", resume=str(tmp_path / "checkpoint-15"), pretrain_extras=False)
    assert len(drawn) - (20 - 15) * 8 >= (15 % 8) * 8


def test_changed_batch_geometry_warns_with_the_fix_and_falls_back_to_batch_skipping(tmp_path, caplog):
    train(tmp_path, stop_at=2, save_steps=2)
    with caplog.at_level(logging.WARNING, logger="hf_pretrain"):
        train(tmp_path, resume=True, max_steps=3, per_device_train_batch_size=2, gradient_accumulation_steps=4)
    assert (
        "samples_per_micro_batch is 2 here but 4 in the checkpoint (for an exact resume: keep per_device_train_batch_size"
        in caplog.text
    )
    assert "Falling back to the Trainer's batch skipping" in caplog.text


def run_in_process(output_dir, max_steps, extras, resume=False, env=None):
    command = [sys.executable, "-m", "tests.training.resume_run", str(output_dir), str(max_steps), str(int(extras))]
    return subprocess.Popen(
        command + (["1"] if resume else []),
        cwd=ROOT,
        env={**os.environ, **(env or {})},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def kill_during_save(output_dir, extras) -> Path:
    """Train to step 12 saving every 5 steps; SIGKILL the process while checkpoint 10 is half written."""
    process = run_in_process(output_dir, 12, extras, env={"SLOW_SAVE": "10:60"})
    staged = output_dir / (".saving/checkpoint-10" if extras else "checkpoint-10")
    deadline = time.time() + 240
    while not (staged / SLOW_SAVE_STARTED).exists():  # the weights written; the optimizer state not
        assert process.poll() is None and time.time() < deadline, "the run ended before its second save"
        time.sleep(0.05)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert not (staged / "optimizer.pt").exists()
    return staged


@pytest.mark.exhaustive
def test_a_save_killed_midway_leaves_the_previous_checkpoint(tmp_path):
    plain = tmp_path / "plain"
    kill_during_save(plain, extras=False)
    assert get_last_checkpoint(str(plain)).endswith("checkpoint-10")  # transformers would resume a torn checkpoint

    out = tmp_path / "ours"
    kill_during_save(out, extras=True)
    assert get_last_checkpoint(str(out)).endswith("checkpoint-5")  # ours: the torn one never got the name
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-5"]
    assert (out / "checkpoint-5" / "optimizer.pt").exists() and (out / "checkpoint-5" / RUN_STATE_NAME).exists()

    assert run_in_process(out, 12, True, resume=True).wait() == 0
    assert not (out / ".saving").exists()  # the leftover of the killed save is cleared at start
    resumed = json.loads((out / "losses-0.json").read_text())
    assert sorted(map(int, resumed)) == list(range(6, 13))
    straight = tmp_path / "straight"
    assert run_in_process(straight, 12, True).wait() == 0
    reference = json.loads((straight / "losses-0.json").read_text())
    assert all(resumed[k] == reference[k] for k in resumed)
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-12"]  # save_total_limit=1 after rename


@pytest.mark.parametrize("rows, batch, processes", [(44, 4, 2), (44, 6, 2), (5, 4, 2), (48, 4, 2), (50, 4, 3)])
def test_padded_sampler_completes_an_uneven_epoch_as_accelerate_does_and_keeps_it_when_positioned(
    rows, batch, processes
):
    from accelerate.data_loader import BatchSamplerShard
    from torch.utils.data import BatchSampler

    def shards(sampler, rank):
        return list(BatchSamplerShard(BatchSampler(sampler, batch, False), processes, rank, even_batches=True))

    for rank in range(processes):
        plain, padded = (
            ResumableSampler(rows, seed=1),
            ResumableSampler(rows, seed=1, pad_to_multiple_of=batch * processes),
        )
        plain.set_epoch(2), padded.set_epoch(2)
        uninterrupted = shards(plain, rank)
        assert shards(padded, rank) == uninterrupted  # accelerate finds full batches and adds nothing
        for done in range(1, len(uninterrupted)):  # resumed after `done` micro-batches of every rank
            padded.start_at(2, done * batch * processes)
            assert shards(padded, rank) == uninterrupted[done:]


@pytest.mark.parametrize(
    "world_size, saved, batch, expected, warns",
    [
        (1, 12, {"samples_per_micro_batch": 12}, 12, False),  # one process resuming two ranks' run: as they did
        (2, 12, {"samples_per_micro_batch": 12}, 12, False),  # the same geometry
        (2, 1, {"samples_per_micro_batch": 12}, 12, True),  # two ranks resuming one process: accelerate completes
        (1, None, {}, 1, False),  # a fresh run, or a checkpoint written before the key existed
        (1, 8, {"samples_per_micro_batch": 8}, 1, False),  # another global batch: the geometry warning's case
    ],
)
def test_the_epoch_end_follows_the_checkpointed_run_across_a_change_of_processes(
    world_size, saved, batch, expected, warns, caplog
):
    from types import SimpleNamespace

    from transformers.trainer_pt_utils import AcceleratorConfig

    from hf_pretrain.training.resume.data_position import DataPosition

    args = SimpleNamespace(
        world_size=world_size,
        per_device_train_batch_size=12 // world_size,
        dataloader_drop_last=False,
        accelerator_config=AcceleratorConfig(),
        data_seed=None,
        seed=0,
    )
    position = DataPosition(SimpleNamespace(args=args))
    position.saved = {} if saved is None else {"data": {"epoch_padded_to_multiple_of": saved, **batch}}
    with caplog.at_level(logging.WARNING, logger="hf_pretrain"):
        sampler = position.sampler_for(RandomSampler(range(44)))
    assert sampler.pad_to_multiple_of == expected and len(sampler) == (48 if expected == 12 else 44)
    assert ("shorter last batch at each epoch end" in caplog.text) == warns
