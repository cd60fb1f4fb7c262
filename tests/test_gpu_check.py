"""benchmarks/gpu_check.py runs: its dry run on this CPU, and without the packages a bare GPU machine lacks.

The dry run executes every check's code on tiny configs (the GPU goals are printed, not judged), so the
one-shot GPU script cannot rot between the sessions that have a GPU: every figure a run measures is read back
the way the GPU run reads it (telemetry.jsonl), and a figure that should be there and is not fails. The
second test hides `datasets` and `torchao` the way a machine without them looks (not on the path at all) and
checks that only the checks needing them are skipped, each saying what to carry.
"""

import ast
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
    "mfu_bf16",
    "fp8_vs_bf16",
    "flex_vs_sdpa",
    "packed_equality",
    "memory_estimate",
    "step_time_events",
    "straggler_2proc",
    "telemetry_overhead",
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
    assert report["dry_run"] is True and set(rows) == CHECKS
    assert not [row for row in rows.values() if row["status"].startswith(("error", "fail"))], rows
    for row in rows.values():
        assert row["goal"] and "seconds" in row and row["status"] and "MISSING" not in row["result"]
    # the MFU row reads what the runs measured from their telemetry.jsonl, eager and compiled: every figure a CPU
    # can give is there (mfu_spec needs a chip-table peak, which a CPU has not: named, not blamed on a GPU)
    mfu = rows["mfu_bf16"]
    assert mfu["details"]["missing"] == [] and "compiled (blocks, eager)" in mfu["result"]
    for name in ("eager", "compiled"):
        figures = mfu["details"][name]
        assert all(figures[key] > 0 for key in ("mfu_measured", "tokens_per_second", "step_time_s")), figures
        assert figures["mfu_spec"] is None and figures["peak_tflops_measured"] > 0
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
    # the GPU goals are printed, not judged, on a dry run
    judged = ("mfu_bf16", "fp8_vs_bf16", "memory_estimate", "step_time_events", "telemetry_overhead")
    assert all(rows[n]["pass"] is None for n in judged)
    assert re.search(r"straggler_2proc\s+pass", proc.stdout) and "goal: fp8 / bf16 tokens/s >= 1.25" in proc.stdout
    # one line says what could not run here and why (on this CPU: flex, which has no backward here)
    skipped = [name for name, row in rows.items() if row["status"].startswith("skipped")]
    assert report["not_run"].startswith("could not run: ") and report["not_run"] in proc.stdout
    assert all(f"{name} ({rows[name]['status'].split(': ', 1)[1]})" in report["not_run"] for name in skipped)


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
