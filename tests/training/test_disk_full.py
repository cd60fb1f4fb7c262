"""A save that runs out of disk (a real full tmpfs) names the path and the free space; the previous checkpoint stays."""

import shutil
import subprocess
import uuid

import pytest

from hf_pretrain.training.checkpoint_check import check_checkpoint
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
