"""Unattended runs in one process (training/recovery/): the hang watchdog's timeout, dump and exit; the record of
the attempts and the restart-loop guard across real `train()` calls as a launcher's restarts make them;
`resume_from_checkpoint="auto"`; goodput across a failure. The launches with real restarts (kill -9, SIGSTOP) are
in tests/distributed/test_multiprocess_resume.py."""

import json
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
from datasets import Dataset
from transformers import TrainerCallback

from hf_pretrain import PretrainForCausalLM, PretrainTrainer, get_preset
from hf_pretrain.telemetry.goodput import GoodputCallback
from hf_pretrain.telemetry.jsonl import read_jsonl
from hf_pretrain.training.recovery import room
from hf_pretrain.training.recovery.attempts import (
    KILLED,
    REFUSED,
    Attempt,
    RestartLoopError,
    no_progress,
    read_attempts,
)
from hf_pretrain.training.recovery.room import RecoveryCallback
from hf_pretrain.training.recovery.watchdog import HANG_EXIT_CODE, HangWatchdog, WatchdogSettings, heartbeat_path
from tests.conftest import quick_args
from tests.training.faults import WriteFault, WriteFaultTrainer


def attempt(restart, step, ended=KILLED, resumed=0):
    return Attempt(restart=restart, started=0.0, resumed_step=resumed, last_step=step, ended=ended)


def test_a_restart_loop_is_the_same_failure_at_the_same_step_in_a_row():
    crash = "exception: RuntimeError: CUDA error: an illegal memory access"
    same = [attempt(0, 12, crash, 9), attempt(1, 12, crash, 9), attempt(2, 12, crash, 9)]
    assert "the last 3 attempts all failed at step 12 after resuming from step 9: exception: Runtime" in no_progress(
        same, 3
    )
    assert no_progress(same[:2], 3) is None  # not yet
    assert no_progress(same, 0) is None  # the guard off
    assert no_progress([*same[:2], attempt(2, 15, crash, 12)], 3) is None  # progress: another step
    assert no_progress([*same[:2], attempt(2, 12, KILLED, 9)], 3) is None  # another failure
    assert no_progress([*same[:2], attempt(2, 12, "finished", 9)], 3) is None
    hangs = [attempt(r, 7, f"hang: no optimizer step for {30 + r} s ...") for r in range(3)]
    assert no_progress(hangs, 3) is not None  # a hang is a hang, whatever its timings
    # a killed peer, seen by the survivor: gloo's two wordings, with the peer's port (real lines of two attempts)
    pair = "exception: RuntimeError: [../gloo/transport/tcp/pair.cc:{}] "
    resets = [
        attempt(0, 5, pair.format(537) + "Read error [127.0.0.1]:58266: Connection reset by peer. This is ...", 3),
        attempt(1, 5, pair.format(589) + "Connection closed by peer [127.0.0.1]:2265. This is typically ...", 3),
    ]
    assert no_progress(resets, 2) is not None
    other = "exception: ValueError: tensor size 12 is not 13"
    assert no_progress([attempt(0, 5, other.replace("13", "14"), 3), attempt(1, 5, other, 3)], 2) is not None
    assert no_progress([resets[0], attempt(1, 5, other, 3)], 2) is None  # another failure
    assert no_progress([resets[0], attempt(1, 5, KILLED, 3)], 2) is not None  # a rank lost, seen killed or by a peer
    assert no_progress([attempt(0, None, KILLED, 3), attempt(1, None, KILLED, 3)], 2) is None  # steps unknown
    assert no_progress([*same, attempt(3, 0, REFUSED)], 3) is not None  # a refused restart changes nothing
    assert no_progress([*same[:2], attempt(0, 12, crash, 9)], 3) is None  # a person launched again: counted anew


class FakeExit:
    def __init__(self):
        self.code, self.called = None, threading.Event()

    def __call__(self, code):
        self.code = code
        self.called.set()


