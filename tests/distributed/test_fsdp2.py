"""FSDP2 (`fully_shard` per decoder layer) in real 2-process CPU runs (gloo) through `accelerate launch
--config_file cpu_2proc_fsdp2.yaml`: the curve of one process and of DDP, the consolidated weights that
`export_hf` and plain transformers read, sharded checkpoints that resume every loss exactly, also after a
rank was killed."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from hf_pretrain import PretrainForCausalLM, export_hf
from hf_pretrain.training.resume.check import check_checkpoint
from tests.distributed.test_distributed import (
    CONFIGS,
    WINDOWS,
    assert_counts_each_token_once,
    assert_follows,
    assert_windows_follow_the_micro_batches,
    finish,
    free_port,
    launch,
    ranks,
)
from tests.distributed.test_multiprocess_resume import launch as launch_resume
from tests.distributed.test_multiprocess_resume import losses

pytestmark = pytest.mark.distributed

FSDP2 = CONFIGS / "cpu_2proc_fsdp2.yaml"
PROBE = torch.randint(3, 500, (48, 32), generator=torch.Generator().manual_seed(1))[:2]  # dist_run.py's batch


def fsdp2(*extra: str) -> list[str]:
    return ["--config_file", str(FSDP2), "--main_process_port", str(free_port()), *extra]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """6 steps, 2 ranks x 4, sharded checkpoints at steps 3 and 6; then `WINDOWS` (test_distributed.py)."""
    out = tmp_path_factory.mktemp("fsdp2")
    finish(launch(*fsdp2(), out=out, per_device=4, extra=["-", "3", *WINDOWS]))
    return out


@pytest.mark.parametrize("name", ["fsdp2_8gpu", "cpu_2proc_fsdp2"])
def test_fsdp2_configs_launch_as_fsdp2_plugins(name, monkeypatch):
    """What `accelerate launch --config_file` hands the ranks builds accelerate's FSDP2 plugin as documented."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils import FullyShardedDataParallelPlugin
    from accelerate.utils.launch import prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", str(CONFIGS / f"{name}.yaml"), "train.py"])
    env = prepare_multi_gpu_env(_validate_launch_command(args)[0])
    for key, value in env.items():
        if key.startswith("FSDP_") or key == "ACCELERATE_USE_FSDP":
            monkeypatch.setenv(key, value)
    assert env["ACCELERATE_USE_FSDP"] == "true"
    plugin = FullyShardedDataParallelPlugin()
    assert plugin.fsdp_version == 2 and plugin.reshard_after_forward is True
    assert plugin.transformer_cls_names_to_wrap == ["PretrainDecoderLayer"]
    assert "SHARDED_STATE_DICT" in str(plugin.state_dict_type)
    assert plugin.cpu_ram_efficient_loading is (name == "fsdp2_8gpu")  # rank 0 builds, the others receive


def test_fsdp2_follows_the_single_process_and_ddp_curve(straight, single):
    """The curve DDP meets (test_distributed.py), each token counted once; windows over packed documents through
    MoE layers, checkpointed (`WINDOWS`). The chunked loss steps aside: `fully_shard` makes the head an FSDPLinear
    (the full logits are computed, with a warning)."""
    records = ranks(straight)
    assert_follows(records, single)
    assert_counts_each_token_once(records, single)
    assert [r["fused_loss_unavailable"] for r in records] == ["lm_head is a FSDPLinear, not a bare nn.Linear"] * 2
    assert_windows_follow_the_micro_batches(straight, single)


def test_fsdp2_saves_full_weights_that_export_hf_and_plain_transformers_read(straight, tmp_path):
    records = ranks(straight)
    loaded = PretrainForCausalLM.from_pretrained(straight / "model").eval()
    assert sum(p.numel() for p in loaded.parameters()) > 100_000  # the gathered weights, not one rank's shard
    with torch.no_grad():
        logits = loaded(input_ids=PROBE).logits
    assert torch.allclose(logits, torch.tensor(records[0]["logits"]), atol=1e-5, rtol=0)
    export_hf(straight / "model", tmp_path / "plain")
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "plain").eval()
    assert type(plain).__name__ == "LlamaForCausalLM"
    with torch.no_grad():
        assert (plain(input_ids=PROBE).logits - logits).abs().max().item() <= 1e-5


