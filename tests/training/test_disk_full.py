"""A save that runs out of disk (a real full tmpfs) names the path and the free space; the previous checkpoint stays."""

import errno
import shutil
import subprocess
import uuid

import pytest

from hf_pretrain.training import checkpoints
from hf_pretrain.training.checkpoint_check import check_checkpoint
from hf_pretrain.training.checkpoints import disk_full_error
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
    (tmp_path / "checkpoint-5").mkdir()
    (tmp_path / "checkpoint-5" / "model.safetensors").write_bytes(b"0" * 4096)
    low = shutil.disk_usage(tmp_path)._replace(free=1024)  # less than the newest checkpoint
    monkeypatch.setattr(checkpoints.shutil, "disk_usage", lambda path: low)
    full = disk_full_error(error, str(tmp_path), "checkpoint-10")
    assert (full is not None) == labelled
    if labelled:
        assert full.errno == errno.ENOSPC and "0.0 MiB free on that file system" in str(full)
    else:  # the user's error, with the free space noted
        assert "less than the newest checkpoint (checkpoint-5)" in error.__notes__[0]
