"""Asynchronous checkpoints in real one-process runs (resume/background.py): the same files as a synchronous
save, a failed background write raised at the next step, a save that waits for the one in flight (and says so),
the last save complete before train() returns. The multi-process cases (a rank killed during a write, restarted
by the launcher) are in tests/distributed/test_multiprocess_resume.py."""

import logging
import os
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from datasets import Dataset
from torch.distributed.checkpoint.staging import DefaultStager
from transformers import TrainerCallback

from hf_pretrain import PretrainForCausalLM, get_preset
from hf_pretrain.training.resume import background
from hf_pretrain.training.resume.background import CheckpointWriteError
from tests.conftest import quick_args
from tests.training.faults import WriteFault, WriteFaultTrainer

STEPS, SAVE_STEPS = 6, 2
BACKGROUND = background.__file__


def run(out, async_checkpoint=True, write_fault=None, callbacks=(), steps=STEPS, trainer_class=None, **extra):
    torch.manual_seed(0)
    data = torch.randint(3, 500, (48, 16), generator=torch.Generator().manual_seed(1))
    args = quick_args(
        out,
        max_steps=steps,
        per_device_train_batch_size=4,
        learning_rate=3e-3,
        seed=0,
        telemetry=False,
        measure_peak_tflops=False,
        save_strategy="steps",
        save_steps=SAVE_STEPS,
        async_checkpoint=async_checkpoint,
        **extra,
    )
    model = PretrainForCausalLM(get_preset("tiny", vocab_size=512, num_hidden_layers=1))
    dataset = Dataset.from_dict({"input_ids": data.tolist(), "labels": data.tolist()})
    trainer = (trainer_class or WriteFaultTrainer)(
        model=model, args=args, train_dataset=dataset, write_fault=write_fault, callbacks=list(callbacks)
    )
    return trainer, trainer.train()


def files(folder: Path) -> dict[str, bytes]:
    skip = {"trainer_state.json", "hf_pretrain_state.json", "training_args.bin"}  # times and the flag itself
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.name not in skip}


def test_an_async_save_writes_the_bytes_a_synchronous_one_writes(tmp_path):
    trainer, _ = run(tmp_path / "async")
    assert trainer.checkpointing.background.in_flight is None  # finished: nothing in flight
    run(tmp_path / "sync", async_checkpoint=False)
    for step in range(SAVE_STEPS, STEPS + 1, SAVE_STEPS):
        written, reference = (
            files(tmp_path / "async" / f"checkpoint-{step}"),
            files(tmp_path / "sync" / f"checkpoint-{step}"),
        )
        assert {"model.safetensors", "optimizer.pt", "scheduler.pt", "rng_state.pth"} <= set(written)
        assert written == reference, step
    assert not (tmp_path / "async" / ".saving").exists()


def test_a_copy_beside_the_next_step_holds_that_steps_update_and_saves_the_state_of_its_own_step(tmp_path, monkeypatch):
    copy = DefaultStager._stage

    def slow_copy(self, state_dict, **kwargs):  # the copy that runs beside the step, made slower than a step
        if threading.current_thread() is not threading.main_thread():
            time.sleep(0.5)
        return copy(self, state_dict, **kwargs)

    monkeypatch.setattr(DefaultStager, "_stage", slow_copy)
    trainer, _ = run(tmp_path / "async")
    waits = trainer.checkpointing.background.staging_waits
    assert len(waits) == STEPS // SAVE_STEPS - 1 and min(waits) > 0.1, waits  # every save but the last held a step
    run(tmp_path / "sync", async_checkpoint=False)
    for step in range(SAVE_STEPS, STEPS + 1, SAVE_STEPS):
        written, reference = (
            files(tmp_path / "async" / f"checkpoint-{step}"),
            files(tmp_path / "sync" / f"checkpoint-{step}"),
        )
        assert written["model.safetensors"] == reference["model.safetensors"], step  # not the next step's weights
        assert written == reference, step


def test_a_failed_background_write_is_raised_at_the_next_step(tmp_path):
    steps = []

    class Steps(TrainerCallback):  # step 5 begins once checkpoint-4's write has failed (callbacks run first)
        def on_step_begin(self, args, state, control, **kwargs):
            steps.append(state.global_step + 1)
            if steps[-1] == 5:
                writer = [t for t in threading.enumerate() if t.name == "hf_pretrain-save-checkpoint-4"]
                assert len(writer) <= 1
                for thread in writer:
                    thread.join(timeout=120)

    with pytest.raises(CheckpointWriteError, match=r"checkpoint-4: the background write failed on rank 0 \(OSError"):
        run(tmp_path, write_fault=(4, 0, WriteFault("fail")), callbacks=[Steps()], steps=10)
    assert steps[-1] == 5  # raised by the first step after the write failed: not lost, not late
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2"]  # the one before is intact
    assert not (tmp_path / ".saving" / "checkpoint-4").exists()  # the half-written folder is gone


