import json

import pytest
import torch

from hf_pretrain import PretrainForCausalLM
from hf_pretrain.training.loss_guard import LossSpikeError
from tests.conftest import quick_args, small_config, training_logs
from tests.training.faults import LossInjectingTrainer
from tests.training.test_trainer import dataset


def run(tmp_path, monkeypatch, inject, **extra):
    torch.manual_seed(0)
    args = quick_args(
        tmp_path,
        max_steps=12,
        per_device_train_batch_size=4,
        learning_rate=3e-3,
        measure_peak_tflops=False,
        loss_spike_window=5,
        **extra,
    )
    trainer = LossInjectingTrainer(
        model=PretrainForCausalLM(small_config()), args=args, train_dataset=dataset(), inject=inject
    )
    return trainer


def params_finite(model):
    return all(torch.isfinite(p).all() for p in model.parameters())


# the guard wraps Muon+AdamW alike; Muon's case in make test-all (tests/training/test_optimizers.py checks the
# guard's skip and scale on both of its sides in the quick suite)
OPTIMIZERS = pytest.mark.parametrize("optim", ["adamw_torch", pytest.param("muon", marks=pytest.mark.exhaustive)])


@OPTIMIZERS
def test_nan_step_is_skipped_and_training_goes_on(tmp_path, monkeypatch, optim):
    trainer = run(tmp_path, monkeypatch, "3:nan", optim=optim)
    snapshots = {}

    class Snapshot(__import__("transformers").TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            snapshots[state.global_step] = [p.detach().clone() for p in trainer.model.parameters()]

    trainer.add_callback(Snapshot())
    trainer.train()
    assert params_finite(trainer.model) and trainer.loss_guard.skipped == 1
    assert all(torch.equal(a, b) for a, b in zip(snapshots[2], snapshots[3]))  # step 3 changed nothing
    assert not all(torch.equal(a, b) for a, b in zip(snapshots[3], snapshots[4]))  # step 4 trained again
    events = [json.loads(line) for line in (tmp_path / "loss_guard.jsonl").read_text().splitlines()]
    assert events == [{"step": 3, "kind": "nonfinite", "loss": "nan", "median": None, "action": "skip"}]
    logs = [h for h in training_logs(tmp_path) if "loss_guard_skipped" in h]
    assert logs[-1]["loss_guard_skipped"] == 1 and any("nonfinite" in h.get("loss_guard_event", "") for h in logs)


def test_without_the_guard_the_same_nan_ruins_the_weights(tmp_path, monkeypatch):
    trainer = run(tmp_path, monkeypatch, "3:nan", loss_guard=False)
    trainer.train()
    assert not params_finite(trainer.model)  # what the guard prevents


@pytest.mark.parametrize("action, skipped", [("log", 0), ("skip", 1)])
def test_spikes_are_caught_against_the_running_median(tmp_path, monkeypatch, action, skipped):
    trainer = run(tmp_path, monkeypatch, "9:spike", loss_spike_action=action)
    trainer.train()
    events = [json.loads(line) for line in (tmp_path / "loss_guard.jsonl").read_text().splitlines()]
    assert [(e["step"], e["kind"], e["action"]) for e in events] == [(9, "spike", action)]
    assert events[0]["loss"] > 3 * events[0]["median"] and trainer.loss_guard.skipped == skipped


def test_stop_raises_a_typed_error(tmp_path, monkeypatch):
    trainer = run(tmp_path, monkeypatch, "9:spike", loss_spike_action="stop")
    with pytest.raises(LossSpikeError, match="at step 9"):
        trainer.train()


def lr_by_step(trainer):
    return {h["step"]: h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h}


@OPTIMIZERS
def test_rollback_resumes_from_the_newest_checkpoint_with_a_lower_learning_rate(tmp_path, monkeypatch, optim):
    reference = run(tmp_path / "ref", monkeypatch, "", save_strategy="steps", save_steps=4, optim=optim)
    reference.train()
    trainer = run(
        tmp_path, monkeypatch, "9:spike", loss_spike_action="rollback", save_strategy="steps", save_steps=4, optim=optim
    )
    trainer.train()
    assert trainer.state.global_step == 12
    events = [json.loads(line) for line in (tmp_path / "loss_guard.jsonl").read_text().splitlines()]
    assert [(e["step"], e["kind"], e["action"]) for e in events[:1]] == [(9, "spike", "rollback")]
    assert events[1] == {"step": 9, "kind": "rollback", "to": str(tmp_path / "checkpoint-8"), "lr_scale": 0.5}
    # steps 9-12 ran twice: first with the spike (skipped, run ended), then replayed at half the learning rate
    replayed = [h for h in trainer.state.log_history if h.get("step", 0) > 8 and "learning_rate" in h][-4:]
    scheduled = lr_by_step(reference)
    assert [h["step"] for h in replayed] == [9, 10, 11, 12]
    assert all(h["learning_rate"] == pytest.approx(0.5 * scheduled[h["step"]]) for h in replayed)
    logged = {h["step"]: h for h in training_logs(tmp_path)}  # per step, the replay's log comes last
    assert all(
        logged[s]["loss_guard_lr_scale"] == 0.5 and logged[s]["loss_guard_rollbacks"] == 1 for s in (9, 10, 11, 12)
    )
    if optim == "muon":  # the scale reached the Muon group too: its lr is back to the schedule's after each step
        muon_group = trainer.optimizer.param_groups[-1]
        assert muon_group["use_muon"] and muon_group["lr"] == pytest.approx(trainer.lr_scheduler.get_last_lr()[-1])
    state = json.loads((tmp_path / "checkpoint-12" / "hf_pretrain_state.json").read_text())
    assert state["loss_guard"]["lr_scale"] == 0.5  # a later resume keeps the lowered rate
    assert params_finite(trainer.model)


def test_rollback_without_a_checkpoint_or_beyond_the_limit_stops(tmp_path, monkeypatch):
    trainer = run(tmp_path / "a", monkeypatch, "9:spike", loss_spike_action="rollback")
    with pytest.raises(LossSpikeError, match="no checkpoint .* to roll back to"):
        trainer.train()
    trainer = run(
        tmp_path / "b",
        monkeypatch,
        "9:spike",
        loss_spike_action="rollback",
        loss_spike_max_rollbacks=0,
        save_strategy="steps",
        save_steps=4,
    )
    with pytest.raises(LossSpikeError, match="after 0 roll-backs"):
        trainer.train()


def guard_step(guard, norm, grad_value: float) -> bool:
    """One pre-optimizer check of `guard` on a linear whose gradients are `grad_value`, the Trainer's total norm
    `norm` handed over (None: none); whether it skipped the update."""
    from types import SimpleNamespace

    from transformers import TrainerControl, TrainerState

    guard.model = torch.nn.Linear(4, 4)
    for p in guard.model.parameters():
        p.grad = torch.full_like(p, grad_value)
    guard.record_loss(torch.tensor(1.0))
    guard.record_grad_norm(norm)
    guard.on_pre_optimizer_step(SimpleNamespace(process_index=0), TrainerState(), TrainerControl())
    skipped, guard.skip_next_update = guard.skip_next_update, False
    return skipped


def test_the_finite_check_reads_the_trainers_norm_and_computes_its_own_only_without_one(monkeypatch):
    from hf_pretrain.training.loss_guard import LossGuardCallback

    guard = LossGuardCallback()
    assert guard_step(guard, None, float("nan")) and not guard_step(guard, None, 1.0)  # no norm given: its own
    foreach = []
    monkeypatch.setattr(torch, "_foreach_norm", lambda grads: foreach.append(grads) or [torch.zeros(())])
    assert guard_step(guard, torch.tensor(float("inf")), 1.0) and guard_step(guard, float("nan"), 1.0)
    assert not guard_step(guard, torch.tensor(2.0), 1.0) and foreach == []  # the given norm decides, no 2nd pass


@pytest.mark.parametrize("max_grad_norm", [1.0, 0.0])  # clipped, and not (the Trainer still takes the norm)
def test_a_run_hands_the_guard_the_norm_it_logs(tmp_path, monkeypatch, max_grad_norm):
    trainer = run(tmp_path, monkeypatch, "3:nan", max_grad_norm=max_grad_norm)
    given = []
    record = trainer.loss_guard.record_grad_norm
    monkeypatch.setattr(trainer.loss_guard, "record_grad_norm", lambda norm: given.append(norm) or record(norm))
    trainer.train()
    logged = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    assert len(given) == len(logged) == 12 and trainer.loss_guard.skipped == 1 and params_finite(trainer.model)
    assert [float(n) for n in given] == pytest.approx(logged, nan_ok=True)
