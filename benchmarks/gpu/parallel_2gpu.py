"""`parallel_2gpu`: tensor, sequence and context parallelism on 2 CUDA GPUs (NCCL), each against one process.

Cannot run in this workplace: its lent device is ONE GPU, and NCCL refuses two ranks on one device (gloo would
only repeat the CPU tests). The row is for a user's node of 2 or more GPUs; with fewer it reports
`skipped: needs 2 CUDA GPUs (this machine has N)`. Not yet run on a GPU.

It launches tests/distributed/dist_run.py from this checkout (the short run the CPU tests launch on gloo: the tiny
preset, 6 steps of 8 rows of 32 tokens, fp32), once in one process and once per configuration on 2 GPUs:

- `sp2`: DeepSpeed Ulysses, `ParallelismConfig(sp_size=2)` under ZeRO-3 (ds_configs/zero3.json, `--sp 2`);
- `autotp2`: DeepSpeed AutoTP, ZeRO-1 (ds_configs/zero1_autotp.json);
- `tp2`: accelerate's `ParallelismConfig(tp_size=2)` (transformers' `tp_plan`, DTensor), `--tp 2`;
- `cp2`: accelerate's `ParallelismConfig(cp_size=2)` (torch ring attention over the GPU SDPA kernels), `--cp 2`,
  under the FSDP2 launch config (accelerate runs CP only under FSDP2).

On GPUs `PretrainingArguments` does not refuse `tp_size`/`cp_size` (its refusal keys on `use_cpu`; the dry run
checks that). Whether accelerate and transformers accept them on CUDA is what the row finds out: a configuration
that fails is reported with its log's end, the others still run.

fp32, not bf16: the runs differ from the one process only in the order of the sums (heads or sequence split, partial
sums all-reduced), a few fp32 ulps; in bf16 (8 mantissa bits) that noise is ~1e-2 of a loss and a wrong split (heads
mixed, a gradient averaged over the group) could hide in it. fp32 keeps the CPU tests' tolerance (1e-5 on losses of
~6.3, measured 4.8e-7 on gloo) and dist_run.py unchanged (it trains fp32). TF32 stays off (torch's default for
matmuls; hf_pretrain does not turn it on). Each row of the data reaches both ranks of a group: the tokens seen must
equal the one process's on every rank (counted once, not once per rank).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

from .common import ROOT, Context, Skip, missing, old_transformers, require, trainer_missing

GOAL = "every configuration's losses within 1e-5 of one process's (fp32), its tokens counted once"
TOLERANCE = 1e-5
SCRIPT = ROOT / "tests" / "distributed" / "dist_run.py"
ZERO3 = ROOT / "ds_configs" / "zero3.json"
AUTOTP = ROOT / "ds_configs" / "zero1_autotp.json"
FSDP2 = ROOT / "examples" / "accelerate_configs" / "fsdp2_8gpu.yaml"
LAUNCH_TIMEOUT_S = 150  # one launch: start-up (DeepSpeed's import, NCCL) and 6 tiny steps


def launches(out: Path) -> dict[str, list[str]]:
    """Each configuration's command (the one process first), writing its ranks' records to out/<name>/; a port each
    (one reused at once can still be in TIME_WAIT)."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port"]
    accelerate = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(FSDP2)]
    accelerate += ["--num_processes", "2", "--mixed_precision", "no", "--main_process_port", free_port()]
    return {
        "single": [sys.executable, str(SCRIPT), str(out / "single"), "8"],
        "sp2": [*torchrun, free_port(), str(SCRIPT), str(out / "sp2"), "8", str(ZERO3), "0", "-", "--sp", "2"],
        "autotp2": [*torchrun, free_port(), str(SCRIPT), str(out / "autotp2"), "8", str(AUTOTP)],
        "tp2": [*torchrun, free_port(), str(SCRIPT), str(out / "tp2"), "8", "-", "--tp", "2"],
        "cp2": [*accelerate, str(SCRIPT), str(out / "cp2"), "8", "-", "--cp", "2"],
    }


