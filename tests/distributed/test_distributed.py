"""Real multi-process runs on this CPU (gloo): DDP and DeepSpeed ZeRO-1/2/3 through `accelerate launch`,
two "nodes" over loopback, and the accelerate configs the docs name.

Each 2-rank launch trains the one process's global batch of 8 rows (2 ranks x 4) and is held to it within 1e-5 (fp32
sums in another order: measured 4.8e-7 on losses of ~6.3). `WINDOWS`: then, in the same processes, the same steps with
sliding windows over packed documents through MoE layers, recomputing the activations (activation checkpointing),
held to one process that trains each global batch as 2 accumulation micro-batches of 4 rows. Not to the one process
of whole batches of 8: the router's load-balancing loss is a product of two means over the tokens of a forward
(expert load x mean router probability), so a rank's 4 rows give another loss than 8 rows do (measured 4.4e-5 on the
first loss, from the same weights; 4.9e-4 within 6 steps; with the router losses' coefficients at 0, DDP meets the
whole batches at 4.8e-7). That is data parallelism's objective (`modeling/model.py`, `_moe_output`: each micro-batch's
router losses weighted by its share of the tokens, the same for ranks and accumulation), which one process computes
by accumulating 2 micro-batches: DDP meets it bit for bit, ZeRO-1/2/3 and FSDP2 within 1.2e-6.
"""

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from transformers import LlamaForCausalLM

from hf_pretrain import PretrainForCausalLM, export_hf
from hf_pretrain.modeling import model as modeling

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "examples" / "accelerate_configs"
SCRIPT = ROOT / "tests" / "distributed" / "dist_run.py"
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
WINDOWS = ["--windows_documents", "--windows_checkpointing"]  # dist_run.py's second run: windows, documents, MoE

