"""DeepSpeed Ulysses sequence parallelism (SP=2) under ZeRO-3 on 2 real gloo ranks, against one process.

Each step of the SP run trains the one process's batch of 8 rows of 32 tokens, each row cut into two halves of 16
tokens, one per rank (data-parallel size 1); attention exchanges tokens for heads (all-to-all) and the loss is the
token-weighted mean over the two halves. The arithmetic is the same fp32 math in another order (heads split, two
partial sums, ZeRO-3's reduce-scatter): the curves agree within a few fp32 ulps of a loss of ~6.3 (measured 4.8e-7),
held to 1e-5 as the DDP and ZeRO-3 runs are. The gradient norms are held too: DeepSpeed scaling the SP group's
gradients by sp_size (the pitfall transformers' `deepspeed_sp_compute_loss` works around) leaves Adam's losses
nearly alone under clipping but doubles the norm.
"""

import json
import shutil
import subprocess
import sys

import pytest

from tests.distributed.test_distributed import CONFIGS, ENV, ROOT, SCRIPT, ZERO3, finish, free_port, launch, ranks

pytestmark = pytest.mark.distributed


def assert_follows(records, single, tolerance=1e-5):
    assert [r["world_size"] for r in records] == [2, 2]
    assert len({r["digest"] for r in records}) == 1  # both ranks hold the same (gathered) parameters
    for key in ("losses", "grad_norms"):
        for step, value in single[key].items():
            assert abs(records[0][key][step] - value) <= tolerance, (key, step)


def test_sp2_under_zero3_follows_the_single_process_curve(tmp_path, single):
    """`parallelism_config=ParallelismConfig(sp_size=2)` as an argument, under torchrun."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port"]
    command += [str(free_port()), str(SCRIPT), str(tmp_path), "8", ZERO3, "0", "-", "--sp", "2"]
    finish(subprocess.Popen(command, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    assert_follows(ranks(tmp_path), single)


@pytest.mark.exhaustive  # two launches: the accelerate launch config's parallelism_config keys, then a resume
def test_sp2_launch_config_trains_alike_and_resumes_exactly(tmp_path, single):
    """cpu_2proc_sp.yaml (parallelism_config_sp_size: 2), checkpoints at 3 and 6; then a resume from checkpoint-3:
    step 3 ends halfway through a refill of Ulysses' loader (one rank's batch trained, the other's not)."""
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    config = ["--config_file", str(CONFIGS / "cpu_2proc_sp.yaml"), "--main_process_port", str(free_port())]
    finish(launch(*config, out=whole, per_device=8, extra=["-", "3"]))
    records = ranks(whole)
    assert_follows(records, single)
    shutil.copytree(whole / "checkpoint-3", resumed / "checkpoint-3")
    config[-1] = str(free_port())
    finish(launch(*config, out=resumed, per_device=8, extra=["-", "3", "resume"]))
    again = json.loads((resumed / "rank-0-resumed.json").read_text())
    assert again["losses"] == {step: records[0]["losses"][step] for step in ("4", "5", "6")}
    assert again["digest"] == records[0]["digest"]  # bit for bit
