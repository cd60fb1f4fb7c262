"""Each check of gpu_check in a process of its own, under a timeout, killed with everything it started.

One process for all checks let one check take the others down: a sticky CUDA error (an illegal address in the fp8
or flex check) poisons every later CUDA call of the process, a hang holds the one 15-minute GPU try until the outer
`timeout` kills it, and the checks after it never run. Here the parent process never touches the device: it starts
each check in a child that leads a session of its own (so the straggler check's ranks and any compile workers go
with it), waits at most the check's timeout, reads the row the child wrote, and in a `finally` kills the child's
whole process group. A child that raises writes an `error` row itself; one that dies (abort, segfault, OOM kill)
or hangs is given one by the parent (`error: process died with ...` / `error: timeout after N s`), and the next
check runs in a fresh process.

Children are forked on a dry run (the parent has imported torch but never CUDA: the CPU checks start in
milliseconds instead of re-importing transformers each) and spawned on a GPU (CUDA must not be forked).

`GPU_CHECK_FAULTS="name=raise,other=hang"` (also `crash`: `os.abort()`, as a sticky CUDA error ends a process) makes
those checks fail on purpose: how tests/test_gpu_check.py shows that a check that raises, dies or hangs leaves
every other row's figure intact.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import multiprocessing
import os
import signal
import sys
import time
import traceback
from pathlib import Path

from benchmarks.gpu.common import Context, Skip, free_memory, transformers_note

FAULTS_ENV = "GPU_CHECK_FAULTS"


def injected_fault(name: str) -> str | None:
    faults = dict(item.split("=", 1) for item in os.environ.get(FAULTS_ENV, "").split(",") if "=" in item)
    return faults.get(name)


def act(fault: str | None) -> None:
    if fault == "raise":
        raise RuntimeError("injected by GPU_CHECK_FAULTS")
    if fault == "crash":
        os.abort()
    if fault == "hang":
        while True:
            time.sleep(60)


def child(name: str, device: str, dry_run: bool, workdir: str, out: str) -> None:
    """The check's process: its own session, the row written to `out` (staged, then renamed)."""
    os.setsid()
    import torch

    from benchmarks.gpu.common import DRY, Sizes

    ctx = Context(torch.device(device), DRY if dry_run else Sizes(), dry_run, Path(workdir))
    row = run_check(name, ctx, before=lambda: act(injected_fault(name)))
    staged = Path(f"{out}.tmp")
    staged.write_text(json.dumps(row, default=str))
    staged.replace(out)


def check(name: str):
    return importlib.import_module(f"benchmarks.gpu.{name}")


def run_check(name: str, ctx: Context, before=lambda: None) -> dict:
    """One check in this process (`run_isolated` runs it in a child of its own); `before` runs inside its `try`."""
    start = time.perf_counter()
    goal = "-"
    try:
        module = check(name)
        goal = module.GOAL
        before()
        row = module.run(ctx)
        status = {True: "pass", False: "fail", None: "ran"}[row["pass"]] if name != "env" else "-"
    except Skip as skip:
        row, status = {"result": "", "value": None, "pass": None}, f"skipped: {skip}"
    except ModuleNotFoundError as err:
        row, status = {"result": "", "value": None, "pass": None}, f"skipped: {err.name} not installed"
    except Exception as err:  # one check's failure never stops the others
        trace = traceback.format_exc()
        row = {"result": "", "value": None, "pass": False, "details": {"traceback": trace[-4000:]}}
        status = f"error: {type(err).__name__}: {str(err)[:300]} [{transformers_note()}]"
        print(trace, file=sys.stderr)
    free_memory()
    return {"check": name, "goal": goal, **row, "status": status, "seconds": round(time.perf_counter() - start, 1)}


def kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):  # gone already
        os.killpg(pid, signal.SIGKILL)


def run_isolated(name: str, device: str, dry_run: bool, workdir: Path, timeout_s: float) -> dict:
    """The check's row, measured in a child process; an error row when the child died or outlived `timeout_s`."""
    out = workdir / f"row-{name}.json"
    out.unlink(missing_ok=True)
    if dry_run:
        warm_imports()
    context = multiprocessing.get_context("fork" if dry_run else "spawn")
    process = context.Process(target=child, args=(name, device, dry_run, str(workdir), str(out)), name=name)
    start = time.perf_counter()
    process.start()
    try:
        process.join(timeout_s)
        if out.exists():
            return json.loads(out.read_text())
        if process.is_alive():
            problem = f"timeout after {timeout_s:.0f} s (the check's process and its children were killed)"
        else:
            problem = f"process died with {exit_text(process.exitcode)}"
        return {"check": name, "goal": "-", "result": "", "value": None, "pass": False, "status": f"error: {problem}",
                "seconds": round(time.perf_counter() - start, 1)}  # fmt: skip
    finally:
        kill_group(process.pid)  # its ranks and compile workers too, whatever became of it
        process.join(10)


def warm_imports() -> None:
    """What every check imports, imported once in the parent of a dry run, so each forked check starts warm (no
    CUDA is touched by an import). A package this machine lacks is left to the checks that need it: they skip."""
    for name in ("transformers", "datasets", "hf_pretrain.training.trainer"):  # the trainer imports datasets
        with contextlib.suppress(ModuleNotFoundError):
            importlib.import_module(name)


def exit_text(code: int | None) -> str:
    if code is not None and code < 0:
        return f"signal {signal.Signals(-code).name}"
    return f"exit code {code}"
