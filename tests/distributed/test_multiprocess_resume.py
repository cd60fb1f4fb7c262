"""Exact resume of a real 2-rank gloo run whose epoch does not divide into global batches, after a rank
is killed (SIGKILL), with a dataloader worker; and a resume on another number of processes."""

import json
import shutil
import subprocess
import sys

import pytest

from tests.distributed.test_distributed import CONFIGS, ENV, ROOT, free_port

SCRIPT = ROOT / "tests" / "distributed" / "resume_run.py"

pytestmark = pytest.mark.distributed


def launch(out, per_device, *extra, processes=2, config=CONFIGS / "cpu_2proc.yaml"):
    if processes == 2:
        config = ["--config_file", str(config), "--main_process_port", str(free_port())]
    else:
        config = ["--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    command = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        *config,
        str(SCRIPT),
        str(out),
        str(per_device),
        *extra,
    ]
    return subprocess.run(command, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=1200)


def losses(out, run):
    return {int(step): loss for step, loss in json.loads((out / f"losses-{run}-rank0.json").read_text()).items()}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    result = launch(out, 6)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "dataloader_num_workers=1 started" not in result.stderr  # a spawned worker: nothing to warn of
    return out


def test_killed_rank_resumes_every_loss_exactly_across_uneven_epoch_ends(tmp_path, straight):
    reference = losses(straight, "straight")
    assert sorted(reference) == list(range(1, 16))
    killed = launch(tmp_path, 6, "kill:11")
    assert killed.returncode != 0  # rank 1 died at step 11: the launch failed
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-6", "checkpoint-9"]
    resumed = launch(tmp_path, 6, "resume")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    after = losses(tmp_path, "resumed")
    assert sorted(after) == list(range(10, 16))  # 4 steps an epoch: step 12 ends one with a completed batch
    assert after == {step: reference[step] for step in after}  # every loss, bit for bit


@pytest.mark.exhaustive
def test_resume_on_one_process_with_the_same_global_batch(tmp_path, straight):
    shutil.copytree(straight / "checkpoint-9", tmp_path / "checkpoint-9")
    result = launch(tmp_path, 12, "resume", processes=1)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    reference, after = losses(straight, "straight"), losses(tmp_path, "resumed")
    assert sorted(after) == list(range(10, 16))
    # The sample position maps onto the new geometry, and the one process completes each epoch end with repeated
    # samples as the two ranks did (step 12 ends an epoch): every step sees the samples of the uninterrupted run.
    # Not bit for bit: one mean over 12 rows against the mean of two ranks' means over 6.
    print({step: after[step] - reference[step] for step in after})
    assert all(abs(after[step] - reference[step]) <= 1e-5 for step in after), (after, reference)