def seen_within(path: Path, seconds: float = 60) -> bool:
    """Whether `path` exists within `seconds`: the writer thread reaches a fault's marker when it gets to that file,
    which on a loaded machine can be after the step that looks for it."""
    deadline = time.monotonic() + seconds
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    return path.exists()


def release_when_the_loop_waits(release: Path, deadline_s: float = 120) -> None:
    main, deadline = threading.main_thread().ident, time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        frame = sys._current_frames().get(main)
        while frame is not None and not (frame.f_code.co_name == "wait" and frame.f_code.co_filename == BACKGROUND):
            frame = frame.f_back
        if frame is not None:
            break
        time.sleep(0.01)
    release.write_text("")


def test_a_save_waits_for_the_one_in_flight_and_the_last_completes_before_train_returns(tmp_path, caplog):
    marker, release = tmp_path / "writing", tmp_path / "release"

    class Release(TrainerCallback):  # the write of checkpoint-2 is held until the next save waits for it
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2 * SAVE_STEPS:
                writing = seen_within(marker)
                if not writing:
                    release.write_text("")  # no writer left blocked for the rest of the suite
                assert writing and not (tmp_path / "checkpoint-2").exists()  # trained on, while it wrote
                threading.Thread(target=release_when_the_loop_waits, args=(release,)).start()

    fault = WriteFault("block", marker=str(marker), release=str(release))
    with caplog.at_level(logging.WARNING):
        run(tmp_path, write_fault=(SAVE_STEPS, 0, fault), callbacks=[Release()])
    assert "checkpoint-4 waited" in caplog.text and "for checkpoint-2's background write" in caplog.text
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]


def test_the_last_save_is_complete_when_train_returns(tmp_path):
    fault = WriteFault("slow", seconds=1.0)  # a slow disk under the last checkpoint
    run(tmp_path, write_fault=(STEPS, 0, fault))
    assert (tmp_path / f"checkpoint-{STEPS}" / "write-fault.pt").exists()
    assert not os.path.exists(tmp_path / ".saving")


def test_rotation_waits_until_the_newer_checkpoint_is_complete(tmp_path):
    marker, release, seen = tmp_path / "writing", tmp_path / "release", {}

    class Look(TrainerCallback):  # the write of checkpoint-4 is held open during step 5
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 2 * SAVE_STEPS + 1:
                seen["during"] = sorted(p.name for p in tmp_path.glob("checkpoint-*"))
                seen["writing"] = seen_within(marker) and (tmp_path / ".saving" / "checkpoint-4").is_dir()
                release.write_text("")

    fault = WriteFault("block", marker=str(marker), release=str(release))
    run(tmp_path, write_fault=(2 * SAVE_STEPS, 0, fault), callbacks=[Look()], save_total_limit=1)
    assert seen == {"during": ["checkpoint-2"], "writing": True}  # the older one kept while the newer is written
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == [f"checkpoint-{STEPS}"]


def test_an_async_save_replaces_no_function_of_torch_safetensors_or_dcp(tmp_path):
    """The save hands its files to an explicit writer: inside the Trainer's save, `torch.save`, safetensors'
    `save_file` and DCP's `save` are still the libraries' own for every other caller (they were replaced for the
    whole process while a save was staged), and a file a subclass writes with plain `torch.save` is on disk at once."""
    import safetensors.torch
    import torch.distributed.checkpoint as dcp

    originals = (torch.save, safetensors.torch.save_file, dcp.save)
    seen = []

    class Looking(WriteFaultTrainer):
        def _save_optimizer_and_scheduler(self, output_dir):
            super()._save_optimizer_and_scheduler(output_dir)
            seen.append((torch.save, safetensors.torch.save_file, dcp.save))
            torch.save({"mine": 1}, os.path.join(output_dir, "own.pt"))  # not the checkpoint's: written now
            seen.append(os.path.exists(os.path.join(output_dir, "own.pt")))

    trainer, _ = run(tmp_path, trainer_class=Looking)
    assert trainer.checkpointing.background is not None  # the saves were asynchronous
    assert seen and all(s == originals for s in seen[0::2]) and all(seen[1::2]), seen
