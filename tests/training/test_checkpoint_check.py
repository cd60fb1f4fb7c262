"""A checkpoint is checked before a resume reads it (faults made for real: deletion, truncation, corruption)."""

import logging
import shutil

import pytest

from hf_pretrain.training.fsdp import sharding_requested
from hf_pretrain.training.resume.check import CheckpointError, check_checkpoint
from hf_pretrain.training.resume.checkpointing import check_resume, resume_target
from tests.conftest import quick_args
from tests.training.test_resume import train


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A real run stopped at step 10, with whole checkpoints 5 and 10."""
    out = tmp_path_factory.mktemp("run")
    train(out, stop_at=10)
    assert check_checkpoint(out / "checkpoint-10").ok and check_checkpoint(out / "checkpoint-5").ok
    return out


@pytest.fixture
def copy(run_dir, tmp_path):
    shutil.copytree(run_dir, tmp_path / "run")
    return tmp_path / "run"


def cut(path, keep=0.5):
    data = path.read_bytes()
    path.write_bytes(data[: int(len(data) * keep)])


@pytest.mark.parametrize(
    "fault, expected",
    [
        (lambda c: (c / "optimizer.pt").unlink(), "optimizer.pt: missing (a resume would start a fresh optimizer)"),
        (
            lambda c: (c / "optimizer.pt").rename(c / "optimizer.pt.bak"),
            "optimizer.pt: missing (a resume would start a fresh optimizer)",
        ),
        (lambda c: (c / "scheduler.pt").unlink(), "scheduler.pt: missing (the learning rate would restart)"),
        (lambda c: (c / "rng_state.pth").unlink(), "rng_state.pth: missing"),
        (lambda c: cut(c / "model.safetensors"), "model.safetensors: cut short"),
        (lambda c: cut(c / "model.safetensors", 0.0001), "model.safetensors: unreadable header"),
        (lambda c: cut(c / "optimizer.pt"), "optimizer.pt: unreadable, cut or corrupt"),
        (lambda c: (c / "hf_pretrain_state.json").write_text('{"data": '), "hf_pretrain_state.json: unreadable"),
        (
            lambda c: (c / "hf_pretrain_state.json").write_text('{"data": 5}'),
            "hf_pretrain_state.json: malformed ('data' must be an object, not int)",
        ),
        (
            lambda c: (c / "hf_pretrain_state.json").write_text('{"stream": {"micro_batches": 3}}'),
            "hf_pretrain_state.json: malformed (stream.state must be an object, not None)",
        ),
        (lambda c: (c / "trainer_state.json").unlink(), "trainer_state.json: missing"),
    ],
    ids=[
        "no-optimizer",
        "renamed-optimizer",
        "no-scheduler",
        "no-rng",
        "cut-weights",
        "cut-header",
        "cut-optimizer",
        "bad-position",
        "position-not-an-object",
        "stream-without-state",
        "no-state",
    ],
)
def test_each_fault_is_named(copy, fault, expected):
    fault(copy / "checkpoint-10")
    check = check_checkpoint(copy / "checkpoint-10")
    assert not check.ok and any(p.startswith(expected) for p in check.problems), check.problems


def test_rng_of_another_world_size_only_warns(copy):
    checkpoint = copy / "checkpoint-10"
    (checkpoint / "rng_state.pth").rename(checkpoint / "rng_state_0.pth")
    (checkpoint / "rng_state_1.pth").write_bytes((checkpoint / "rng_state_0.pth").read_bytes())
    check = check_checkpoint(checkpoint, world_size=1)
    assert check.ok and check.warnings == [
        "rng_state.pth: missing (the random streams would not resume); resuming anyway (saved for another number "
        "of processes)"
    ]
    assert check_checkpoint(checkpoint, world_size=2).ok


def test_a_missing_run_state_warns_what_a_resume_loses(copy):
    (copy / "checkpoint-10" / "hf_pretrain_state.json").unlink()  # also what a plain transformers checkpoint lacks
    check = check_checkpoint(copy / "checkpoint-10")
    assert check.ok and len(check.warnings) == 1
    assert check.warnings[0].startswith("hf_pretrain_state.json: missing (a checkpoint of plain transformers has none")
    assert "a stream is read again from its start" in check.warnings[0]


def test_explicit_path_with_a_missing_optimizer_is_refused_naming_the_file_and_the_fix(copy):
    (copy / "checkpoint-10" / "optimizer.pt").unlink()
    with pytest.raises(CheckpointError, match="optimizer.pt: missing") as error:
        train(copy, resume=str(copy / "checkpoint-10"))
    assert str(copy / "checkpoint-5") in str(error.value)  # the fix names the newest whole checkpoint


def test_explicit_path_with_cut_weights_is_refused(copy):
    cut(copy / "checkpoint-10" / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"model.safetensors: cut short \(\d+ bytes, its header needs \d+\)"):
        train(copy, resume=str(copy / "checkpoint-10"))


def test_latest_skips_a_corrupt_checkpoint_says_so_and_resumes_the_whole_one(copy, caplog):
    cut(copy / "checkpoint-10" / "model.safetensors")
    with caplog.at_level(logging.WARNING, logger="hf_pretrain"):
        _, record = train(copy, resume=True)
    assert f"Resuming from {copy / 'checkpoint-5'}, the newest whole checkpoint; skipped: checkpoint-10" in caplog.text
    assert min(record.losses) == 6  # the first step trained is the one after checkpoint-5


@pytest.mark.parametrize("resume", ["latest", "path", "auto"])
def test_a_resume_with_nothing_skipped_says_once_which_checkpoint_it_reads(copy, capsys, caplog, resume):
    with caplog.at_level(logging.WARNING, logger="hf_pretrain"):
        train(copy, resume={"latest": True, "path": str(copy / "checkpoint-10"), "auto": "auto"}[resume])
    said = capsys.readouterr().out.count(f"Resuming from {copy / 'checkpoint-10'}\n")
    said += caplog.text.count(f"Resuming from {copy / 'checkpoint-10'}, the newest whole checkpoint")
    assert said == 1


def test_latest_with_no_whole_checkpoint_is_an_error(copy):
    for step in (5, 10):
        (copy / f"checkpoint-{step}" / "scheduler.pt").unlink()
    with pytest.raises(
        CheckpointError, match=r"No valid checkpoint found in output directory \(.*\): no whole checkpoint-N"
    ):
        train(copy, resume=True)


def test_fsdp_full_state_files_are_checked_instead_of_the_plain_ones(copy):
    """FSDP with FULL_STATE_DICT: accelerate's `pytorch_model_fsdp.bin` and `optimizer.bin` (torch.save zips)."""
    checkpoint = copy / "checkpoint-10"
    (checkpoint / "optimizer.pt").rename(checkpoint / "optimizer.bin")
    shutil.copy(checkpoint / "optimizer.bin", checkpoint / "pytorch_model_fsdp.bin")  # any torch.save zip
    assert check_checkpoint(checkpoint, fsdp=True).ok
    assert not check_checkpoint(checkpoint).ok  # a plain run needs optimizer.pt
    cut(checkpoint / "pytorch_model_fsdp.bin")
    assert check_checkpoint(checkpoint, fsdp=True).problems[0].startswith("pytorch_model_fsdp.bin: unreadable")
    (checkpoint / "optimizer.bin").unlink()
    assert "optimizer_0/ or optimizer.bin: missing" in " ".join(check_checkpoint(checkpoint, fsdp=True).problems)