def wait_for(condition, deadline_s=60.0):
    deadline = time.monotonic() + deadline_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_the_watchdog_dumps_the_stacks_names_the_silent_rank_and_exits(tmp_path):
    silent = {"rank": 1, "attempt": 0, "host": "node1", "pid": 4242, "step": 3, "phase": None, "seq": 7}
    tmp_path.mkdir(exist_ok=True)
    heartbeat_path(tmp_path, 1).write_text(json.dumps(silent))
    exit, reasons = FakeExit(), []
    settings = WatchdogSettings(factor=2.0, min_s=0.3, floor_s=30.0, poll_s=0.05)
    watchdog = HangWatchdog(tmp_path, 0, 2, settings, attempt=0, on_hang=reasons.append, exit=exit)
    watchdog.start(step=0)
    assert watchdog.timeout_s() == (30.0, "the floor until 3 steps are timed")  # the first steps: the floor
    watchdog.beat(1)
    watchdog.beat(2)
    assert watchdog.timeout_s()[0] == 30.0
    watchdog.beat(3)  # 3 timed steps: the steady timeout (the minimum, steps this short) applies
    assert watchdog.timeout_s()[0] == 0.3
    assert exit.called.wait(60)  # no step for longer than the timeout
    assert exit.code == HANG_EXIT_CODE
    stacks = (tmp_path / "stacks-rank0-step3.txt").read_text()
    assert "test_the_watchdog_dumps_the_stacks" in stacks  # this (main) thread, where it waits
    (reason,) = reasons
    assert reason.startswith("hang: no optimizer step for") and "after step 3 on rank 0" in reason
    assert "rank 1 (node1, pid 4242) stopped reporting" in reason and "ranks alive but making no step: 0" in reason


def test_the_watchdog_waits_out_a_long_save_and_times_steps_again_after_it(tmp_path):
    exit = FakeExit()
    settings = WatchdogSettings(factor=2.0, min_s=0.3, floor_s=60.0, poll_s=0.05)
    watchdog = HangWatchdog(tmp_path, 0, 1, settings, exit=exit)
    watchdog.start(step=0)
    for step in (1, 2, 3):
        watchdog.beat(step)
    with watchdog.long_phase("checkpoint"):
        begun = time.time()
        beat = heartbeat_path(tmp_path, 0)
        wait_for(lambda: beat.exists() and json.loads(beat.read_text())["time"] - begun > 5 * settings.min_s)
        assert not exit.called.is_set() and watchdog.timeout_s()[0] == 60.0
    assert exit.called.wait(60)  # after the save, the step timeout again
    watchdog.stop()


def test_rank_0s_heartbeat_carries_each_step_at_once_the_others_beat_at_a_rate_a_shared_folder_bears(tmp_path):
    settings = WatchdogSettings(min_s=300.0, floor_s=300.0, poll_s=60.0)  # a heartbeat every 30 s
    first, other = (HangWatchdog(tmp_path, rank, 2, settings, exit=FakeExit()) for rank in (0, 1))
    first.start(step=0)
    other.start(step=0)
    for step in (1, 2, 3):
        first.beat(step)
        other.beat(step)
        wait_for(lambda step=step: json.loads(heartbeat_path(tmp_path, 0).read_text())["step"] == step, 10)
    assert first.timeout_s()[0] == 300.0  # no poll came: each step was written by the beat's wake-up
    beat = json.loads(heartbeat_path(tmp_path, 1).read_text())
    assert (beat["step"], beat["seq"]) == (0, 1)  # rank 1 wrote once, at its start: the next beat is 30 s later
    first.stop()
    other.stop()


