"""`straggler_2proc`: `PretrainTrainer` in 2 processes (DDP over gloo: on one GPU NCCL refuses two ranks), rank 1
slowed inside its linears (`faults.slow_linears`), so that both rules of telemetry/straggler_rule.py see it: DDP's
compute measure names the rank in the run, and the per-linear `local_s` the run logged for every rank (the
measure ZeRO-3 and FSDP2 are judged on) is scored by the same rule. On one GPU the two ranks time-slice the
device, so rank 0's events include slices of rank 1's sleep: the scores are conservative there.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import torch

from .common import EOS, ROOT, Context, Sizes, old_transformers, packed_rows, require, train_args, trainer_missing
from .faults import slow_linears

GOAL = "the slowed rank 1 is named by the DDP rule and by the linears' rule"
THRESHOLD = 0.75  # StragglerCallback's default


def run(ctx: Context) -> dict:
    require(old_transformers(), trainer_missing())
    from hf_pretrain.telemetry.jsonl import read_jsonl
    from hf_pretrain.telemetry.straggler_rule import straggler_scores

    out = ctx.workdir / "straggler"
    launch(out, ctx.cuda, ctx.dry_run)
    records = read_jsonl(out)
    flagged = [r for r in records if "straggler_warning" in r]
    scored = [r for r in records if "rank1_local_s" in r]
    ddp_named = bool(flagged) and all(r["straggler_slowest_rank"] == 1 for r in flagged)
    # the linears' rule on the same exchanges: each rank's logged local_s, as a ZeRO-3 / FSDP2 run would score it
    local = [straggler_scores([{"local_s": r[f"rank{i}_local_s"], "wait_free": 0.0} for i in (0, 1)]) for r in scored]
    local_named = bool(local) and all(basis == "local" and s[1] < THRESHOLD <= s[0] for s, basis in local)
    ddp = f"DDP rule: {len(flagged)} of {len(scored)} exchanges flagged"
    ddp += f" ({flagged[0]['straggler_warning']})" if flagged else ""
    text = (
        ddp
        + "; linears' rule: "
        + (
            f"rank 1 score {local[-1][0][1]:.2f} (local_s {scored[-1]['rank0_local_s'] * 1e3:.1f} vs "
            f"{scored[-1]['rank1_local_s'] * 1e3:.1f} ms)"
            if local
            else "no exchange logged local_s"
        )
    )
    keys = ("rank0_compute_s", "rank1_compute_s", "rank0_wait_s", "rank1_wait_s", "rank0_local_s", "rank1_local_s")
    details = [{k: r.get(k) for k in ("step", "rank0_score", "rank1_score", *keys)} for r in scored]
    named = ddp_named and local_named
    # naming the slowed rank is judged on a dry run too: two CPU ranks, one slowed on the host
    return {"result": text, "value": float(named), "pass": named, "details": details}


def launch(out: Path, cuda: bool, dry_run: bool) -> None:
    out.mkdir(parents=True, exist_ok=True)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = []
    for rank in (0, 1):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": "2",
            "RANK": str(rank),
            "LOCAL_RANK": "0" if cuda else str(rank),  # both ranks on the one GPU
            "LOCAL_WORLD_SIZE": "2",
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        }
        cmd = [
            sys.executable,
            str(ROOT / "benchmarks" / "gpu_check.py"),
            "--worker",
            "straggler",
            "--workdir",
            str(out),
        ]
        cmd += ["--dry-run"] if dry_run else []
        log = (out / f"rank{rank}.log").open("w")  # a file each: neither rank blocks on a full pipe
        procs.append(subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, text=True))
    deadline = time.monotonic() + 300
    try:
        for p in procs:  # one deadline for both ranks, not 300 s each
            p.wait(timeout=max(deadline - time.monotonic(), 1))
    finally:
        for p in procs:  # a rank still alive (the other failed, or the deadline passed) goes
            if p.poll() is None:
                p.kill()
                p.wait()
    if any(p.returncode for p in procs):
        tail = "".join((out / f"rank{rank}.log").read_text()[-1500:] for rank in (0, 1))
        raise RuntimeError(f"a rank failed ({[p.returncode for p in procs]}): {tail}")


def worker(workdir: Path, sizes: Sizes, cuda: bool) -> None:
    """One rank of the check (launched with RANK / WORLD_SIZE / MASTER_* set)."""
    from hf_pretrain import PretrainForCausalLM, PretrainTrainer, get_preset
    from hf_pretrain.data.collator import PackedDocumentCollator

    config = get_preset(sizes.straggler_preset, max_position_embeddings=sizes.straggler_seq)
    rows = sizes.straggler_batch * 2 * (sizes.straggler_steps + 1)
    ctx = Context(torch.device("cuda" if cuda else "cpu"), sizes, not cuda, workdir)
    args = train_args(
        ctx,
        workdir,
        max_steps=sizes.straggler_steps,
        per_device_train_batch_size=sizes.straggler_batch,
        logging_steps=4,
        straggler_every=4,
        ddp_backend="gloo",  # two ranks on one GPU: NCCL refuses a shared device
        measure_peak_tflops=False,
    )
    torch.manual_seed(0)
    model = PretrainForCausalLM(config)
    slow_linears(model, 1, sizes.straggler_sleep_s, ctx.device)  # rank 1's device slow (calibrated now), its host not
    trainer = PretrainTrainer(
        model=model,
        args=args,
        train_dataset=packed_rows(config.vocab_size, sizes.straggler_seq, rows),
        data_collator=PackedDocumentCollator(EOS),
    )
    trainer.train()
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()
