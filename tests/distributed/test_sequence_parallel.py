"""DeepSpeed Ulysses sequence parallelism (SP=2) under ZeRO-3 on 2 real gloo ranks, against one process.

Each step of the SP run trains the one process's batch of 8 rows of 32 tokens, each row cut into two halves of 16
tokens, one per rank (data-parallel size 1); attention exchanges tokens for heads (all-to-all) and the loss is the
token-weighted mean over the two halves. The arithmetic is the same fp32 math in another order (heads split, two
partial sums, ZeRO-3's reduce-scatter): the curves agree within a few fp32 ulps of a loss of ~6.3 (measured 4.8e-7),
held to 1e-5 as the DDP and ZeRO-3 runs are. The gradient norms are held too: DeepSpeed scaling the SP group's
gradients by sp_size (the pitfall transformers' `deepspeed_sp_compute_loss` works around) leaves Adam's losses
nearly alone under clipping but doubles the norm.

Each rank sees 16 of each row's 32 tokens, so telemetry that counted per rank without reducing over the SP group,
or reduced the whole batch on every rank, would count each token twice: the tokens seen (what tokens/s and MFU are
computed from) must equal the one process's, by the Trainer's counter and by `TokenCounter`'s own; the FLOPs per
token are the whole sequence's (the attention of a rank's heads spans all 32 tokens). The memory preflight prices
each rank's half of the sequence. The model `save_model` writes after the SP run (ZeRO-3's gathered weights), exported
by `export_hf`, loads in plain `LlamaForCausalLM` with the one process's logits.

Then, in the same processes, the same steps with a window layer and a full one over packed documents (~4.6 a row):
DeepSpeed's Ulysses wrapper drops the model's mask, `FullSequenceSdpa` rebuilds it for the whole sequence from the
gathered positions. Same argument, same tolerance (measured: 9.5e-7 on the losses, 1.6e-6 on the gradient norms);
with the mask not rebuilt (SDPA plain causal, the behaviour before) the first step's loss differs by 5.6e-3, its
gradient norm by 1.2, the losses by up to 1.2e-1 within 6 steps.
"""

import json
import shutil
import subprocess
import sys

import pytest
import torch

from tests.distributed.test_distributed import (
    CONFIGS,
    ENV,
    ROOT,
    SCRIPT,
    ZERO3,
    assert_counts_each_token_once,
    assert_evaluates_as_one_process,
    assert_exports_the_one_process_model,
    assert_follows,
    finish,
    free_port,
    launch,
    ranks,
)

pytestmark = pytest.mark.distributed
POPEN = dict(cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def test_sp2_under_zero3_follows_the_single_process_curve(tmp_path, single):
    """`parallelism_config=ParallelismConfig(sp_size=2)` as an argument, under torchrun; tokens counted by
    `TokenCounter` (the launch-config test below: by the Trainer's counter). Then windows over packed documents."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port"]
    command += [str(free_port()), str(SCRIPT), str(tmp_path), "8", ZERO3, "0", "-", "--sp", "2", "--own_token_count"]
    command += ["--windows_documents", "--evaluate"]
    finish(subprocess.Popen(command, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    records = ranks(tmp_path)
    assert_follows(records, single)
    # evaluate(): Ulysses off, each rank scores its share of whole rows, as 2 data-parallel ranks do
    assert_evaluates_as_one_process(records, single, loss=False)
    windows = ranks(tmp_path / "windows_documents")
    assert_follows(windows, single["windows_documents"])
    for record in windows:  # evaluation: Ulysses off, the mask still dropped by its wrapper and rebuilt
        assert torch.allclose(
            torch.tensor(record["logits"]), torch.tensor(single["windows_documents"]["logits"]), atol=1e-5, rtol=0
        )
    assert_counts_each_token_once(records, single)
    # the preflight's estimate: each rank's activations and loss of 16 tokens a row, the one process's halved
    sp, whole = records[0]["memory_estimate"], single["memory_estimate"]
    assert (sp["sp"], sp["zero"], sp["gpus"], whole["sp"]) == (2, 3, 2, 1)
    assert 2 * sp["activations"] == whole["activations"]
    assert_exports_the_one_process_model(tmp_path, records, single)


@pytest.mark.exhaustive  # two launches: the accelerate launch config's parallelism_config keys, then a resume
def test_sp2_launch_config_trains_alike_and_resumes_exactly(tmp_path, single):
    """cpu_2proc_sp.yaml (parallelism_config_sp_size: 2), checkpoints at 3 and 6; then a resume from checkpoint-3:
    step 3 ends halfway through a refill of Ulysses' loader (one rank's batch trained, the other's not)."""
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    config = ["--config_file", str(CONFIGS / "cpu_2proc_sp.yaml"), "--main_process_port", str(free_port())]
    finish(launch(*config, out=whole, per_device=8, extra=["-", "3"]))
    records = ranks(whole)
    assert_follows(records, single)
    assert_counts_each_token_once(records, single)
    shutil.copytree(whole / "checkpoint-3", resumed / "checkpoint-3")
    config[-1] = str(free_port())
    finish(launch(*config, out=resumed, per_device=8, extra=["-", "3", "resume"]))
    again = json.loads((resumed / "rank-0-resumed.json").read_text())
    assert again["losses"] == {step: records[0]["losses"][step] for step in ("4", "5", "6")}
    assert again["digest"] == records[0]["digest"]  # bit for bit


@pytest.mark.exhaustive  # four ranks and their own one-process reference: ~60 s
def test_sp2_by_two_data_parallel_groups_follows_one_process_fed_the_same_rows(tmp_path):
    """SP 2 on 4 ranks: two SP groups, each training its ranks' micro-batches in turn (Ulysses' loader adapter), so a
    step trains other rows than plain data parallelism would; one process fed those rows in that order
    (`dist_run.rows_as_sp_groups_train_them`) is the reference, same tolerance. Without `dp_shard_size` set to the
    data-parallel groups DeepSpeed stopped at the first `prepare` ("train_batch_size is not equal to ...")."""
    reference, sp = tmp_path / "reference", tmp_path / "sp"
    finish(subprocess.Popen([sys.executable, str(SCRIPT), str(reference), "8", "--as_sp_groups", "2x2"], **POPEN))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "4", "--master_port"]
    command += [str(free_port()), str(SCRIPT), str(sp), "4", ZERO3, "0", "-", "--sp", "2", "--own_token_count"]
    finish(subprocess.Popen(command, **POPEN))
    records, single = ranks(sp), ranks(reference)[0]
    assert [r["world_size"] for r in records] == [4] * 4 and len({r["digest"] for r in records}) == 1
    for key in ("losses", "grad_norms"):
        for step, value in single[key].items():
            assert abs(records[0][key][step] - value) <= 1e-5, (key, step)
    assert [r["tokens_seen"] for r in records] == [single["tokens_seen"]] * 4 == [6 * 8 * 32] * 4