@pytest.mark.parametrize(
    "flag, target",
    [("true", True), ("Last", True), (True, True), ("auto", "auto"), ("runs/x/checkpoint-5", "runs/x/checkpoint-5")]
    + [(None, None), ("false", "false")],
)
def test_resume_target_reads_true_and_last_as_the_newest_whole_checkpoint(flag, target):
    assert resume_target(flag) == target


def test_a_script_checks_its_resume_flag_before_any_data_work(copy):
    for flag in ("last", "auto", str(copy / "checkpoint-5"), None):
        check_resume(quick_args(copy, resume_from_checkpoint=flag))  # whole checkpoints, or no resume
    for step in (5, 10):
        (copy / f"checkpoint-{step}" / "scheduler.pt").unlink()
    with pytest.raises(CheckpointError, match="No valid checkpoint found in output directory"):
        check_resume(quick_args(copy, resume_from_checkpoint="true"))
    check_resume(quick_args(copy, resume_from_checkpoint="auto"))  # auto starts anew
    with pytest.raises(CheckpointError, match="Can't find a valid checkpoint at .*checkpoint-5: scheduler.pt: missing"):
        check_resume(quick_args(copy, resume_from_checkpoint=str(copy / "checkpoint-5")))


@pytest.mark.parametrize("engine, requested", [("DEEPSPEED", (True, False)), ("FSDP", (False, True))])
def test_the_resume_check_reads_the_sharding_of_the_launch_config(copy, monkeypatch, engine, requested):
    """Under an accelerate DeepSpeed / FSDP launch config (no flag), the checkpoint needs that engine's files."""
    args = quick_args(copy, resume_from_checkpoint=str(copy / "checkpoint-10"))
    check_resume(args)  # a plain run's checkpoint, for a plain run
    monkeypatch.setenv(f"ACCELERATE_USE_{engine}", "true")
    assert sharding_requested(args) == requested
    with pytest.raises(CheckpointError, match="Can't find a valid checkpoint at .*checkpoint-10"):
        check_resume(args)