pytestmark = pytest.mark.distributed


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(*launch_args: str, out: Path, per_device: int, extra=()) -> subprocess.Popen:
    command = [sys.executable, "-m", "accelerate.commands.launch", *launch_args, str(SCRIPT), str(out), str(per_device)]
    return subprocess.Popen(command + list(extra), cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def finish(*processes: subprocess.Popen) -> None:
    for process in processes:
        output, _ = process.communicate(timeout=1200)
        assert process.returncode == 0, output.decode()[-4000:]


def ranks(out: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(out.glob("rank-*.json"))]


def assert_follows(records, single, tolerance=1e-5):
    assert [r["world_size"] for r in records] == [2, 2]
    assert len(single["losses"]) == 6
    assert len({r["digest"] for r in records}) == 1  # both ranks hold the same (gathered) parameters
    for key in ("losses", "grad_norms"):
        for step, value in single[key].items():
            assert abs(records[0][key][step] - value) <= tolerance, (key, step)


def assert_counts_each_token_once(records, single):
    assert single["tokens_seen"] == 6 * 8 * 32  # one process: 6 steps of 8 rows of 32 tokens
    assert [r["tokens_seen"] for r in records] == [single["tokens_seen"]] * 2
    assert [r["flops_per_token"] for r in records] == [single["flops_per_token"]] * 2


def assert_evaluates_as_one_process(records, single, tolerance=1e-5, loss=True):
    """The Trainer's `evaluate()` of 13 rows in batches of 8: a full batch and a remainder of 5, each row counted
    once (both ranks of a TP group score the same rows; under SP each rank its own whole rows). The curve's
    tolerance, for the same fp32 forward; counted once per TP rank, the full batch weighed 16/21 instead of 8/13
    (eval_loss 1.1e-4 off at TP=2). Perplexity is exp(the per-token loss): held to the same tolerance relatively."""
    for record in records:
        assert abs(record["eval"]["eval_next_token_accuracy"] - single["eval"]["eval_next_token_accuracy"]) <= tolerance
        assert abs(record["eval"]["eval_perplexity"] / single["eval"]["eval_perplexity"] - 1) <= tolerance
        if loss:
            assert abs(record["eval"]["eval_loss"] - single["eval"]["eval_loss"]) <= tolerance


def assert_windows_follow_the_micro_batches(out: Path, single, trainer_checkpointing: bool = True) -> None:
    """The `WINDOWS` run against one process accumulating 2 micro-batches of 4 rows a step (module docstring); the
    whole batches' first loss, from the same weights, differs: the reference is not the whole batches by mistake."""
    windows, micro = ranks(out / "windows_documents"), single["windows_documents_micro"]
    assert micro["losses"]["1"] != single["windows_documents"]["losses"]["1"]
    assert [r["gradient_checkpointing"] for r in windows] == [trainer_checkpointing] * 2
    assert_follows(windows, micro)
    logits = torch.tensor(windows[0]["logits"])  # the packed probe, evaluated (its position ids mark the documents)
    assert torch.allclose(logits, torch.tensor(micro["logits"]), atol=1e-5, rtol=0)


def assert_exports_the_one_process_model(out, records, single):
    """save_model's (gathered) weights, exported, load in plain `LlamaForCausalLM` with the run's own logits (same
    weights, same math) and the one process's: its weights come from the same fp32 math in another order, the
    curve's argument (measured 6.0e-7 on logits of magnitude ~1; held to 1e-5 as the losses are)."""
    plain = export_hf(out / "model", out / "plain")
    loaded = LlamaForCausalLM.from_pretrained(plain).eval()
    assert type(loaded) is LlamaForCausalLM
    probe = torch.randint(3, 500, (48, 32), generator=torch.Generator().manual_seed(1))[:2]  # dist_run.py's probe
    with torch.no_grad():
        logits = loaded(input_ids=probe).logits
    assert torch.allclose(logits, torch.tensor(records[0]["logits"]), atol=1e-5, rtol=0)
    assert torch.allclose(logits, torch.tensor(single["logits"]), atol=1e-5, rtol=0)


def test_ddp_two_processes_follow_the_single_process_curve(tmp_path, single):
    """The same global batch of 8 (2 ranks x 4), each token counted once, the chunked loss; then `WINDOWS`."""
    config = ["--config_file", str(CONFIGS / "cpu_2proc.yaml"), "--main_process_port", str(free_port())]
    finish(launch(*config, out=tmp_path, per_device=4, extra=WINDOWS))
    records = ranks(tmp_path)
    assert_follows(records, single)
    assert_counts_each_token_once(records, single)
    assert [r["fused_loss_unavailable"] for r in records] == [None, None]  # the loss ran without logits
    assert_windows_follow_the_micro_batches(tmp_path, single)


@pytest.mark.exhaustive
def test_ddp_two_processes_train_alike_with_muon(tmp_path):
    """Muon under DDP: each rank orthogonalises the same averaged gradient of whole matrices."""
    one, two = tmp_path / "one", tmp_path / "two"
    one.mkdir()
    command = [sys.executable, str(SCRIPT), str(one), "8", "--optim", "muon"]
    finish(subprocess.Popen(command, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    config = ["--config_file", str(CONFIGS / "cpu_2proc.yaml"), "--main_process_port", str(free_port())]
    finish(launch(*config, out=two, per_device=4, extra=["--optim", "muon"]))
    single, records = ranks(one)[0], ranks(two)
    assert single["optimizer"] == records[0]["optimizer"] == "MuonWithAdamW"
    assert_follows(records, single, 1e-3)  # Newton-Schulz runs in bf16: a 1e-7 gradient difference shows
    assert single["losses"]["6"] < single["losses"]["1"]


ZERO3 = str(ROOT / "ds_configs" / "zero3.json")


@pytest.fixture(scope="module")
def zero3_run(tmp_path_factory) -> Path:
    """One ZeRO-3 launch of 2 ranks, checkpoints at steps 3 and 6, then `WINDOWS`: several tests read it."""
    out = tmp_path_factory.mktemp("zero3")
    config = ["--config_file", str(CONFIGS / "cpu_2proc.yaml"), "--main_process_port", str(free_port())]
    finish(launch(*config, out=out, per_device=4, extra=[ZERO3, "3", *WINDOWS]))
    return out


def test_zero3_two_processes_train_alike_and_save_full_weights(zero3_run, single):
    tmp_path = zero3_run
    records = ranks(tmp_path)
    assert_follows(records, single)
    assert_counts_each_token_once(records, single)
    assert [r["fused_loss_unavailable"] for r in records] == [None, None]  # the head's weight gathered in the loss
    assert_windows_follow_the_micro_batches(tmp_path, single)
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-6"]
    assert not (tmp_path / ".saving").exists()  # every rank's shards were in place before the rename
    # save_model under ZeRO-3 wrote the gathered weights (not near-empty shards): they load in one process
    loaded = PretrainForCausalLM.from_pretrained(tmp_path / "model").eval()
    assert sum(p.numel() for p in loaded.parameters()) > 100_000
    probe = torch.randint(3, 500, (48, 32), generator=torch.Generator().manual_seed(1))[:2]
    with torch.no_grad():
        logits = loaded(input_ids=probe).logits
    assert torch.allclose(logits, torch.tensor(records[0]["logits"]), atol=1e-5, rtol=0)


@pytest.mark.exhaustive
def test_zero3_with_activation_checkpointing_follows_the_same_curve(tmp_path, single):
    """Checkpointed blocks recompute their forward in backward, where ZeRO-3 gathers the partitioned weights a
    second time: the losses and the weights must still be those of one process without checkpointing."""
    config = ["--config_file", str(CONFIGS / "cpu_2proc.yaml"), "--main_process_port", str(free_port())]
    extra = [str(ROOT / "ds_configs" / "zero3.json"), "0", "-", "--gradient_checkpointing"]
    finish(launch(*config, out=tmp_path, per_device=4, extra=extra))
    records = ranks(tmp_path)
    assert [r["gradient_checkpointing"] for r in records] == [True, True]
    assert_follows(records, single)


@pytest.mark.exhaustive  # a launch each; make test: ZeRO-3, which partitions the weights too
@pytest.mark.parametrize("stage", [1, 2])
def test_zero1_and_zero2_two_processes_follow_the_single_process_curve(tmp_path, single, stage):
    """ds_configs/zero2.json at its own stage 2 and at stage 1 (no ZeRO-1 config ships: it differs by the stage).
    The same global batch, tokens counted once, the chunked loss, `WINDOWS`, and the saved model exported."""
    config = json.loads((ROOT / "ds_configs" / "zero2.json").read_text())
    config["zero_optimization"]["stage"] = stage
    (tmp_path / "ds.json").write_text(json.dumps(config))
    launch_config = ["--config_file", str(CONFIGS / "cpu_2proc.yaml"), "--main_process_port", str(free_port())]
    finish(launch(*launch_config, out=tmp_path, per_device=4, extra=[str(tmp_path / "ds.json"), "0", *WINDOWS]))
    records = ranks(tmp_path)
    assert [r["optimizer"] for r in records] == ["DeepSpeedZeroOptimizer"] * 2  # stages 1 and 2 share it
    assert [r["memory_estimate"]["zero"] for r in records] == [stage] * 2  # the stage the run was priced at
    assert_follows(records, single)
    assert_counts_each_token_once(records, single)
    assert [r["fused_loss_unavailable"] for r in records] == [None, None]
    assert_windows_follow_the_micro_batches(tmp_path, single)
    assert_exports_the_one_process_model(tmp_path, records, single)


@pytest.mark.exhaustive  # make test: the rehearsal of two_nodes.yaml runs two "nodes" over loopback
def test_two_nodes_over_loopback(tmp_path, single):
    port = str(free_port())
    common = ["--multi_gpu", "--num_machines", "2", "--num_processes", "2", "--rdzv_backend", "static"]
    nodes = [
        launch(
            *common,
            "--machine_rank",
            str(rank),
            "--main_process_ip",
            "127.0.0.1",
            "--main_process_port",
            port,
            out=tmp_path,
            per_device=4,
        )
        for rank in (0, 1)
    ]
    finish(*nodes)
    assert_follows(ranks(tmp_path), single)


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("*.yaml")), ids=lambda p: p.stem)
def test_accelerate_configs_parse_and_name_what_exists(path):
    from accelerate.commands.config.config_args import load_config_from_file

    config = load_config_from_file(str(path))
    raw = yaml.safe_load(path.read_text())
    assert config.num_processes == raw["num_processes"] and config.num_machines == raw["num_machines"]
    if config.deepspeed_config:
        assert (ROOT / config.deepspeed_config["deepspeed_config_file"]).exists()
    if config.fsdp_config:
        assert config.fsdp_config["fsdp_version"] == 2
        assert hasattr(modeling, config.fsdp_config["fsdp_transformer_layer_cls_to_wrap"])
    if config.num_machines > 1:
        assert config.main_process_ip and config.main_process_port


def test_the_configs_cover_the_documented_setups():
    names = {p.stem for p in CONFIGS.glob("*.yaml")}
    assert names == {
        "one_gpu",
        "ddp_8gpu",
        "deepspeed_zero3_8gpu",
        "fsdp2_8gpu",
        "two_nodes",
        "cpu_2proc",
        "cpu_2proc_fsdp2",
        "cpu_2proc_sp",
        "cpu_2proc_tp",
    }


@pytest.mark.exhaustive  # make test: the DDP and FSDP2 resumes (tests/distributed/test_multiprocess_resume.py, ...)
def test_zero3_checkpoints_resume_exactly(tmp_path, zero3_run, single):
    shutil.copytree(zero3_run / "checkpoint-3", tmp_path / "checkpoint-3")  # as if the job had died after step 5
    config = ["--config_file", str(CONFIGS / "cpu_2proc.yaml"), "--main_process_port", str(free_port())]
    finish(launch(*config, out=tmp_path, per_device=4, extra=[ZERO3, "3", "resume"]))
    resumed = json.loads((tmp_path / "rank-0-resumed.json").read_text())["losses"]
    assert sorted(resumed) == ["4", "5", "6"]
    assert all(abs(resumed[step] - single["losses"][step]) < 1e-5 for step in resumed)  # the curve goes on exactly
