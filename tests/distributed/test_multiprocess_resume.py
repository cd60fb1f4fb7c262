"""Exact resume of a real 2-rank gloo run whose epoch does not divide into global batches, after a rank
is killed (SIGKILL), with a dataloader worker; and a resume on another number of processes. Unattended recovery:
the launcher restarts the run (`--max_restarts 1`) after a rank is killed during a checkpoint's background write,
or after the hang watchdog caught a stopped rank (SIGSTOP), and the run resumes by itself (`"auto"`); a restart
loop (the same kill at the same step in every attempt) is stopped with the reason."""

import json
import re
import shutil
import subprocess
import sys

import pytest

from hf_pretrain.telemetry.jsonl import read_jsonl
from hf_pretrain.training.recovery.attempts import KILLED, REFUSED, RESTARTABLE, read_attempts
from hf_pretrain.training.recovery.watchdog import HANG_EXIT_CODE
from hf_pretrain.training.resume.check import check_checkpoint
from tests.distributed.test_distributed import CONFIGS, ENV, ROOT, free_port

SCRIPT = ROOT / "tests" / "distributed" / "resume_run.py"

pytestmark = pytest.mark.distributed


def launch(out, per_device, *extra, processes=2, config=CONFIGS / "cpu_2proc.yaml", restarts=0):
    env = ENV
    out.mkdir(parents=True, exist_ok=True)
    if processes == 2:
        config = ["--config_file", str(config), "--main_process_port", str(free_port())]
    else:
        config = ["--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
    if restarts:  # restarts need a fresh rendezvous store per attempt (docs/known-failure-modes.md)
        config += ["--max_restarts", str(restarts), "--monitor_interval", "0.5", "--rdzv_backend", "c10d"]
        env = {**ENV, **RESTARTABLE, "PET_RDZV_ENDPOINT": f"127.0.0.1:{free_port()}"}
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
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)


def losses(out, run):
    return {int(step): loss for step, loss in json.loads((out / f"losses-{run}-rank0.json").read_text()).items()}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    result = launch(out, 6)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "dataloader_num_workers=1 started" not in result.stderr  # a spawned worker: nothing to warn of
    return out


@pytest.mark.exhaustive  # make test: the kill -9 below, resumed unattended across the same epoch ends, bit for bit
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


def test_a_background_write_that_fails_on_one_rank_stops_every_rank_at_the_same_step(tmp_path):
    result = launch(tmp_path, 6, "write-fail:6")
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    assert "checkpoint-6: the background write failed on rank 1 (OSError" in output, output[-3000:]  # rank 1's own
    assert "checkpoint-6: the background write failed on rank(s) [1]" in output, output[-3000:]  # rank 0 told
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-3"]  # the half-written one gone
    assert check_checkpoint(tmp_path / "checkpoint-3").ok
    # raised by one step on both ranks: the first after both writers ended (step 7 at the earliest, when both were
    # done by then; later when rank 0's write took a few steps), so the last step trained is the same on both
    last = {max(json.loads((tmp_path / f"losses-straight-rank{rank}.json").read_text())) for rank in (0, 1)}
    assert len(last) == 1 and 6 <= int(next(iter(last))) < 15, last


def assert_recovered(result, out, reference, resumed_from):
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    first, second = read_attempts(out)
    assert first.ended not in (None, "finished") and (second.restart, second.resumed_step) == (1, resumed_from)
    assert second.ended == "finished"
    after = losses(out, "restarted1")
    assert sorted(after) == list(range(resumed_from + 1, 16))
    assert after == {step: reference[step] for step in after}  # every loss of the uninterrupted run, bit for bit
    return first


def test_a_rank_killed_during_a_background_write_restarts_unattended_from_the_checkpoint_before(tmp_path, straight):
    result = launch(tmp_path, 6, "restart-kill-in-write:6", restarts=1)
    fault = json.loads((tmp_path / "fault.json").read_text())
    assert fault == {"rank": 1, "step": 7, "kind": "kill-in-write", "write_open": True}  # trained on while it wrote
    # the half-written checkpoint-6 goes: removed by rank 0 when its writer's exchange with the killed rank failed
    # (a failed exchange is a failed write), or, when the launcher ended rank 0 first, by the restart
    if "Removed what an interrupted save left in" in result.stdout:
        assert "['checkpoint-6']" in result.stdout
    assert not (tmp_path / ".saving" / "checkpoint-6").exists()
    assert check_checkpoint(tmp_path / "checkpoint-6").ok  # saved again, whole, by the restarted attempt at step 6
    assert_recovered(result, tmp_path, losses(straight, "straight"), resumed_from=3)
    first, second = read_attempts(tmp_path)
    # the record: the step the kill -9 interrupted and the rank it killed, not rank 0 that saw its peer go
    assert (first.ended, first.failed_rank, first.last_step) == (KILLED, 1, 7), first
    goodput = [record for record in read_jsonl(tmp_path) if "goodput" in record][-1]  # the last log: step 15
    assert goodput["step"] == 15 and goodput["goodput_restarts"] == 1
    # lost: the relaunch, and steps 4-7 trained again (checkpoint-6 was never complete)
    assert goodput["goodput_restart_s"] >= second.started - first.end_time > 0
    assert 0 < goodput["goodput"] < 1


