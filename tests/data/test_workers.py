"""`kill -9` of `hf-pretrain data prepare` in the middle of a stage leaves no process behind (the executor's manager
and its pool of tasks)."""

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from hf_pretrain.data import embedded_documents
from hf_pretrain.data.workers import children_die_with_parent

DEADLINE_S = 240


def corpus(folder, copies: int = 12, files: int = 2) -> None:
    """Distinct documents (each copy numbered) so that every step has real work for a few seconds, in `files` files
    (a task reads whole files: two tasks need two)."""
    docs = embedded_documents()
    folder.mkdir()
    for part in range(files):
        with (folder / f"part-{part}.jsonl").open("w") as f:
            for copy in range(part, copies, files):
                for i, doc in enumerate(docs):
                    f.write(json.dumps({"text": f"Copy {copy} of {i}.\n{doc}", "id": f"{copy}-{i}"}) + "\n")


def alive(process: psutil.Process) -> bool:
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def forked(parent: psutil.Process) -> list[psutil.Process]:
    """Children forked from `parent` (same command line): pool workers and the pool's manager."""
    out = []
    for child in parent.children():
        with contextlib.suppress(psutil.Error):
            if child.cmdline() == parent.cmdline() and alive(child):
                out.append(child)
    return out


def stop_in_step(proc: subprocess.Popen, out, step: str, num_proc: int) -> list[psutil.Process] | None:
    """Freeze `proc` (SIGSTOP) once the executor runs `step`: its manager and, with `num_proc` tasks at once, its pool
    workers are up. Returns every descendant; while the parent is stopped, no worker can be told to finish. None when
    the stage was missed: the chain went past `step` (or ended) between two looks, as on a loaded machine."""
    parent = psutil.Process(proc.pid)
    deadline, children = time.monotonic() + DEADLINE_S, num_proc + 1 if num_proc > 1 else 1
    while time.monotonic() < deadline and proc.poll() is None:
        steps = sorted(p.name for p in (out / "logs").iterdir()) if (out / "logs").exists() else []
        if steps and steps[-1] > step:
            return None
        if steps and steps[-1] == step and len(forked(parent)) >= children:
            os.kill(proc.pid, signal.SIGSTOP)
            if len(forked(parent)) >= children:
                return parent.children(recursive=True)
            os.kill(proc.pid, signal.SIGCONT)
        time.sleep(0.02)
    return None


def launch_prepare(folder, num_proc: int) -> subprocess.Popen:
    folder.mkdir()
    corpus(folder / "raw")
    config = {
        "input": str(folder / "raw"),
        "output_dir": str(folder / "out"),
        "num_proc": num_proc,
        "tokenizer": {"vocab_size": 300},
        "pack": {"seq_len": 64},
    }
    (folder / "pipeline.json").write_text(json.dumps(config))
    (folder / "out").mkdir()
    env = {**os.environ, "HF_DATASETS_CACHE": str(folder / "cache"), "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.Popen(
        [sys.executable, "-m", "hf_pretrain.cli", "data", "prepare", str(folder / "pipeline.json")],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


ATTEMPTS = 3  # a launch whose map was missed is replaced by a fresh one (a missed window is no result)


@pytest.mark.parametrize("num_proc, step", [(1, "01-documents"), (2, "01-documents"), (2, "05-pack")])
def test_killed_prepare_leaves_no_process_behind(tmp_path, num_proc, step):
    for attempt in range(ATTEMPTS):
        proc = launch_prepare(tmp_path / f"attempt-{attempt}", num_proc)
        descendants = []
        try:
            descendants = stop_in_step(proc, tmp_path / f"attempt-{attempt}" / "out", step, num_proc)
            if descendants is None:
                continue
            proc.kill()
            proc.wait(timeout=30)
            deadline = time.monotonic() + 10
            while any(alive(p) for p in descendants) and time.monotonic() < deadline:
                time.sleep(0.05)
            left = [p.pid for p in descendants if alive(p)]
            assert not left, f"{len(left)} of {len(descendants)} worker processes survived kill -9 of prepare: {left}"
            return
        finally:
            for p in [*(descendants or []), psutil.Process(proc.pid) if proc.poll() is None else None]:
                if p is not None and alive(p):
                    p.kill()  # only what this test started
            proc.wait(timeout=30)
    pytest.fail(f"no map with {num_proc} worker(s) seen in step {step} in {ATTEMPTS} launches of prepare")


def death_signal_of_a_fork() -> int:
    """The parent-death signal a child forked now has (Linux PR_GET_PDEATHSIG), read in the child."""
    pid = os.fork()
    if pid == 0:
        value = ctypes.c_int(-1)
        ctypes.CDLL(None).prctl(2, ctypes.byref(value), 0, 0, 0)  # PR_GET_PDEATHSIG
        os._exit(value.value)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux only")
def test_only_forks_inside_the_block_are_armed():
    assert death_signal_of_a_fork() == 0
    with children_die_with_parent():
        with children_die_with_parent():  # re-entrant
            assert death_signal_of_a_fork() == signal.SIGKILL
        assert death_signal_of_a_fork() == signal.SIGKILL
    assert death_signal_of_a_fork() == 0