def gpu_refusals_off(workdir: Path) -> None:
    """`PretrainingArguments` refuses tp_size/cp_size only with `use_cpu`: built here with use_cpu=False, it must
    accept both (a CPU can check this much; a refusal raises, an error row)."""
    from accelerate import ParallelismConfig

    from hf_pretrain import PretrainingArguments

    for field in ("tp_size", "cp_size"):
        config = ParallelismConfig(**{field: 2})
        PretrainingArguments(output_dir=str(workdir), report_to="none", use_cpu=False, parallelism_config=config)


def run(ctx: Context) -> dict:
    gpus = torch.cuda.device_count()
    commands = launches(ctx.workdir / "parallel")  # built on every machine: a dry run exercises it
    absent = [str(f.relative_to(ROOT)) for f in (SCRIPT, ZERO3, AUTOTP, FSDP2) if not f.exists()]
    if absent:
        raise Skip(f"{', '.join(absent)} not in this checkout: run gpu_check.py from a full clone")
    lacking = (old_transformers(), trainer_missing(), missing("deepspeed", "SP and AutoTP run under DeepSpeed"))
    if not any(lacking):
        gpu_refusals_off(ctx.workdir)
    if gpus < 2:
        raise Skip(f"needs 2 CUDA GPUs (this machine has {gpus})")
    require(*lacking)
    if ctx.dry_run:
        raise Skip(f"a dry run launches no GPU work ({len(commands)} launches built, {gpus} GPUs here)")
    return compare(commands, ctx.workdir / "parallel")


def compare(commands: dict[str, list[str]], out: Path) -> dict:
    single = ranks(launch("single", commands["single"], out))[0]
    details, lines, ok = {}, [], True
    for name, command in list(commands.items())[1:]:
        try:
            records = ranks(launch(name, command, out))
        except RuntimeError as err:
            details[name], ok = {"error": str(err)}, False
            lines.append(f"{name}: error ({str(err).splitlines()[0][:80]})")
            continue
        loss = max(abs(records[0]["losses"][s] - v) for s, v in single["losses"].items())
        once = [r["tokens_seen"] for r in records] == [single["tokens_seen"]] * len(records)
        details[name] = {
            "max_loss_diff": loss,
            "tokens_seen": [r["tokens_seen"] for r in records],
            "counted_once": once,
        }
        ok = ok and loss <= TOLERANCE and once
        lines.append(f"{name}: max |loss diff| {loss:.1e}, tokens counted {'once' if once else 'NOT once'}")
    details["single_tokens_seen"] = single["tokens_seen"]
    return {"result": "; ".join(lines), "value": float(ok), "pass": ok, "details": details}


def launch(name: str, command: list[str], out: Path) -> Path:
    """Run one configuration to the end (a deadline, its log in out/<name>.log); its records' folder."""
    (out / name).mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env |= {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    log = out / f"{name}.log"
    print(f"parallel_2gpu: launching {name}", flush=True)
    start = time.monotonic()
    with log.open("w") as sink:
        try:
            code = subprocess.run(command, cwd=ROOT, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                  timeout=LAUNCH_TIMEOUT_S).returncode  # fmt: skip
        except subprocess.TimeoutExpired:
            code = f"timeout after {LAUNCH_TIMEOUT_S} s"
    print(f"parallel_2gpu: {name} ended ({code}) after {time.monotonic() - start:.0f} s", flush=True)
    if code != 0:
        raise RuntimeError(f"exit {code}: {log.read_text()[-1500:]}")
    return out / name


def ranks(folder: Path) -> list[dict]:
    records = [json.loads(p.read_text()) for p in sorted(folder.glob("rank-*.json"))]
    if not records:
        raise RuntimeError(f"no rank-*.json in {folder}")
    return records


def free_port() -> str:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return str(sock.getsockname()[1])