def test_a_heartbeat_write_that_hangs_does_not_stop_the_timeout(tmp_path, monkeypatch):
    """A hung output file system (a common cause of hangs) holds the heartbeat's write forever: the watchdog fires
    all the same, from memory."""
    hung, writes = threading.Event(), []
    write = HangWatchdog._write_heartbeat

    def write_then_hang(self):
        writes.append(self.step)
        if len(writes) > 1:
            hung.wait()  # as a write into a hung file system (released at the end of the test)
        write(self)

    monkeypatch.setattr(HangWatchdog, "_write_heartbeat", write_then_hang)
    exit = FakeExit()
    settings = WatchdogSettings(factor=2.0, min_s=0.3, floor_s=30.0, poll_s=0.05)
    watchdog = HangWatchdog(tmp_path, 0, 1, settings, exit=exit)
    watchdog.start(step=0)
    try:
        for step in (1, 2, 3):
            watchdog.beat(step)
        assert exit.called.wait(10) and exit.code == HANG_EXIT_CODE
        assert len(writes) > 1 and (tmp_path / "stacks-rank0-step3.txt").exists()  # the beat stuck, the stacks out
    finally:
        hung.set()
        watchdog.stop()


UNWRITABLE_CHILD = """
import sys, threading
from pathlib import Path
from hf_pretrain.training.recovery.watchdog import HangWatchdog, WatchdogSettings

folder = Path(sys.argv[1]) / "recovery"
watchdog = HangWatchdog(folder, 0, 2, WatchdogSettings(factor=2.0, min_s=0.3, floor_s=30.0, poll_s=0.05))
watchdog.start(step=0)
for step in (1, 2, 3):
    watchdog.beat(step)
folder.rename(folder.with_name("moved"))  # at once, whatever the beat thread writes meanwhile
folder.write_text("a file where the folder was: no stacks file can be written")
threading.Event().wait(60)  # hung: only the watchdog ends this process
"""


