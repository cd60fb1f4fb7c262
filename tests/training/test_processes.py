"""Leaving a gloo process group at exit: the group is destroyed and the exit waits until gloo's threads are idle
(hf_pretrain/training/processes.py). Each case runs in a fresh interpreter with a real one-rank gloo group, so the
test session itself never holds one."""

import json
import subprocess
import sys
import textwrap

import pytest

from hf_pretrain.training.processes import TASKS
from tests.distributed.test_distributed import ENV, ROOT, free_port

pytestmark = pytest.mark.skipif(not TASKS.is_dir(), reason="reads thread states from /proc (Linux)")

SCRIPT = """
import json, os, time, torch, torch.distributed as dist
from hf_pretrain.training.processes import gloo_thread_states, leave_process_group
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="{port}")
dist.init_process_group("gloo", rank=0, world_size=1)
held = dist.group.WORLD if {hold} else None  # as a DDP module holds it: the group outlives its destruction
tensor = torch.ones(8)
dist.all_reduce(tensor)
deadline = time.monotonic() + 10
while len(gloo_thread_states()) < 3 and time.monotonic() < deadline:  # each thread names itself once it runs
    time.sleep(0.01)
before = gloo_thread_states()
settled = leave_process_group()
after = gloo_thread_states()
print(json.dumps({{"before": before, "after": after, "settled": settled, "initialized": dist.is_initialized()}}))
"""


def leave(hold: bool) -> dict:
    script = textwrap.dedent(SCRIPT.format(port=free_port(), hold=hold))
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_gloo_threads_are_found_by_name_and_end_with_a_group_nothing_holds():
    result = leave(hold=False)
    assert len(result["before"]) >= 3  # 2 workers and the transport loop: the names the settling looks for
    assert not result["initialized"] and result["after"] == []  # destroyed: its threads joined


def test_a_group_still_held_leaves_its_threads_idle_at_exit():
    result = leave(hold=True)
    assert len(result["after"]) == len(result["before"]) >= 3  # alive until the process ends
    # none running or runnable in the last three checks before the interpreter goes on to finalize. (Not a fresh
    # read after them: an idle transport thread may wake for a moment on a loaded machine; that read was flaky.)
    assert result["settled"]


TRAINER_SCRIPT = """
import atexit, torch.distributed as dist
from hf_pretrain import PretrainForCausalLM, PretrainingArguments, PretrainTrainer
from tests.conftest import small_config
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
# atexit runs last-in first-out: registered before the trainer, this looks after the trainer's own exit work
atexit.register(lambda: print("group at exit:", "kept" if dist.is_initialized() else "left", flush=True))
args = PretrainingArguments(output_dir="{out}", report_to="none", use_cpu=True, pretrain_extras={extras})
PretrainTrainer(model=PretrainForCausalLM(small_config()), args=args)
"""


@pytest.mark.parametrize("extras", [True, pytest.param(False, marks=pytest.mark.exhaustive)])
def test_a_script_that_never_leaves_its_group_is_left_by_the_trainer_at_exit(tmp_path, extras):
    script = textwrap.dedent(TRAINER_SCRIPT.format(port=free_port(), out=tmp_path, extras=extras))
    proc = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"group at exit: {'left' if extras else 'kept'}" in proc.stdout  # extras off: plain Trainer, untouched


@pytest.mark.parametrize(
    "readings, expected_reads",
    [
        ([[]], 1),  # no gloo thread: returns at once
        ([["S"], ["S"], ["S"], ["S"]], 4),  # idle: three quiet checks after the first look
        ([["R", "S"], ["R"], ["S", "S"], ["R", "S"], ["S"], ["S"], ["S"], ["S"]], 7),  # each running one restarts it
    ],
)
def test_the_exit_waits_for_three_quiet_checks_in_a_row(monkeypatch, readings, expected_reads):
    from hf_pretrain.training import processes

    reads = iter(readings)
    seen = []
    monkeypatch.setattr(processes, "gloo_thread_states", lambda: seen.append(1) or next(reads))
    monkeypatch.setattr(processes.time, "sleep", lambda seconds: None)
    assert processes.settle_gloo_threads() is True  # idle seen (no gloo thread: nothing to settle)
    assert len(seen) == expected_reads


def test_the_exit_wait_is_bounded(monkeypatch):
    from hf_pretrain.training import processes

    clock = iter(range(0, 1000, 1))  # one second a look
    monkeypatch.setattr(processes, "gloo_thread_states", lambda: ["R"])  # a thread that never goes idle
    monkeypatch.setattr(processes.time, "sleep", lambda seconds: None)
    monkeypatch.setattr(processes.time, "monotonic", lambda: next(clock))
    assert processes.settle_gloo_threads(timeout_s=5) is False  # timed out, not idle
    assert next(clock) <= 8  # stopped at the deadline, not after 1000 looks
