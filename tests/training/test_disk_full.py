"""A save that runs out of disk (a real full tmpfs) names the path and the free space; the previous checkpoint stays."""

import errno
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from types import SimpleNamespace

import pytest

from hf_pretrain.training.resume import store
from hf_pretrain.training.resume.check import check_checkpoint
from hf_pretrain.training.resume.checkpointing import Checkpointing
from hf_pretrain.training.resume.store import disk_full_error, staging_root
from tests.training.test_resume import train


def mount_tmpfs(path, size_bytes):
    path.mkdir(parents=True)
    result = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)], capture_output=True
    )
    if result.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({result.stderr.decode().strip()}): needs root")


def test_disk_full_during_a_save_is_named_and_the_previous_checkpoint_survives(tmp_path):
    measured = tmp_path / "measured"
    train(measured, max_steps=5, save_steps=5)
    size = sum(p.stat().st_size for p in (measured / "checkpoint-5").rglob("*") if p.is_file())
    disk = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
    mount_tmpfs(disk, int(size * 1.6))  # room for one checkpoint, not for a second one beside it
    try:
        with pytest.raises(
            OSError, match=r"Saving checkpoint-10 to .* failed .* MiB free on that file system"
        ) as error:
            train(disk, max_steps=10, save_steps=5)
        message = str(error.value)
        assert "the newest checkpoint (checkpoint-5) takes" in message and "Fix: free space" in message
        assert check_checkpoint(disk / "checkpoint-5").ok  # intact, and resumable
        assert not (disk / "checkpoint-10").exists() and not list((disk / ".saving").glob("*"))
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)  # lazily: a failed writer may hold a file open
        shutil.rmtree(disk, ignore_errors=True)


def test_the_final_save_on_a_full_disk_is_named_and_leaves_no_config_without_weights(tmp_path):
    disk = tmp_path / f"disk-{uuid.uuid4().hex[:6]}"
    mount_tmpfs(disk, 256 * 1024)  # room for the run's logs, not for the weights (~0.8 MB)
    try:
        trainer, _ = train(disk, max_steps=2, save_strategy="no")
        with pytest.raises(OSError, match=r"Saving the model to .* failed \(.*\): .* MiB free on that file system"):
            trainer.save_model()
        assert not (disk / "config.json").exists() and not (disk / "model.safetensors").exists()
        assert not (disk / ".saving").exists()  # the half save is gone: the disk has its room back
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)
        shutil.rmtree(disk, ignore_errors=True)


def test_the_final_save_is_moved_into_place_complete(tmp_path):
    trainer, _ = train(tmp_path, max_steps=2, save_strategy="no")
    trainer.save_model()
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(tmp_path).num_parameters() == trainer.model.num_parameters()
    assert not (tmp_path / ".saving").exists()


def newest_checkpoint(run_dir, size=4096):
    (run_dir / "checkpoint-5").mkdir()
    (run_dir / "checkpoint-5" / "model.safetensors").write_bytes(b"0" * size)


def free_bytes(monkeypatch, run_dir, free):
    usage = shutil.disk_usage(run_dir)._replace(free=free)
    monkeypatch.setattr(store.shutil, "disk_usage", lambda path: usage)


@pytest.mark.parametrize(
    "error, labelled",
    [
        (OSError(errno.ENOSPC, "No space left on device"), True),
        (RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 832 vs 760"), True),
        (PermissionError(errno.EACCES, "Permission denied"), False),  # low space, but not what failed
        (RuntimeError("Cannot serialize a tensor that lives on the meta device"), False),
    ],
)
def test_only_an_error_that_says_so_is_labelled_a_full_disk(tmp_path, monkeypatch, error, labelled):
    newest_checkpoint(tmp_path)
    free_bytes(monkeypatch, tmp_path, 1024)  # less than the newest checkpoint
    full = disk_full_error(error, str(tmp_path), "checkpoint-10")
    assert (full is not None) == labelled
    if labelled:
        assert full.errno == errno.ENOSPC and "0.0 MiB free on that file system" in str(full)
    elif sys.version_info >= (3, 11):  # the user's error, with the free space noted (notes: Python 3.11+)
        assert "less than the newest checkpoint (checkpoint-5)" in error.__notes__[0]


def test_an_error_on_a_roomy_disk_is_left_as_it_is(tmp_path, monkeypatch):
    newest_checkpoint(tmp_path)
    free_bytes(monkeypatch, tmp_path, 10 * 2**30)
    error = PermissionError(errno.EACCES, "Permission denied")
    assert disk_full_error(error, str(tmp_path), "checkpoint-10") is None
    assert not getattr(error, "__notes__", [])


def test_a_failed_save_of_another_kind_raises_it_and_removes_the_half_save(tmp_path):
    staged = Path(staging_root(str(tmp_path))) / "checkpoint-10"

    def save_checkpoint():  # the Trainer's save, failing halfway
        staged.mkdir(parents=True)
        (staged / "model.safetensors").write_bytes(b"0" * 1024)
        raise PermissionError(errno.EACCES, "Permission denied")

    trainer = SimpleNamespace(state=SimpleNamespace(global_step=10), args=SimpleNamespace(async_checkpoint=False))
    checkpointing = Checkpointing(trainer)
    with pytest.raises(PermissionError, match="Permission denied"):
        checkpointing.save(save_checkpoint, str(tmp_path), {})
    assert not staged.exists() and not (tmp_path / "checkpoint-10").exists()
