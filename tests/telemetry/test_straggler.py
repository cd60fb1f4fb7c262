import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hf_pretrain.telemetry.jsonl import read_jsonl
from hf_pretrain.telemetry.straggler import straggler_report

HERE = Path(__file__).resolve().parent


def row(compute, wait, step, clock=-1.0, power=-1.0, throttled=0.0):
    return dict(
        compute_s=compute,
        wait_s=wait,
        data_wait_s=0.0,
        step_s=step,
        sm_clock_mhz=clock,
        sm_clock_max_mhz=-1.0,
        power_w=power,
        throttled=throttled,
    )


def test_field_notes_straggler_message():
    # Two GB10s: rank 1 stuck at ~600 MHz; rank 0 (2190 MHz) waits 3.3 s of each 7.2 s step.
    rows = [row(3.9, 3.3, 7.2, clock=2190, power=80), row(7.2, 0.0, 7.2, clock=600, power=30)]
    metrics, warning = straggler_report(rows, ["node-a", "node-b"], threshold=0.75)
    assert (
        warning == "rank 1 (node-b) 1.8x slower, SM 600/2190 MHz, 30 W, no throttle flag; rank 0 waits 3.3 s of 7.2 s"
    )
    assert metrics["rank1_score"] == pytest.approx(3.9 / 7.2) and metrics["rank0_score"] == 1.0
    assert metrics["straggler_score_min"] == pytest.approx(0.5417, abs=1e-4)
    assert metrics["rank1_sm_clock_mhz"] == 600 and metrics["rank0_wait_s"] == 3.3


def test_balanced_ranks_and_cpu_ranks_give_no_warning_and_no_made_up_clocks():
    metrics, warning = straggler_report([row(1.0, 0.1, 1.2), row(1.1, 0.0, 1.2)], ["a", "b"], 0.75)
    assert warning is None and metrics["straggler_score_min"] == pytest.approx(1 / 1.1)
    assert "rank0_sm_clock_mhz" not in metrics  # CPU ranks: no clock, not 0


def launch(tmp_path, nproc, slow=None, accumulation=1, threshold=0.75):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("HF_PRETRAIN_TEST_SLOW_RANK", None)
    if slow:
        env["HF_PRETRAIN_TEST_SLOW_RANK"] = slow
    with (
        socket.socket() as s
    ):  # a free port for the rendezvous (port 0 is not accepted by torchrun's static rendezvous)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={nproc}",
        f"--master_port={port}",
        str(HERE / "straggler_run.py"),
        str(tmp_path),
        str(accumulation),
        str(threshold),
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=HERE.parents[1])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return read_jsonl(tmp_path), proc


@pytest.mark.distributed
@pytest.mark.parametrize("accumulation", [1, 4])
def test_two_cpu_ranks_the_slow_one_is_named(tmp_path, accumulation):
    records, proc = launch(tmp_path, 2, slow="1:0.1", accumulation=accumulation)
    flagged = [r for r in records if "straggler_warning" in r]
    assert flagged, records
    assert flagged[0]["straggler_warning"].startswith("rank 1 (") and flagged[0]["straggler_slowest_rank"] == 1
    assert flagged[0]["rank1_score"] < 0.75 <= flagged[0]["rank0_score"]
    # rank 0 waits for the slow rank, about the injected 0.1 s per micro-batch
    assert 0.06 * accumulation < flagged[0]["rank0_wait_s"] < 0.3 * accumulation
    assert flagged[0]["rank1_wait_s"] < 0.05 * accumulation
    assert "straggler at step" in proc.stderr + proc.stdout


@pytest.mark.distributed
def test_two_balanced_cpu_ranks_and_one_process_are_quiet(tmp_path):
    # Two equal ranks sharing two cores with whatever else runs here: a score of 0.5 (one rank twice as slow) is
    # a straggler, the jitter of a busy machine is not
    records, _ = launch(tmp_path / "two", 2, threshold=0.5)
    logs = [r for r in records if "straggler_score_min" in r]
    assert logs and all("straggler_warning" not in r for r in records)
    single, _ = launch(tmp_path / "one", 1)
    one = next(r for r in single if "straggler_score_min" in r)
    # one process waits for nobody: what is not compute is the optimizer step and callbacks (a few ms; more on a
    # busy machine), never most of the step
    assert one["straggler_score_min"] == 1.0 and one["wait_s"] < 0.5 * one["step_s"] and "rank1_score" not in one
