"""One-shot GPU check: the figures hf_pretrain claims on GPUs, measured in one run of at most ~8 minutes.

    python benchmarks/gpu_check.py                  # on a CUDA GPU: writes gpu_check.json, prints the table
    python benchmarks/gpu_check.py --dry-run        # the same code on tiny configs on a CPU (about a minute)
    python benchmarks/gpu_check.py --only mfu_bf16,straggler_2proc

Each check has a goal and ends `pass`, `fail`, `ran` (a dry run, or a device that cannot judge the
goal: the figure is printed, not judged), `skipped: <why>` (a package or a capability is missing:
"skipped: torchao not installed"), or `error: <what>` (with the traceback's end in the JSON). The
last line says what could not run and why. A check that reads back what a run measured fails when a
figure it should have is missing, on a dry run too. Each check runs in a process of its own under a timeout
(benchmarks/gpu/isolate.py): one that raises, dies (a sticky CUDA error, an abort) or hangs is an `error` row, its
processes are killed, and the next check runs in a fresh process. gpu_check.json is rewritten after every check
(`"complete": false` until the last one), so a run killed by an outer timeout keeps the rows it finished.

| check | what runs | goal (on a GPU) |
|---|---|---|
| `device_clock` | `DeviceClock` (CUDA events) around a `torch.cuda._sleep` of known length (calibrated on the host clock, benchmarks/gpu/faults.py), read while the events are still incomplete, directly and through a full `PendingIntervals` | within 10 % of the sleep, no read raises |
| `mfu_bf16` | `PretrainTrainer`, bf16, the `0.9b` preset on packed rows of 2048 tokens, eager and compiled (`torch_compile_scope="blocks"`); MFU, tokens/s and step time read from the run's telemetry.jsonl | compiled `mfu_spec` >= 0.50 |
| `fp8_vs_bf16` | the `1.4b` preset, seq 2048, decoder layers compiled, bf16 autocast vs torchao fp8 linears; tokens/s from CUDA events | fp8 / bf16 >= 1.25 |
| `flex_vs_sdpa` | one sliding-window attention layer (the `0.9b` preset's W = 1024, seq 2048), forward + backward: flex (block-sparse window) vs SDPA with the dense window mask | SDPA time / flex time >= 2 |
| `packed_equality` | packed rows of several documents vs each document alone, on `sdpa` and `flex_attention`, in the device dtype | max abs logit diff <= 2 % of the logits' range (bf16), 1e-4 (fp32) |
| `memory_estimate` | one fp32 training step of the `1.4b` preset (seq 2048, batch 2, fused AdamW) | `estimate_memory` within +-10 % of `torch.cuda.max_memory_allocated` |
| `step_time_events` | `ThroughputCallback`'s `step_time_s` (CUDA events) around bf16 steps vs the synchronised wall time and the host's enqueue time | events within 5 % of the synchronised wall time |
| `straggler_2proc` | `PretrainTrainer`, 2 processes on the one GPU (DDP over gloo), rank 1 slowed inside its linears (`torch.cuda._sleep`, benchmarks/gpu/faults.py) | the DDP rule and the linears' rule both name rank 1 |
| `telemetry_overhead` | `gpt2-124m` bf16 steps with every callback on vs extras off, alternated (benchmarks/telemetry_overhead.py) | ratio <= 1.01 |
| `async_staging` | `gpt2-124m`'s fp32 weights and AdamW states saved asynchronously (`BackgroundSaves`): first with the step's update still queued behind a device sleep (the copy stream must wait on the step's event), then a second save timed synchronised against the same step without one, and a synchronous `torch.save` | the files equal the state of their own step; stall of the second save / synchronous save <= 0.1 |
| `parallel_2gpu` | 2 CUDA GPUs only (skipped with fewer: this workplace lends one): tests/distributed/dist_run.py under `torchrun`/`accelerate launch` for Ulysses SP=2 (ZeRO-3), DeepSpeed AutoTP=2, accelerate `tp_size=2` and `cp_size=2` (FSDP2), each against one process, fp32 | each loss within 1e-5 of one process's, tokens counted once |

One module per check in benchmarks/gpu/. Packages: `mfu_bf16`, `straggler_2proc`, `parallel_2gpu` (and deepspeed),
`telemetry_overhead` and `async_staging` need `datasets` (`PretrainTrainer` imports the data chain), `fp8_vs_bf16` needs
`torchao`; nothing imports them at module import time, and a missing one skips only the checks that
need it. hf_pretrain is imported from this checkout (the parent folder) when it is not installed.
transformers older than setup.cfg's floor is tried anyway and named in the env row and in any error.
benchmarks/gpu_wheels.sh builds the wheels to carry to a GPU machine without network (docs/benchmarks.md).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the checkout travels without being installed; benchmarks/ imports from it
    sys.path.insert(0, str(ROOT))

from benchmarks.gpu.common import DRY, Sizes  # noqa: E402
from benchmarks.gpu.isolate import check, run_isolated  # noqa: E402

# The order a 15-minute try runs them in: what settles the most first (the clock every figure rests on, the
# asynchronous save no GPU has measured yet, MFU, the precision claim), the slow or repeat measurements last.
# The seconds: each check's timeout on a GPU (a dry run allows 3x, its CPU is slower).
CHECKS = {
    "env": 60,
    "device_clock": 60,
    "async_staging": 120,
    "step_time_events": 90,
    "mfu_bf16": 240,
    "fp8_vs_bf16": 150,
    "memory_estimate": 90,
    "packed_equality": 60,
    "flex_vs_sdpa": 90,
    "straggler_2proc": 150,
    "telemetry_overhead": 150,
    "parallel_2gpu": 480,  # 5 launches (one process, SP, AutoTP, accelerate TP and CP) of at most 150 s each
}


def not_run(rows: list[dict]) -> str:
    """One line: the checks that could not run here, and why."""
    lacking = [
        f"{r['check']} ({r['status'].split(': ', 1)[1]})" for r in rows if r["status"].startswith(("skipped", "error"))
    ]
    return "could not run: " + ("; ".join(lacking) if lacking else "none, every check ran")


def print_table(rows: list[dict]) -> None:
    width = 118
    print(f"{'check':<20}{'status':<10}{'seconds':>8}  result / goal")
    print("-" * width)
    for row in rows:
        status = row["status"] if len(row["status"]) <= 8 else row["status"].split(":")[0]
        print(f"{row['check']:<20}{status:<10}{row['seconds']:>8.1f}  {row['result'] or row['status']}")
        if row["check"] != "env":
            shown = status == row["status"] or not row["result"]  # a skip's or an error's text is shown above
            print(f"{'':<38}goal: {row['goal']}" + ("" if shown else f"  [{row['status']}]"))
    print(not_run(rows))


def write_report(path: Path, dry_run: bool, rows: list[dict], complete: bool) -> None:
    """gpu_check.json as it stands: written after every check, so that a run killed mid-way (the one-shot GPU
    try runs under `timeout`) keeps every row it finished; `complete` says whether every check ran."""
    report = {"dry_run": dry_run, "time": time.time(), "complete": complete, "checks": rows, "not_run": not_run(rows)}
    path.write_text(json.dumps(report, indent=2, default=str))


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="tiny configs on the CPU: the same code, no goals")
    parser.add_argument("--only", default=None, help=f"comma-separated checks of {list(CHECKS)}")
    parser.add_argument("--out", default="gpu_check.json", help="where the JSON goes (default ./gpu_check.json)")
    parser.add_argument("--workdir", default=None, help="scratch directory (default: a temporary one)")
    parser.add_argument("--worker", choices=["straggler"], help=argparse.SUPPRESS)
    parser.add_argument("--row-timeout", type=float, default=None, help="seconds per check (default: CHECKS' own)")
    a = parser.parse_args(argv)
    sizes = DRY if a.dry_run else Sizes()
    if a.worker:
        check("straggler_2proc").worker(Path(a.workdir), sizes, cuda=not a.dry_run and torch.cuda.is_available())
        return []
    if not a.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA GPU here: run with --dry-run (tiny configs on the CPU) or on a GPU machine")
    names = ["env", *[n for n in (a.only.split(",") if a.only else CHECKS) if n != "env"]]
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        parser.error(f"--only names unknown checks {unknown}; use any of {list(CHECKS)}")
    device = "cpu" if a.dry_run else "cuda"
    with tempfile.TemporaryDirectory() as tmp:
        workdir = Path(a.workdir or tmp)
        workdir.mkdir(parents=True, exist_ok=True)
        rows = []
        for name in names:
            timeout = a.row_timeout or CHECKS[name] * (3 if a.dry_run else 1)
            rows.append(run_isolated(name, device, a.dry_run, workdir, timeout))
            write_report(Path(a.out), a.dry_run, rows, complete=len(rows) == len(names))
            print(f"[{rows[-1]['seconds']:6.1f} s] {name}: {rows[-1]['status']} {rows[-1]['result']}", flush=True)
    print()
    print_table(rows)
    print(f"\nwrote {a.out}")
    return rows


if __name__ == "__main__":
    main()
