"""The declared protocol between PretrainTrainer and its callbacks (hf_pretrain/callback.py)."""

import dataclasses
from pathlib import Path

from transformers import TrainingArguments

from hf_pretrain import PretrainForCausalLM, PretrainingArguments, PretrainTrainer
from hf_pretrain.callback import PretrainCallback
from hf_pretrain.presets import get_preset
from hf_pretrain.telemetry.straggler import StragglerCallback
from hf_pretrain.training.loss_guard import LossGuardCallback
from hf_pretrain.training.wiring import RUN_CALLBACKS, callbacks_from_arguments

PACKAGE = Path(__file__).resolve().parents[2] / "hf_pretrain"
OWNERS = (LossGuardCallback, *RUN_CALLBACKS)


def test_each_default_has_one_home_its_callback():
    fields = {f.name: f.default for f in dataclasses.fields(PretrainingArguments)}
    seen: dict[str, type] = {}
    for owner in OWNERS:
        for name, default in owner.arguments.items():
            assert name not in seen, f"{name} is declared by {seen.get(name)} and {owner}"
            seen[name] = owner
            assert fields[name] == default, f"PretrainingArguments.{name} restates {owner.__name__}'s default"
    assert {"loss_spike_factor", "straggler_every", "underclock_threshold", "probe_every", "telemetry"} <= set(seen)


def test_plain_training_arguments_get_the_owners_defaults(tmp_path):
    model = PretrainForCausalLM(get_preset("tiny", vocab_size=64, num_hidden_layers=1))
    trainer = PretrainTrainer(model=model, args=TrainingArguments(str(tmp_path), report_to="none"))
    built = callbacks_from_arguments(trainer)
    straggler = next(c for c in built if isinstance(c, StragglerCallback))
    defaults = StragglerCallback.arguments
    assert (straggler.every, straggler.threshold) == (defaults["straggler_every"], defaults["straggler_threshold"])
    assert trainer.loss_guard.spike_factor == LossGuardCallback.arguments["loss_spike_factor"]
    assert all(isinstance(c, PretrainCallback) for c in built)
    assert [c for c in built if c.times_micro_batches] == [straggler]


def test_arguments_turn_callbacks_off(tmp_path):
    model = PretrainForCausalLM(get_preset("tiny", vocab_size=64, num_hidden_layers=1))
    args = PretrainingArguments(str(tmp_path), report_to="none", telemetry=False, loss_guard=False)
    trainer = PretrainTrainer(model=model, args=args)
    assert trainer.loss_guard is None
    assert [type(c).__name__ for c in callbacks_from_arguments(trainer)] == ["ThroughputCallback"]


def test_no_test_knob_is_read_by_the_library():
    readers = [p for p in PACKAGE.rglob("*.py") if "HF_PRETRAIN_TEST_" in p.read_text()]
    assert readers == [], f"test-only switches belong in tests/ (fixtures, subclasses): {readers}"