def test_a_stacks_file_that_cannot_be_written_still_ends_the_rank_with_124(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", UNWRITABLE_CHILD, str(tmp_path)], stderr=subprocess.PIPE, text=True)
    try:
        _, stderr = child.communicate(timeout=40)
    finally:
        child.kill()
    assert child.returncode == HANG_EXIT_CODE, stderr[-3000:]
    assert "could not be written" in stderr and "most recent call first" in stderr  # the stacks went to stderr


def test_a_poll_never_measures_a_long_phase_against_the_step_timeout(tmp_path):
    """Every state a poll can read while a save or an evaluation begins and ends (at each attribute the watchdog
    sets): none is overdue, though the phase outlasts the step timeout."""

    class Observed(HangWatchdog):
        def __setattr__(self, name, value):
            super().__setattr__(name, value)
            if getattr(self, "watching", False):
                self.seen.append((name, self.overdue()))

    watchdog = Observed(tmp_path, 0, 1, WatchdogSettings(min_s=0.3, floor_s=30.0), exit=FakeExit())
    for step in (1, 2, 3):
        watchdog.beat(step)
    watchdog.seen, watchdog.watching = [], True
    with watchdog.long_phase("eval"):
        time.sleep(0.5)  # longer than the step timeout (0.3 s), well within the floor
    watchdog.watching = False
    assert len(watchdog.seen) > 2 and all(late is None for _, late in watchdog.seen), watchdog.seen
    assert watchdog.timeout_s()[0] == 0.3  # the step timeout again, counted from the end of the phase


def write_beat(folder, beat):
    staged = folder / f".beat-{beat['rank']}.tmp"
    staged.write_text(json.dumps(beat))
    staged.replace(heartbeat_path(folder, beat["rank"]))


def test_a_peer_is_judged_by_its_heartbeat_changing_on_the_readers_clock_not_by_its_wall_clock(tmp_path):
    """Rank 1's clock is an hour behind (another node's): it beats, so it is alive; rank 2 stopped beating."""
    done = threading.Event()

    def peers():
        seq = 0
        while not done.wait(0.01):
            seq += 1
            for rank, count in ((1, seq), (2, 1)):  # rank 2's heartbeat never changes
                skewed = time.time() - 3600
                beat = {"rank": rank, "attempt": 0, "host": "node", "pid": rank, "step": 3, "phase": None}
                write_beat(tmp_path, {**beat, "seq": count, "time": skewed, "alive": skewed})

    tmp_path.mkdir(exist_ok=True)
    writer = threading.Thread(target=peers, daemon=True)
    writer.start()
    exit, reasons = FakeExit(), []
    # 2 s: the peers are read at half the timeout, so the beat thread has 1 s to read them before the hang fires
    # (0.5 s left it 0.25 s: on a loaded machine the hang fired first, with "who stopped is not known")
    settings = WatchdogSettings(factor=2.0, min_s=2.0, floor_s=30.0, poll_s=0.05)
    watchdog = HangWatchdog(tmp_path, 0, 3, settings, on_hang=reasons.append, exit=exit)
    watchdog.start(step=0)
    for step in (1, 2, 3):
        watchdog.beat(step)
    try:
        assert exit.called.wait(30)
        wait_for(lambda: reasons)
    finally:
        done.set()
        writer.join()
    (reason,) = reasons
    assert "rank 2 (node, pid 2) stopped reporting" in reason and "rank 1 (" not in reason, reason
    assert "ranks alive but making no step: 0 (step 3), 1 (step 3)" in reason, reason


def test_every_timeout_ends_before_ddp_timeout_and_a_floor_past_it_is_refused(tmp_path):
    settings = room.watchdog_settings(RecoveryCallback.arguments, ddp_timeout=1800)
    assert (settings.floor_s, settings.min_s) == (1740, 300)  # the floor by default: NCCL's watchdog at 1800 s
    watchdog = HangWatchdog(tmp_path, 0, 1, settings, exit=FakeExit())
    watchdog.durations.extend([200.0] * 3)  # steps of 200 s: 10 x the median would be 2000 s
    watchdog.steps_timed = 3
    assert watchdog.timeout_s()[0] == 1740
    with pytest.raises(
        ValueError, match=r"hang_timeout_floor_s=1800 ends after ddp_timeout=1800 less 60 s.*at least 1860"
    ):
        train(tmp_path, args={"hang_watchdog": True, "hang_timeout_floor_s": 1800.0})


TERMINATED_CHILD = """
import sys, threading
from hf_pretrain.training.recovery.watchdog import HangWatchdog, WatchdogSettings

def waits_for_a_peer(event):  # as a rank blocked in a collective: the launcher ends it with SIGTERM
    print("ready", flush=True)
    event.wait()

settings = WatchdogSettings(min_s=1.0, floor_s=300, poll_s=0.05)  # a heartbeat every 0.1 s; the floor for 3 steps
watchdog = HangWatchdog(sys.argv[1], 1, 2, settings, attempt=2)
watchdog.start(step=5)
watchdog.beat(step=6)  # the file is named after the step of its heartbeat
while not watchdog.terminated_stacks_path().exists():
    threading.Event().wait(0.01)
waits_for_a_peer(threading.Event())
"""


def test_a_rank_the_launcher_terminates_writes_its_stacks_then_ends_as_sigterm_does(tmp_path):
    stale = tmp_path / "stacks-rank1-attempt1-step3-terminated.txt"
    tmp_path.mkdir(exist_ok=True)
    stale.touch()  # an earlier attempt's file that no SIGTERM wrote (that attempt was SIGKILLed)
    child = subprocess.Popen([sys.executable, "-c", TERMINATED_CHILD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "ready"
    child.send_signal(signal.SIGTERM)
    assert child.wait(60) == -signal.SIGTERM  # the default action still ends it (chained)
    stacks = (tmp_path / "stacks-rank1-attempt2-step6-terminated.txt").read_text()
    assert "in waits_for_a_peer" in stacks and "in _monitor" in stacks  # the main thread and the watchdog's
    assert not stale.exists() and not (tmp_path / "stacks-rank1-attempt2-step5-terminated.txt").exists()


def test_a_clean_stop_leaves_no_terminated_stacks_file(tmp_path):
    watchdog = HangWatchdog(tmp_path, 0, 1, WatchdogSettings(min_s=300, floor_s=300), exit=FakeExit())
    watchdog.start(step=0)
    assert watchdog.terminated_stacks_path().exists()
    watchdog.stop()
    assert not watchdog.terminated_stacks_path().exists()


STEPS = 8


def train(
    out, resume="auto", fail_at=None, limit=3, telemetry=False, callbacks=(), trainer_class=PretrainTrainer, **extra
):
    torch.manual_seed(0)
    data = torch.randint(3, 500, (64, 16), generator=torch.Generator().manual_seed(1))
    args = quick_args(
        out,
        max_steps=STEPS,
        per_device_train_batch_size=4,
        learning_rate=3e-3,
        seed=0,
        telemetry=telemetry,
        measure_peak_tflops=False,
        save_strategy="steps",
        save_steps=2,
        restart_same_failure_limit=limit,
        **extra.pop("args", {}),
    )
    model = PretrainForCausalLM(get_preset("tiny", vocab_size=512, num_hidden_layers=1))

    class Fail(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == fail_at:
                raise RuntimeError(f"injected at step {fail_at}")

    dataset = Dataset.from_dict({"input_ids": data.tolist(), "labels": data.tolist()})
    trainer = trainer_class(model=model, args=args, train_dataset=dataset, callbacks=[Fail(), *callbacks], **extra)
    return trainer.train(resume_from_checkpoint=resume)


def test_auto_starts_then_resumes_after_a_failure_and_goodput_counts_the_loss(tmp_path, monkeypatch, caplog):
    with pytest.raises(RuntimeError, match="injected at step 6"):
        train(tmp_path, fail_at=6, telemetry=True)  # no checkpoint yet: 'auto' starts at step 0
    assert "starting at step 0" in caplog.text
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # the launcher's restart
    train(tmp_path, telemetry=True)
    first, second = read_attempts(tmp_path)
    assert (first.resumed_step, first.last_step, first.ended) == (0, 6, "exception: RuntimeError: injected at step 6")
    assert (second.restart, second.resumed_step, second.last_step, second.ended) == (
        1,
        4,
        STEPS,
        "finished",
    )  # the newest
    last = [r for r in read_jsonl(tmp_path) if "goodput" in r][-1]
    assert last["goodput_restarts"] == 1
    # checkpoint-4's counters hold the save at 2 (its own is added after them); then the save at 6. The last log
    # (step 8) comes before step 8's save, as the Trainer logs before it saves
    assert last["goodput_saves"] == 2
    assert last["goodput_restart_s"] >= second.started - first.end_time  # at least the relaunch
    spent = sum(last[f"goodput_{kind}_s"] for kind in ("productive", "checkpoint", "eval", "restart"))
    assert 0 < last["goodput"] < 1 and last["goodput_checkpoint_s"] > 0 and spent <= last["goodput_wall_s"]


def test_goodput_counts_each_save_once_and_the_wait_for_the_last_write_as_stall_only(tmp_path, monkeypatch):
    seen = []
    original = GoodputCallback.add

    def add(self, kind, seconds, count=True):
        original(self, kind, seconds, count)
        seen.append((kind, count, self.saves, self.seconds["checkpoint"]))

    monkeypatch.setattr(GoodputCallback, "add", add)
    train(tmp_path, telemetry=True)
    saves = [entry for entry in seen if entry[0] == "checkpoint"]
    assert len(saves) == STEPS // 2 + 1  # a save every 2 steps, then train()'s wait for the last write
    assert [count for _, _, count, _ in saves] == [1, 2, 3, 4, 4]
    assert saves[-1][1] is False and saves[-1][3] >= saves[-2][3]  # the wait: stall time, not a fifth save


def test_the_watchdog_waits_out_the_last_background_write_after_the_last_step(tmp_path, monkeypatch):
    exits = []

    def watched(*args, **kwargs):
        exits.append(FakeExit())
        return HangWatchdog(*args, exit=exits[-1], **kwargs)

    monkeypatch.setattr(room, "HangWatchdog", watched)
    timeouts = {"hang_watchdog": True, "hang_timeout_min_s": 0.3, "hang_timeout_factor": 1.0}
    slow = WriteFault("slow", seconds=3.0)  # the final save's write outlasts the step timeout tenfold
    train(tmp_path, trainer_class=WriteFaultTrainer, write_fault=(STEPS, 0, slow), args=timeouts)
    assert (tmp_path / f"checkpoint-{STEPS}" / "write-fault.pt").exists()
    assert exits and not exits[0].called.is_set()  # waited under the save floor, not timed as a step
    assert read_attempts(tmp_path)[-1].ended == "finished"


def test_a_failed_train_lets_its_save_in_flight_finish_before_it_raises(tmp_path):
    slow = WriteFault("slow", seconds=1.0)  # checkpoint-2's write still runs when step 3 raises
    with pytest.raises(RuntimeError, match="injected at step 3"):
        train(tmp_path, fail_at=3, trainer_class=WriteFaultTrainer, write_fault=(2, 0, slow))
    assert (tmp_path / "checkpoint-2" / "write-fault.pt").exists()  # whole and in place, for a train() that follows
    assert not (tmp_path / ".saving").exists()


def test_the_same_failure_at_the_same_step_stops_the_restarts(tmp_path, monkeypatch):
    for restart in (0, 1):
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(restart))
        with pytest.raises(RuntimeError, match="injected at step 3"):
            train(tmp_path, fail_at=3, limit=2)
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    with pytest.raises(RestartLoopError, match="the last 2 attempts all failed at step 3 after resuming from step 2"):
        train(tmp_path, limit=2)
    assert [a.ended for a in read_attempts(tmp_path)][-1] == REFUSED
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")  # a person launches again: trained
    train(tmp_path, limit=2)
    assert read_attempts(tmp_path)[-1].ended == "finished"


def test_a_hang_is_recorded_at_once_when_no_restart_follows(tmp_path, monkeypatch):
    exits, recorded = [], []

    def watched(*args, **kwargs):
        exits.append(FakeExit())
        return HangWatchdog(*args, exit=exits[-1], **kwargs)

    class Hang(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == 5:
                assert exits[0].called.wait(60)  # hung until the watchdog fired (it would have exited: no restart)
                recorded.append(read_attempts(args.output_dir)[-1])
                raise RuntimeError("released")

    monkeypatch.setattr(room, "HangWatchdog", watched)
    timeouts = {"hang_watchdog": True, "hang_timeout_min_s": 1.0, "hang_timeout_factor": 1.0}
    with pytest.raises(RuntimeError, match="released"):
        train(tmp_path, callbacks=[Hang()], args=timeouts)
    (attempt,) = recorded
    assert attempt.ended.startswith("hang: no optimizer step for") and attempt.failed_rank == 0, attempt
    assert attempt.last_step == 4 and attempt.end_time is not None  # its last beat: the hang is in step 5's end


def test_a_run_resumed_from_another_folders_checkpoint_counts_no_restart(tmp_path):
    """A new output folder resuming another run's checkpoint is a new run, not a restart of this one: the
    checkpoint's age is no time it lost."""
    train(tmp_path / "first", telemetry=True)
    time.sleep(2.0)  # the checkpoint ages
    begun = time.time()
    train(tmp_path / "second", resume=str(tmp_path / "first" / "checkpoint-4"), telemetry=True)
    last = [r for r in read_jsonl(tmp_path / "second") if "goodput" in r][-1]
    assert (last["goodput_restarts"], last["goodput_restart_s"]) == (0, 0.0), last
    assert last["goodput_wall_s"] <= time.time() - begun  # this run's own time
    assert [(a.resumed_step, a.ended) for a in read_attempts(tmp_path / "second")] == [(4, "finished")]