def test_fsdp2_asynchronous_saves_take_the_state_on_the_device_and_copy_what_was_estimated(straight):
    """accelerate's sharded state dicts come with cpu_offload (a blocking, unpinned device-to-host copy on the
    training thread, then the stager's own copy: twice the host memory); an asynchronous save takes them on the
    device so DCP's stager makes the only copy (on a CPU the offload is the identity: the options passed are
    what is tested). The host-memory guard's estimate is each rank's shards of the weights and AdamW states."""
    for record in ranks(straight):
        assert record["state_dict_offload"] == [False, False, False, False], record["state_dict_offload"]  # 2 saves
        staged, estimate = record["staged"]
        assert staged > 0 and staged - 64 * 1024 <= estimate <= staged, (staged, estimate)


def test_fsdp2_checkpoints_are_sharded_checked_and_resume_exactly(straight, tmp_path):
    for step in (3, 6):
        checkpoint = straight / f"checkpoint-{step}"
        assert sorted(p.name for p in checkpoint.glob("pytorch_model_fsdp_0/*.distcp")) == [
            "__0_0.distcp",
            "__1_0.distcp",
        ]
        assert check_checkpoint(checkpoint, world_size=2, fsdp=True).ok
    merged = shutil.copytree(straight / "checkpoint-6", tmp_path / "merged")  # its weights alone, by accelerate
    merge = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "merge-weights"]
    subprocess.run([*merge, str(merged / "pytorch_model_fsdp_0"), str(merged)], check=True, capture_output=True)
    final = PretrainForCausalLM.from_pretrained(straight / "model").state_dict()
    assert all(torch.equal(final[k], v) for k, v in PretrainForCausalLM.from_pretrained(merged).state_dict().items())
    cut = shutil.copytree(straight / "checkpoint-6", tmp_path / "cut")
    (cut / "optimizer_0" / ".metadata").unlink()  # the coordinator writes it last: a save that died before
    assert check_checkpoint(cut, world_size=2, fsdp=True).problems == [
        "optimizer_0/.metadata: missing (the sharded save did not finish)"
    ]
    shutil.rmtree(cut)
    shutil.copytree(straight / "checkpoint-3", tmp_path / "checkpoint-3")  # as if the job had died after step 5
    finish(launch(*fsdp2(), out=tmp_path, per_device=4, extra=["-", "3", "resume"]))
    reference = json.loads((straight / "rank-0.json").read_text())["losses"]
    resumed = json.loads((tmp_path / "rank-0-resumed.json").read_text())["losses"]
    assert sorted(resumed) == ["4", "5", "6"]
    assert resumed == {step: reference[step] for step in resumed}  # bit for bit


@pytest.mark.exhaustive  # a launch; make test: the Trainer's own gradient_checkpointing under FSDP2 (`WINDOWS`)
def test_fsdp2_with_accelerates_activation_checkpointing_follows_the_same_curve(tmp_path, single):
    """`fsdp_activation_checkpointing: true`, what `hf-pretrain plan` writes for a checkpointed FSDP2 run
    (plan/output.py): accelerate wraps each decoder layer in torch's `CheckpointWrapper` before `fully_shard`, in
    both runs of the launch (the Trainer's own flag stays off: transformers refuses the two together)."""
    config = yaml.safe_load(FSDP2.read_text())
    config["fsdp_config"]["fsdp_activation_checkpointing"] = True
    (tmp_path / "checkpointed.yaml").write_text(yaml.safe_dump(config))
    port = str(free_port())
    command = ["--config_file", str(tmp_path / "checkpointed.yaml"), "--main_process_port", port]
    finish(launch(*command, out=tmp_path, per_device=4, extra=["--windows_documents"]))
    records, windows = ranks(tmp_path), ranks(tmp_path / "windows_documents")
    assert [r["checkpoint_wrappers"] for r in records + windows] == [2] * 4  # the tiny preset's 2 decoder layers
    assert_follows(records, single)
    assert_windows_follow_the_micro_batches(tmp_path, single, trainer_checkpointing=False)


@pytest.mark.exhaustive  # make test: the DDP killed-rank resume and the FSDP2 resume from a checkpoint above
def test_fsdp2_killed_rank_resumes_every_loss_exactly(tmp_path):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    result = launch_resume(straight, 6, config=FSDP2)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    reference = losses(straight, "straight")
    assert sorted(reference) == list(range(1, 16))
    assert launch_resume(killed, 6, "kill:11", config=FSDP2).returncode != 0  # rank 1 died at step 11
    assert sorted(p.name for p in killed.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-6", "checkpoint-9"]
    resumed = launch_resume(killed, 6, "resume", config=FSDP2)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    after = losses(killed, "resumed")
    assert sorted(after) == list(range(10, 16))
    assert after == {step: reference[step] for step in after}  # every loss, bit for bit