def test_a_restart_loop_that_fails_at_the_same_step_each_time_stops_with_the_reason(tmp_path, straight):
    """A real launcher (--max_restarts 2) restarts a run whose rank 1 is killed (outside any write) at step 5 in
    every attempt: the restart resumes by itself, bit for bit, and the third attempt refuses to train and says why
    instead of burning the restarts."""
    result = launch(tmp_path, 6, "restart-loop-kill:5", restarts=2)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    attempts = read_attempts(tmp_path)
    assert [(a.restart, a.resumed_step) for a in attempts] == [(0, 0), (1, 3), (2, 3)], attempts
    assert [(a.last_step, a.ended, a.failed_rank) for a in attempts[:2]] == [(5, KILLED, 1)] * 2, attempts
    assert attempts[0].failure == attempts[1].failure is not None, attempts  # the same failure, both times
    assert (attempts[2].ended, attempts[2].last_step) == (REFUSED, 3)  # it trained no step
    reason = "Not training again: the last 2 attempts all failed at step 5 after resuming from step 3: killed"
    assert reason in output, output[-3000:]
    assert not (tmp_path / "losses-restarted2-rank0.json").exists()  # refused before its first step
    # the restart's step 4 (step 5 is killed before it is logged): the loss of the uninterrupted run, bit for bit
    assert losses(tmp_path, "restarted1") == {4: losses(straight, "straight")[4]}


@pytest.mark.exhaustive  # make test: the watchdog's one-process tests (test_recovery.py); this launch waits out
# torch elastic's 30 s grace for the stopped rank
def test_a_stopped_rank_is_caught_by_the_watchdog_and_the_run_recovers(tmp_path, straight):
    result = launch(tmp_path, 6, "restart-stop:8", restarts=1)
    assert json.loads((tmp_path / "fault.json").read_text())["kind"] == "stop"
    first = assert_recovered(result, tmp_path, losses(straight, "straight"), resumed_from=6)
    assert first.ended.startswith("hang: no optimizer step for") and first.failed_rank == 0
    assert "rank 1 (" in first.ended and "stopped reporting" in first.ended  # the watchdog names the silent rank
    # the launcher saw the watchdog's exit ("failed (exitcode: 124) local_rank: 0"; torch elastic's log line)
    assert re.search(rf"exitcode\s*:\s*{HANG_EXIT_CODE}\b", result.stderr + result.stdout)
    stacks = (tmp_path / "recovery" / "stacks-rank0-step8.txt").read_text()
    assert "distributed_c10d.py" in stacks and "in train" in stacks  # rank 0 waited in a collective of train()


SHARDED = {
    "fsdp2": ({"config": CONFIGS / "cpu_2proc_fsdp2.yaml"}, ()),
    "zero2": ({}, (str(ROOT / "ds_configs" / "zero2.json"),)),
    "zero3": ({}, (str(ROOT / "ds_configs" / "zero3.json"),)),
}


@pytest.mark.exhaustive  # make test: the DDP launches above
@pytest.mark.parametrize("backend", sorted(SHARDED))
def test_sharded_state_recovers_unattended_from_a_kill_during_a_write_and_from_a_hang(tmp_path, backend):
    options, deepspeed = SHARDED[backend]
    straight = launch(tmp_path / "straight", 6, "straight", *deepspeed, **options)
    assert straight.returncode == 0, straight.stdout[-3000:] + straight.stderr[-3000:]
    reference = losses(tmp_path / "straight", "straight")
    killed = tmp_path / "killed"
    result = launch(killed, 6, "restart-kill-in-write:6", *deepspeed, restarts=1, **options)
    assert json.loads((killed / "fault.json").read_text())["write_open"]
    assert_recovered(result, killed, reference, resumed_from=3)
    stopped = tmp_path / "stopped"
    result = launch(stopped, 6, "restart-stop:8", *deepspeed, restarts=1, **options)
    assert assert_recovered(result, stopped, reference, resumed_from=6).ended.startswith("hang:")
