"""benchmarks/gpu_check.py runs: its dry run on this CPU, and without the packages a bare GPU machine lacks.

The dry run executes every check's code on tiny configs (the GPU goals are printed, not judged), so the
one-shot GPU script cannot rot between the sessions that have a GPU: every figure a run measures is read back
the way the GPU run reads it (telemetry.jsonl), and a figure that should be there and is not fails. The
second test hides `datasets` and `torchao` the way a machine without them looks (not on the path at all) and
checks that only the checks needing them are skipped, each saying what to carry.
"""

import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
CHECKS = {
    "env",
    "device_clock",
    "mfu_bf16",
    "fp8_vs_bf16",
    "flex_vs_sdpa",
    "packed_equality",
    "memory_estimate",
    "step_time_events",
    "straggler_2proc",
    "telemetry_overhead",
    "async_staging",
    "parallel_2gpu",
}


def run(args, cwd, env=None, python=(sys.executable,)):
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.run([*python, str(SCRIPT), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_dry_run_runs_every_check_and_reads_back_every_figure_on_a_cpu(tmp_path):
    proc = run(["--dry-run", "--out", str(tmp_path / "gpu_check.json")], cwd=tmp_path)
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    rows = {row["check"]: row for row in report["checks"]}
    assert report["dry_run"] is True and report["complete"] is True and set(rows) == CHECKS
    assert not [row for row in rows.values() if row["status"].startswith(("error", "fail"))], rows
    for row in rows.values():
        assert row["goal"] and "seconds" in row and row["status"] and "MISSING" not in row["result"]
    # the MFU row reads what the runs measured from their telemetry.jsonl, eager and compiled: every figure, mfu_spec
    # included (a CPU has no chip-table peak: the runs are given this CPU's ceiling as peak_tflops, and say so)
    mfu = rows["mfu_bf16"]
    assert mfu["details"]["missing"] == [] and "compiled (blocks, eager)" in mfu["result"]
    assert "not a chip-table peak" in mfu["result"] and mfu["details"]["peak_tflops_given"] > 0
    for name in ("eager", "compiled"):
        figures = mfu["details"][name]
        keys = ("mfu_spec", "mfu_measured", "tokens_per_second", "step_time_s", "peak_tflops_measured")
        assert all(figures[key] > 0 for key in keys), figures
    # the carried packages are imported for real, each outcome named; the device clock needs CUDA
    assert rows["env"]["details"]["imports"]["transformers"] == "ok"
    assert rows["env"]["details"]["imports"]["datasets"] == "ok"
    assert rows["device_clock"]["status"].startswith("skipped: no CUDA")
    # the 2-GPU row builds its launches and checks PretrainingArguments lets tp_size/cp_size through off a CPU, then
    # skips: it never launches on a dry run
    assert rows["parallel_2gpu"]["status"] == "skipped: needs 2 CUDA GPUs (this machine has 0)"
    # what is judged on a CPU too: two CPU ranks, rank 1 slowed inside its linears, are told apart for real by
    # both rules (DDP's compute and the linears' local_s that ZeRO-3 and FSDP2 are judged on)
    straggler = rows["straggler_2proc"]
    assert straggler["status"] == "pass" and "rank 1 (" in straggler["result"]
    assert all(d["rank1_local_s"] > d["rank0_local_s"] > 0 for d in straggler["details"])
    # packed documents give the logits they get alone (exact on a CPU in fp32), and the check can fail: without
    # restarting positions the documents leak into each other
    (sdpa,) = [r for b, r in rows["packed_equality"]["details"].items() if b == "sdpa"]
    assert sdpa["max_abs_diff"] <= sdpa["tolerance"] < sdpa["leak_without_positions"]
    # on a CPU the device clock is the host clock: the callback's step time is the synchronised wall time
    assert rows["step_time_events"]["value"] == pytest.approx(1.0, abs=0.05)
    # the memory estimate prices the loss the model runs; there is no CUDA allocator to read back on a CPU
    memory = rows["memory_estimate"]
    assert memory["details"]["total"] > 0 and "no CUDA allocator" in memory["result"]
    assert memory["details"]["chunked_loss"] is (rows["env"]["details"]["chunked_loss"] != "none")
    overhead = rows["telemetry_overhead"]["details"]
    assert overhead["ratio"] > 0 and len(overhead["round_ratios"]) == 1 and overhead["steps"] > 0
    # an asynchronous save writes its own step's state though its copy ran beside the next step (judged on a CPU
    # too), and the check can fail: the state after that step differs
    staging = rows["async_staging"]["details"]
    assert staging["equal"] and staging["moved"] and staging["beside"] == 2 and rows["async_staging"]["pass"] is None
    assert staging["alone_s"] > 0 and staging["with_save_s"] > 0 and staging["sync_s"] > 0  # a second save, timed
    # the GPU goals are printed, not judged, on a dry run
    judged = ("mfu_bf16", "fp8_vs_bf16", "memory_estimate", "step_time_events", "telemetry_overhead")
    assert all(rows[n]["pass"] is None for n in judged)
    assert re.search(r"straggler_2proc\s+pass", proc.stdout) and "goal: fp8 / bf16 tokens/s >= 1.25" in proc.stdout
    # one line says what could not run here and why (on this CPU: flex, which has no backward here)
    skipped = [name for name, row in rows.items() if row["status"].startswith("skipped")]
    assert report["not_run"].startswith("could not run: ") and report["not_run"] in proc.stdout
    assert all(f"{name} ({rows[name]['status'].split(': ', 1)[1]})" in report["not_run"] for name in skipped)


def load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_killed_run_keeps_the_rows_it_finished(tmp_path, monkeypatch):
    """gpu_check.json is written after every row: a run stopped in its third check (the GPU try's `timeout`) has
    the first two in it, marked incomplete."""
    gpu_check = load_gpu_check()

    def run_isolated(name, device, dry_run, workdir, timeout_s):
        if name == "flex_vs_sdpa":
            raise KeyboardInterrupt  # killed mid-check
        return {"check": name, "goal": "-", "result": "r", "value": None, "pass": None, "status": "ran", "seconds": 0}

    monkeypatch.setattr(gpu_check, "run_isolated", run_isolated)
    out = tmp_path / "gpu_check.json"
    with pytest.raises(KeyboardInterrupt):
        gpu_check.main(["--dry-run", "--only", "mfu_bf16,flex_vs_sdpa", "--out", str(out)])
    report = json.loads(out.read_text())
    assert [row["check"] for row in report["checks"]] == ["env", "mfu_bf16"] and report["complete"] is False


def test_a_check_that_raises_dies_or_hangs_leaves_every_other_rows_figure(tmp_path):
    """Each check runs in a process of its own under a timeout: a check that raises, one that aborts (as a sticky
    CUDA error ends a process) and one that hangs are error rows, the hung one's process is killed, and the check
    after them measures its figure in a fresh process."""
    import psutil

    faults = "async_staging=hang,step_time_events=crash,memory_estimate=raise"
    before = {p.pid for p in psutil.process_iter()}
    only = "async_staging,step_time_events,memory_estimate,packed_equality"
    proc = run(
        ["--dry-run", "--only", only, "--row-timeout", "20", "--out", str(tmp_path / "gpu_check.json")],
        cwd=tmp_path,
        env={"GPU_CHECK_FAULTS": faults},
    )
    rows = {row["check"]: row for row in json.loads((tmp_path / "gpu_check.json").read_text())["checks"]}
    assert rows["async_staging"]["status"].startswith("error: timeout after 20 s"), rows["async_staging"]
    assert rows["step_time_events"]["status"] == "error: process died with signal SIGABRT"
    assert (
        rows["memory_estimate"]["status"]
        == "error: RuntimeError: injected by GPU_CHECK_FAULTS"
        + (rows["memory_estimate"]["status"].split("GPU_CHECK_FAULTS", 1)[1])
    )
    packed = rows["packed_equality"]  # after all three, in a fresh process: its figure is there
    assert (
        packed["status"] == "ran"
        and packed["details"]["sdpa"]["max_abs_diff"] <= packed["details"]["sdpa"]["tolerance"]
    )
    assert "could not run: async_staging (timeout after 20 s" in proc.stdout
    left = [
        p for p in psutil.process_iter(["cmdline"]) if p.pid not in before and "gpu_check" in str(p.info["cmdline"])
    ]
    assert not left, left  # the hung check's process is gone


def test_the_env_row_names_each_failing_import_and_goes_on(tmp_path, monkeypatch):
    from benchmarks.gpu import env

    (tmp_path / "refusing.py").write_text("raise ImportError('needs pyarrow >= 24, found 19.0')\n")
    (tmp_path / "half.py").write_text("import not_a_module_anywhere\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert env.try_import("refusing") == "ImportError: needs pyarrow >= 24, found 19.0"
    assert env.try_import("half").startswith("ModuleNotFoundError: No module named 'not_a_module_anywhere'")
    assert env.try_import("not_installed_here") == "not installed" and env.try_import("json") == "ok"


def test_the_slow_rank_calibrates_its_sleep_when_registered_not_in_the_forward(monkeypatch):
    """Calibrating inside the first forward would time the sleep while the other rank trains on the same GPU."""
    from benchmarks.gpu import faults

    calls = []
    monkeypatch.setattr(faults, "sleep_cycles_per_second", lambda index=0: calls.append(index) or 1e9)
    monkeypatch.setenv("RANK", "1")
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    assert faults.slow_linears(model, 1, 0.01, device="cuda:0") == 2 and calls == [0]  # once, before any forward
    assert faults.slow_linears(model, 1, 0.01) == 2 and calls == [0]  # a CPU model spins on the host: no kernel


class PendingEvent:
    """A CUDA event on a CPU: incomplete until synchronised; `elapsed_time` raises on an incomplete one, as torch."""

    def __init__(self, at: float):
        self.at, self.complete = at, False

    def query(self) -> bool:
        return self.complete

    def synchronize(self) -> None:
        self.complete = True

    def elapsed_time(self, end: "PendingEvent") -> float:
        if not (self.complete and end.complete):
            raise RuntimeError("Both events must be completed before calculating elapsed time.")
        return (end.at - self.at) * 1000.0


@pytest.mark.parametrize(
    "stretch, early, problem",
    [(1.0, False, None), (1.2, False, "ms for a 50 ms sleep"), (1.0, True, "reading raised RuntimeError: Both events")],
)
def test_the_device_clock_row_fails_a_wrong_or_raising_read(monkeypatch, stretch, early, problem):
    """The row's logic on fake events: a sleep read right passes, one 20 % long fails, and a clock that reads an
    incomplete event without waiting (the bug the row guards against) fails with torch's error, directly and
    through a full PendingIntervals."""
    from benchmarks.gpu import device_clock, faults
    from hf_pretrain.telemetry.timing import DeviceClock

    now = [0.0]
    clock = DeviceClock("cpu")
    clock.cuda, clock.mark = True, lambda: PendingEvent(now[0])
    if early:
        clock.seconds = lambda start, end: start.elapsed_time(end) / 1000.0
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    sleep = lambda seconds, device=None: now.__setitem__(0, now[0] + stretch * seconds)  # noqa: E731
    monkeypatch.setattr(faults, "device_sleep", sleep)
    for forced in (False, True):
        reading = device_clock.read_incomplete(clock, 0.05, torch.device("cpu"), forced)
        assert reading["incomplete"]
        found = device_clock.judge(reading)
        assert found is None if problem is None else problem in found, found


def test_the_gpu_check_imports_nothing_from_the_tests():
    sources = [ROOT / "benchmarks" / "gpu_check.py", *sorted((ROOT / "benchmarks" / "gpu").glob("*.py"))]
    for path in sources:
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            names += [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            assert not [n for n in names if n == "tests" or n.startswith("tests.")], path


def site_without(packages: set[str], dest: Path) -> Path:
    """This interpreter's site-packages as links, minus `packages`: what a machine without them imports from."""
    dest.mkdir()
    site = Path(sysconfig.get_paths()["purelib"])
    normal = lambda name: re.sub(r"[-_.]+", "_", name.split("-")[0].removesuffix(".py")).lower()  # noqa: E731
    for entry in site.iterdir():
        if normal(entry.name) not in packages and entry.suffix != ".pth":
            (dest / entry.name).symlink_to(entry)
    return dest


@pytest.mark.exhaustive  # make test: the dry run with every package present (above)
def test_without_datasets_and_torchao_only_their_checks_are_skipped(tmp_path):
    site = site_without({"datasets", "torchao", "deepspeed"}, tmp_path / "site")
    env = {"PYTHONPATH": str(site)}  # not even hf_pretrain: the script finds this checkout itself
    only = "mfu_bf16,fp8_vs_bf16,packed_equality,straggler_2proc"
    run(["--dry-run", "--only", only, "--out", "gpu_check.json"], cwd=tmp_path, env=env, python=(sys.executable, "-S"))
    rows = {row["check"]: row for row in json.loads((tmp_path / "gpu_check.json").read_text())["checks"]}
    assert "not installed: datasets, torchao" in rows["env"]["result"]
    assert rows["fp8_vs_bf16"]["status"].startswith("skipped: torchao not installed")
    for name in ("mfu_bf16", "straggler_2proc"):
        assert rows[name]["status"].startswith("skipped: datasets not installed (PretrainTrainer imports")
        assert "carry the wheels, docs/benchmarks.md" in rows[name]["status"]
    assert rows["packed_equality"]["status"] == "ran"  # the model, the masks and the collator need neither


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_quick_gpu_checks_pass_on_a_gpu(tmp_path):
    run(["--only", "packed_equality,step_time_events", "--out", str(tmp_path / "gpu_check.json")], cwd=tmp_path)
    rows = {row["check"]: row for row in json.loads((tmp_path / "gpu_check.json").read_text())["checks"]}
    assert rows["packed_equality"]["status"] == "pass" and rows["step_time_events"]["status"] == "pass"
