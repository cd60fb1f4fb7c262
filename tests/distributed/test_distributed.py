"""Real multi-process runs on this CPU (gloo): DDP and DeepSpeed ZeRO-3 through `accelerate launch`,
two "nodes" over loopback, and the accelerate configs the docs name."""

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

from hf_pretrain import PretrainForCausalLM
from hf_pretrain.modeling import model as modeling

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "examples" / "accelerate_configs"
SCRIPT = ROOT / "tests" / "distributed" / "dist_run.py"
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}

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


def assert_same_curve(records, reference, tolerance):
    assert [r["world_size"] for r in records] == [2, 2]
    assert len({r["digest"] for r in records}) == 1  # every rank holds the same parameters
    for step, loss in reference["losses"].items():
        assert abs(records[0]["losses"][step] - loss) <= tolerance, step


def test_ddp_two_processes_follow_the_single_process_curve(tmp_path, single):
    config = ["--config_file", str(CONFIGS / "cpu_2proc.yaml"), "--main_process_port", str(free_port())]
    finish(launch(*config, out=tmp_path, per_device=4))
    assert_same_curve(ranks(tmp_path), single, 1e-5)  # same global batch of 8: 2 ranks x 4


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
    assert_same_curve(records, single, 1e-3)  # Newton-Schulz runs in bf16: a 1e-7 gradient difference shows
    assert single["losses"]["6"] < single["losses"]["1"]


ZERO3 = str(ROOT / "ds_configs" / "zero3.json")


@pytest.fixture(scope="module")
def zero3_run(tmp_path_factory) -> Path:
    """One ZeRO-3 launch of 2 ranks, checkpoints at steps 3 and 6: several tests read it."""
    out = tmp_path_factory.mktemp("zero3")
    config = ["--config_file", str(CONFIGS / "cpu_2proc.yaml"), "--main_process_port", str(free_port())]
    finish(launch(*config, out=out, per_device=4, extra=[ZERO3, "3"]))
    return out


def test_zero3_two_processes_train_alike_and_save_full_weights(zero3_run, single):
    tmp_path = zero3_run
    records = ranks(tmp_path)
    assert_same_curve(records, single, 1e-5)
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
    assert_same_curve(records, single, 1e-5)


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
    assert_same_curve(ranks(tmp_path), single, 1e-5)


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
