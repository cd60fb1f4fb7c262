"""`hf-pretrain rehearse`: the launch made small (fast tests), and real rehearsals of the shipped accelerate configs
(which must pass) and of planted faults (which must fail with the right reason): slow, several gloo processes."""

import contextlib
import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from hf_pretrain import get_preset
from hf_pretrain.rehearse import RehearsalRequest, rehearse
from hf_pretrain.rehearse.checks import data_sharding, hang_recovery, resume, unattended_recovery
from hf_pretrain.rehearse.launch import (
    RunResult,
    build_deepspeed_ops,
    parse_launch,
    read_launch_file,
    rehearsal_config,
    waiting_for,
)
from hf_pretrain.rehearse.report import checklist, write_markdown
from hf_pretrain.rehearse.shrink import (
    check_sequence_parallel,
    flag_value,
    script_arguments,
    tensor_parallel_heads,
    tiny_config,
)
from hf_pretrain.training.recovery.attempts import Attempt, write_attempts

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "examples" / "accelerate_configs"
HERE = Path(__file__).resolve().parent


# The launch made small


def test_the_shipped_configs_become_two_cpu_processes_keeping_their_strategy():
    ddp = rehearsal_config(CONFIGS / "ddp_8gpu.yaml")
    assert (ddp.processes, ddp.nodes, ddp.strategy) == (2, 1, "DDP")
    nodes = rehearsal_config(CONFIGS / "two_nodes.yaml")
    assert (nodes.processes, nodes.nodes) == (2, 2)
    assert nodes.config["main_process_ip"] == "127.0.0.1" and nodes.config["mixed_precision"] == "no"
    assert any("bf16 -> fp32" in note for note in nodes.notes) and "gpu_ids" not in nodes.config
    zero3 = rehearsal_config(CONFIGS / "deepspeed_zero3_8gpu.yaml")
    assert zero3.strategy.startswith("DeepSpeed ZeRO-3") and zero3.deepspeed_file.name == "zero3.json"
    assert "mixed_precision" not in zero3.config  # accelerate refuses it beside a DeepSpeed JSON
    assert Path(zero3.config["deepspeed_config"]["deepspeed_config_file"]).is_absolute()
    assert rehearsal_config(CONFIGS / "fsdp2_8gpu.yaml").strategy == "FSDP2"


def test_sequence_parallelism_is_kept_shrunk_to_the_two_processes_with_its_kernel(tmp_path):
    sp2 = rehearsal_config(CONFIGS / "cpu_2proc_sp.yaml")
    assert sp2.sp == 2 and not sp2.notes
    user = yaml.safe_load((CONFIGS / "cpu_2proc_sp.yaml").read_text())
    user.update(num_processes=8, parallelism_config={**user["parallelism_config"], "parallelism_config_sp_size": 8})
    (tmp_path / "sp8.yaml").write_text(yaml.safe_dump(user))
    (tmp_path / "ds_configs").symlink_to(ROOT / "ds_configs")
    sp8 = rehearsal_config(tmp_path / "sp8.yaml")
    assert sp8.sp == 2 and sp8.config["parallelism_config"]["parallelism_config_sp_size"] == 2
    assert "sequence parallelism 8 rehearsed as 2 (2 processes)" in sp8.notes
    args, _ = script_arguments(["--attention_backend", "sdpa"], tmp_path, 4, 2, 64, None, tmp_path, None)
    assert flag_value(args, "--attention_backend") == "sdpa"  # SP checks the model runs the kernel it was given
    tiny = tiny_config(get_preset("tiny"), 64)
    check_sequence_parallel(tiny, 64, 2)
    with pytest.raises(ValueError, match="--seq-len 63 must be divisible by it"):
        check_sequence_parallel(tiny, 63, 2)


def test_tensor_parallelism_is_read_from_the_deepspeed_json_and_shrunk_to_the_two_processes(tmp_path, monkeypatch):
    """AutoTP of 8 on a node is rehearsed as 2: a copy of the JSON in the rehearsal's folder, the user's untouched;
    the header says the degree, the groups and how the rehearsal's heads split."""
    from hf_pretrain.rehearse.launch import write_config
    from hf_pretrain.rehearse.report import header
    from hf_pretrain.rehearse.run import Rehearsal

    tp2 = rehearsal_config(CONFIGS / "cpu_2proc_tp.yaml")
    assert (tp2.tp, tp2.sp, tp2.group_size, tp2.notes, tp2.deepspeed_json) == (2, 1, 2, [], None)
    assert tp2.describe().endswith("(ds_configs/zero1_autotp.json), tensor parallelism 2: 1 data-parallel group")
    ds = json.loads((ROOT / "ds_configs" / "zero1_autotp.json").read_text())
    ds["tensor_parallel"]["autotp_size"] = 8
    (tmp_path / "tp8.json").write_text(json.dumps(ds))
    user = yaml.safe_load((CONFIGS / "cpu_2proc_tp.yaml").read_text())
    user.update(num_processes=16, deepspeed_config={**user["deepspeed_config"], "deepspeed_config_file": "tp8.json"})
    (tmp_path / "tp8.yaml").write_text(yaml.safe_dump(user))
    tp8 = rehearsal_config(tmp_path / "tp8.yaml")
    assert tp8.tp == 2 and tp8.notes == ["tensor parallelism 8 (AutoTP) rehearsed as 2 (2 processes)"]
    out = tmp_path / "out"
    out.mkdir()
    config = yaml.safe_load(write_config(tp8, out).read_text())
    shrunk = Path(config["deepspeed_config"]["deepspeed_config_file"])
    assert shrunk == (out / "deepspeed_config.json").resolve()
    assert json.loads(shrunk.read_text())["tensor_parallel"]["autotp_size"] == 2
    assert json.loads((tmp_path / "tp8.json").read_text())["tensor_parallel"]["autotp_size"] == 8
    monkeypatch.chdir(ROOT)
    request = RehearsalRequest(parse_launch(["--config_file", str(tmp_path / "tp8.yaml")]), out=out)
    lines = header(Rehearsal(request, tp8, "m", tp8.notes))
    assert lines[1].endswith("tensor parallelism 2: 1 data-parallel group") and lines[1].startswith("rehearsed  2 gloo")
    assert "changed    tensor parallelism 8 (AutoTP) rehearsed as 2 (2 processes)" in lines


def test_the_heads_of_the_rehearsal_s_model_split_by_deepspeed_s_rule():
    tiny = tiny_config(get_preset("tiny"), 64)
    assert tensor_parallel_heads(tiny, 2) == "TP 2: heads 2 + 2, KV heads 1 + 1"
    mqa = tiny_config(get_preset("tiny", num_key_value_heads=1), 64)  # measured to train (docs/distributed.md)
    assert tensor_parallel_heads(mqa, 2).startswith("TP 2: heads 4 + 0, KV heads 1 + 0 (fewer KV heads than TP ranks")
    uneven = tiny_config(get_preset("tiny"), 64)
    uneven.num_attention_heads, uneven.num_key_value_heads = 6, 3
    assert tensor_parallel_heads(uneven, 2) == "TP 2: heads 4 + 2, KV heads 2 + 1 (uneven, as AutoTP allows)"


def test_a_missing_deepspeed_json_is_named(tmp_path):
    config = yaml.safe_load((CONFIGS / "deepspeed_zero3_8gpu.yaml").read_text())
    config["deepspeed_config"]["deepspeed_config_file"] = "nowhere.json"
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    with pytest.raises(ValueError, match="deepspeed_config_file nowhere.json not found"):
        rehearsal_config(tmp_path / "c.yaml")


def test_the_tiny_model_keeps_pattern_windows_gqa_moe_and_vocabulary():
    tiny = tiny_config(get_preset("0.9b"), seq_len=64)
    assert tiny.layer_types == ["sliding_attention"] * 3 + ["full_attention"] and tiny.sliding_window == 16
    assert tiny.vocab_size == 65536 and tiny.hidden_size == 64
    gqa = tiny_config(get_preset("1.4b"), seq_len=64)
    assert (gqa.num_attention_heads, gqa.num_key_value_heads) == (8, 2)  # 16 heads / 4 KV: the group of 4 kept
    moe = tiny_config(get_preset("tiny-moe", moe_every=2), seq_len=64)
    assert (moe.num_experts, moe.num_experts_per_tok, moe.moe_every) == (4, 2, 2)
    assert moe.mlp_layer_types == ["dense", "sparse"]


def test_the_script_arguments_override_size_precision_and_resume_but_keep_the_rest(tmp_path):
    user = ["--preset", "0.9b", "--precision", "bf16", "--resume_from_checkpoint", "x", "--dataset_path", "DATA_PATH"]
    args, notes = script_arguments(user, tmp_path / "run", 12, 4, 64, tmp_path / "model", tmp_path / "data", None)
    assert flag_value(args, "--preset") == str(tmp_path / "model") and flag_value(args, "--max_steps") == "12"
    assert flag_value(args, "--precision") == "fp32" and "--resume_from_checkpoint" not in args
    assert "--dataset_path" not in args and any("DATA_PATH does not exist" in n for n in notes)


def test_the_launch_file_of_plan_is_read(tmp_path):
    line = 'accelerate launch --config_file examples/accelerate_configs/two_nodes.yaml --machine_rank "${MACHINE_RANK:-0}" examples/pretrain.py --preset tiny'
    (tmp_path / "launch.sh").write_text(f"#!/bin/sh\nset -e\n{line}\n")
    launch = parse_launch(read_launch_file(tmp_path / "launch.sh"))
    assert launch.script == Path("examples/pretrain.py") and launch.script_args == ["--preset", "tiny"]
    assert shlex.split(launch.command)[3].endswith("two_nodes.yaml")


@pytest.mark.parametrize("where", ["missing", "folder"])
def test_a_launch_file_that_is_no_file_is_one_error_line(tmp_path, capsys, where):
    from hf_pretrain.cli import main

    path = tmp_path / "no" / "launch.sh"
    if where == "folder":
        path = tmp_path / "plan"
        path.mkdir()
    assert main(["rehearse", "--launch-file", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --launch-file {path} ") and err.count("\n") == 1
    assert ("is a folder" if where == "folder" else "does not exist") in err and "launch.sh" in err


# The checks on records written by hand


def _run(records, name="straight"):
    return RunResult(name, [0], 1.0, Path("/nonexistent/launch.log"), records)


def _record(rank, steps, losses=None, **extra):
    micro = {str(s): [ids] for s, ids in steps.items()}
    losses = losses or {str(s): float(s) for s in steps}
    base = dict(rank=rank, world_size=2, node=0, finished=True, global_batch=4, dataset_rows=100, sampler="S")
    return {**base, "micro_batches": micro, "losses": losses, **extra}


def test_sharding_fails_when_two_ranks_train_the_same_sample_and_when_samples_are_skipped():
    topology = rehearsal_config(CONFIGS / "cpu_2proc.yaml")
    good = [_record(0, {1: [0, 1], 2: [4, 5]}, order=[0, 1, 2, 3, 4, 5, 6, 7]), _record(1, {1: [2, 3], 2: [6, 7]})]
    assert data_sharding(_run(good), topology).status == "passed"
    same = [_record(0, {1: [0, 1], 2: [4, 5]}), _record(1, {1: [0, 1], 2: [4, 5]})]
    check = data_sharding(_run(same), topology)
    assert check.status == "failed" and "read the same data" in check.detail
    skipped = [_record(0, {1: [0, 1], 2: [4, 5]}, order=[0, 1, 2, 3, 4, 5, 6, 7]), _record(1, {1: [2, 3], 2: [8, 9]})]
    check = data_sharding(_run(skipped), topology)
    assert check.status == "failed" and "trained by no rank" in check.detail


def test_sharding_under_tp_wants_the_same_rows_in_a_tp_group_and_disjoint_rows_across_groups():
    """The ranks of a TP group train the same batch by design: read by group, not as a sharding fault."""
    tp = rehearsal_config(CONFIGS / "cpu_2proc_tp.yaml")
    order = dict(order=[0, 1, 2, 3, 4, 5, 6, 7])
    same = [_record(0, {1: [0, 1], 2: [2, 3]}, **order), _record(1, {1: [0, 1], 2: [2, 3]})]
    check = data_sharding(_run(same), tp)
    assert check.status == "passed", check.detail
    assert check.detail.startswith(
        "4 samples over 2 steps on 2 ranks in 1 data-parallel group of TP 2: each TP group trained the same rows, "
        "none trained twice, none skipped: exactly the first 4 samples"
    )
    split = [_record(0, {1: [0, 1], 2: [4, 5]}), _record(1, {1: [2, 3], 2: [6, 7]})]  # sharded over every rank
    check = data_sharding(_run(split), tp)
    assert check.status == "failed" and "at step 1 rank 0 trained rows [0, 1] and rank 1 rows [2, 3]" in check.detail
    assert "one TP group must train the same rows" in check.detail and "autotp_size" in check.fix
    tp4 = rehearsal_config(CONFIGS / "cpu_2proc_tp.yaml", processes=4)  # 2 data-parallel groups of TP 2
    four = dict(world_size=4, global_batch=8)
    groups = [_record(r, {1: [0, 1] if r < 2 else [2, 3], 2: [4, 5] if r < 2 else [6, 7]}, **four) for r in range(4)]
    groups[0]["order"] = order["order"]
    check = data_sharding(_run(groups), tp4)
    assert check.status == "passed" and "8 samples over 2 steps on 4 ranks in 2 data-parallel groups" in check.detail
    every = [_record(r, {1: [0, 1], 2: [4, 5]}, **four) for r in range(4)]  # every group the same rows
    check = data_sharding(_run(every), tp4)
    assert check.status == "failed" and "The data-parallel groups read the same data" in check.detail
    assert "data-parallel group 0 (ranks 0-1) at step 1, data-parallel group 1 (ranks 2-3) at step 1" in check.detail
    skipped = [_record(r, {1: [0, 1] if r < 2 else [2, 3], 2: [4, 5] if r < 2 else [8, 9]}, **four) for r in range(4)]
    skipped[0]["order"] = order["order"]
    assert "trained by no rank" in data_sharding(_run(skipped), tp4).detail


def test_a_run_that_trained_no_step_is_no_pass_of_sharding_and_deepspeed_s_tp_check_is_a_failure(tmp_path):
    tp, log = rehearsal_config(CONFIGS / "cpu_2proc_tp.yaml"), tmp_path / "launch.log"
    untrained = RunResult("straight", [1], 1.0, log, [_record(0, {}), _record(1, {})])
    log.write_text("RuntimeError: something else\n")
    check = data_sharding(untrained, tp)
    assert check.status == "not run" and "no rank trained a step" in check.detail  # it said "passed": 0 samples
    log.write_text("AssertionError: Data inconsistency within the TP group. Please check the Dataloader ...\n")
    check = data_sharding(untrained, tp)
    assert check.status == "failed" and "the ranks of a TP group were given different rows" in check.detail


def test_the_failure_line_is_found_behind_torch_s_rank_prefix(tmp_path):
    log = tmp_path / "launch.log"
    log.write_text(
        "[rank1]: Traceback (most recent call last):\n"
        '[rank1]:   File "deepspeed/runtime/engine.py", line 1, in forward\n'
        "[rank1]: AssertionError: Data inconsistency within the TP group.\n"
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"
    )
    run = RunResult("straight", [1, 1], 1.0, log, [])
    assert run.error() == "AssertionError: Data inconsistency within the TP group."


def test_sharding_under_sp_wants_each_rank_of_a_group_its_part_of_the_same_rows():
    """Ulysses SP ranks record `[row, part]`: the same rows, each rank its own part, counted once per group."""
    sp = rehearsal_config(CONFIGS / "cpu_2proc_sp.yaml")

    def ranks(zero, one):
        return [_record(0, zero, order=[0, 1, 2, 3]), _record(1, one)]

    good = ranks({1: [[0, 0], [1, 0]], 2: [[2, 0], [3, 0]]}, {1: [[0, 1], [1, 1]], 2: [[2, 1], [3, 1]]})
    check = data_sharding(_run(good), sp)
    assert check.status == "passed", check.detail
    assert check.detail.startswith(
        "4 samples over 2 steps on 2 ranks in 1 data-parallel group of SP 2: each SP group trained the same rows, "
        "each rank its part of the sequence, none trained twice"
    )
    other_rows = ranks({1: [[0, 0], [1, 0]]}, {1: [[2, 1], [3, 1]]})
    check = data_sharding(_run(other_rows), sp)
    assert check.status == "failed" and "one SP group must train the same rows" in check.detail
    assert "UlyssesSPDataLoaderAdapter" in check.fix
    same_part = ranks({1: [[0, 0], [1, 0]]}, {1: [[0, 0], [1, 0]]})
    assert "rank 1 trained parts [0] of rows [0, 1], not part 1 of 2" in data_sharding(_run(same_part), sp).detail
    whole = ranks({1: [[0, 0], [1, 0]]}, {1: [0, 1]})
    assert "rank 1 trained whole rows of rows [0, 1]" in data_sharding(_run(whole), sp).detail
    unindexed = [{k: v for k, v in r.items() if k != "dataset_rows"} for r in good]
    assert data_sharding(_run(unindexed), sp).status == "not run"


def test_the_probe_knows_the_parts_of_a_row_an_sp_rank_trains_and_the_sampler_under_the_sp_adapter(tmp_path):
    from types import SimpleNamespace

    from hf_pretrain.rehearse.probe import Probe, _find_sampler, fingerprint

    probe = Probe(tmp_path, "0")
    probe.index_rows([[1, 2, 3, 4], [5, 6, 7, 8]], sp=2)
    assert probe.index[fingerprint([1, 2, 3, 4])] == 0 and probe.index[fingerprint([7, 8])] == [1, 1]
    sampler = SimpleNamespace(order=lambda epoch: [0])
    adapter = SimpleNamespace(dl=SimpleNamespace(base_dataloader=SimpleNamespace(batch_sampler=sampler)))
    assert _find_sampler(adapter) is sampler


def test_resume_fails_on_other_samples_then_on_other_losses():
    straight = _run([_record(0, {1: [0, 1], 2: [4, 5]}), _record(1, {1: [2, 3], 2: [6, 7]})])
    restarted = _run([_record(0, {2: [0, 1]}), _record(1, {2: [2, 3]})], "resumed")
    assert "data position" in resume(straight, restarted, 1).detail
    drifted = _run([_record(0, {2: [4, 5]}, {"2": 2.001}), _record(1, {2: [6, 7]})], "resumed")
    check = resume(straight, drifted, 1)
    assert check.status == "failed" and "other losses" in check.detail
    same = _run([_record(0, {2: [4, 5]}, {"2": 2.0}), _record(1, {2: [6, 7]}, {"2": 2.0})], "resumed")
    assert resume(straight, same, 1).status == "passed"


def test_recovery_passes_when_the_restarted_run_resumes_exactly_and_names_what_failed_otherwise(tmp_path):
    straight = _run([_record(0, {1: [0, 1], 2: [4, 5]}), _record(1, {1: [2, 3], 2: [6, 7]})])
    resumed = [_record(0, {2: [4, 5]}, {"2": 2.0}, start_step=1), _record(1, {2: [6, 7]}, {"2": 2.0}, start_step=1)]
    restarted = _run(resumed, "restarted")
    restarted.attempts, restarted.fault = 2, {"rank": 1, "step": 2, "kind": "kill"}
    check = unattended_recovery(straight, restarted, 2)
    assert check.status == "passed" and "resumed by itself" in check.detail and "resumed at step 1" in check.detail
    restarted.attempts = 1  # the launch ended with the first attempt: no restart allowed, or no rendezvous
    check = unattended_recovery(straight, restarted, 2)
    assert check.status == "failed" and "did not restart" in check.detail and "--max_restarts" in check.fix
    restarted.attempts, restarted.records = 2, [{**r, "start_step": 0} for r in resumed]
    assert "started again at step 0" in unattended_recovery(straight, restarted, 2).detail  # no auto resume
    hung = RunResult("hung", [0], 1.0, tmp_path / "hung" / "launch.log", resumed, attempts=2)
    hung.fault = {"rank": 1, "step": 2, "kind": "stop"}
    check = hang_recovery(straight, hung, 2)  # no attempt record: nothing noticed the hang
    assert check.status == "failed" and "nothing noticed the hang" in check.detail and "watchdog" in check.fix
    write_attempts(
        tmp_path / "hung" / "run",
        [Attempt(0, 0.0, 0, 2, "hang: ... rank 0 (vm, pid 9) stopped reporting"), Attempt(1, 1.0, 1)],
    )
    (tmp_path / "hung" / "run" / "recovery" / "stacks-rank0-step2.txt").write_text("")
    check = hang_recovery(straight, hung, 2)  # recovered, but the rank named is not the one stopped
    assert "did not name rank 1" in check.detail and "shares" in check.fix
    write_attempts(
        tmp_path / "hung" / "run",
        [Attempt(0, 0.0, 0, 2, "hang: ... rank 1 (vm, pid 9) stopped reporting"), Attempt(1, 1.0, 1)],
    )
    check = hang_recovery(straight, hung, 2)
    assert check.status == "passed" and "named the stopped rank and dumped stacks-rank0-step2.txt" in check.detail
    assert check.fix == ""


# Real rehearsals: 3 launches of 2 gloo processes each, about 2 minutes apiece on 2 cores (5 with recovery)


def rehearsal(
    tmp_path, monkeypatch, config: Path, script: str = "examples/pretrain.py", *script_args: str, recovery=False
):
    monkeypatch.chdir(ROOT)
    launch = parse_launch(["--config_file", str(config), script, *script_args])
    request = RehearsalRequest(launch, out=tmp_path, steps=6, save_steps=2, kill_at=5, timeout_s=400, recovery=recovery)
    result = rehearse(request)
    write_markdown(result)
    print(checklist(result))  # with -s: the checklist as the command prints it
    return result, {check.name: check for check in result.checks}


EXHAUSTIVE = pytest.mark.exhaustive  # make test: one rehearsal (two nodes); the checks' failures are unit-tested above


@pytest.mark.parametrize(
    "config",
    [
        pytest.param("cpu_2proc.yaml", id="ddp", marks=EXHAUSTIVE),
        pytest.param("deepspeed_zero3_8gpu.yaml", id="zero3", marks=EXHAUSTIVE),
        pytest.param("two_nodes.yaml", id="two_nodes"),
        pytest.param("fsdp2_8gpu.yaml", id="fsdp2", marks=EXHAUSTIVE),
    ],
)
@pytest.mark.slow
@pytest.mark.distributed
def test_the_shipped_configs_pass(tmp_path, monkeypatch, config):
    result, checks = rehearsal(tmp_path, monkeypatch, CONFIGS / config)
    assert result.passed, "\n".join(f"{c.name}: {c.status}: {c.detail} {c.fix}" for c in checks.values())
    assert len(checks) == 6
    assert "max |difference| 0.0e+00" in checks["resume exactness"].detail  # on CPU: every loss bit for bit
    if config == "two_nodes.yaml":
        assert "2 ranks on 2 node(s)" in checks["rendezvous"].detail


def rehearse_plan(plan, tmp_path, monkeypatch):
    """The plan's files written, and its launch.sh rehearsed on the example's embedded corpus: (files, result, checks)."""
    from hf_pretrain.plan import write_plan

    files = write_plan(plan, tmp_path / "plan")
    args = read_launch_file(files["launch"])
    args = args[args.index("examples/pretrain.py") + 1 :]
    drop = args.index("--dataset_path")
    del args[drop : drop + 2]  # the embedded corpus
    return files, *rehearsal(tmp_path / "out", monkeypatch, files["accelerate_config"], "examples/pretrain.py", *args)


@EXHAUSTIVE
@pytest.mark.slow
@pytest.mark.distributed
def test_the_sp_plan_launch_passes(tmp_path, monkeypatch):
    """hf-pretrain plan's SP launch (8B at 128K tokens on 8 H100s: Ulysses SP 2), rehearsed with SP on 2 ranks."""
    from hf_pretrain.plan import PlanRequest, make_plan

    plan = make_plan(PlanRequest("h100", gpus=8, params=8e9, tokens=160e9, seq_len=131072))
    assert plan.sp == 2
    files, result, checks = rehearse_plan(plan, tmp_path, monkeypatch)
    assert result.passed, "\n".join(f"{c.name}: {c.status}: {c.detail} {c.fix}" for c in checks.values())
    assert result.topology.sp == 2
    assert "max |difference| 0.0e+00" in checks["resume exactness"].detail


@EXHAUSTIVE
@pytest.mark.slow
@pytest.mark.distributed
def test_the_tp_plan_launch_passes(tmp_path, monkeypatch):
    """hf-pretrain plan's AutoTP launch (6B with SSSL windows at 128K tokens on 8 H100s: AutoTP 4 under ZeRO-1, its
    own DeepSpeed JSON in the plan folder), rehearsed with AutoTP shrunk to the 2 ranks."""
    from hf_pretrain.plan import PlanRequest, make_plan

    request = PlanRequest("h100", gpus=8, params=6e9, tokens=120e9, seq_len=131072, window_pattern="SSSL",
                          sliding_window=4096)  # fmt: skip
    plan = make_plan(request)
    assert plan.tp == 4
    files, result, checks = rehearse_plan(plan, tmp_path, monkeypatch)
    assert result.passed, "\n".join(f"{c.name}: {c.status}: {c.detail} {c.fix}" for c in checks.values())
    assert result.topology.tp == 2 and result.topology.deepspeed_file == files["deepspeed"]
    assert "tensor parallelism 4 (AutoTP) rehearsed as 2 (2 processes)" in result.topology.notes
    assert "each TP group trained the same rows" in checks["data sharding"].detail
    assert "max |difference| 0.0e+00" in checks["resume exactness"].detail


@EXHAUSTIVE
@pytest.mark.slow
@pytest.mark.distributed
def test_the_tp_launch_passes(tmp_path, monkeypatch):
    """cpu_2proc_tp.yaml (DeepSpeed AutoTP 2 under ZeRO-1): the TP group trains the same rows, which the data-sharding
    check reads as one data-parallel group, not as a fault."""
    result, checks = rehearsal(tmp_path, monkeypatch, CONFIGS / "cpu_2proc_tp.yaml")
    assert result.passed, "\n".join(f"{c.name}: {c.status}: {c.detail} {c.fix}" for c in checks.values())
    assert result.topology.tp == 2 and "TP 2: heads 2 + 2, KV heads 1 + 1" in result.model
    assert (
        "on 2 ranks in 1 data-parallel group of TP 2: each TP group trained the same rows"
        in checks["data sharding"].detail
    )
    assert "max |difference| 0.0e+00" in checks["resume exactness"].detail


@EXHAUSTIVE
@pytest.mark.slow
@pytest.mark.distributed
def test_a_killed_and_a_hung_rank_recover_unattended(tmp_path, monkeypatch):
    result, checks = rehearsal(tmp_path, monkeypatch, CONFIGS / "cpu_2proc.yaml", recovery=True)
    assert result.passed, "\n".join(f"{c.name}: {c.status}: {c.detail} {c.fix}" for c in checks.values())
    assert "resumed by itself" in checks["kill -9, unattended restart"].detail
    assert "named the stopped rank" in checks["hung rank, watchdog restart"].detail
    for name in ("resume exactness", "kill -9, unattended restart", "hung rank, watchdog restart"):
        assert "max |difference| 0.0e+00" in checks[name].detail, name  # on CPU: every loss bit for bit


@EXHAUSTIVE
@pytest.mark.distributed
def test_zero3_without_16bit_gathering_fails_the_consolidated_save(tmp_path, monkeypatch):
    result, checks = rehearsal(tmp_path, monkeypatch, HERE / "zero3_no_gather.yaml")
    check = checks["consolidated save + export"]
    assert check.status == "failed" and "stage3_gather_16bit_weights_on_model_save is false" in check.detail
    assert "true" in check.fix
    assert checks["resume exactness"].status == "passed"  # the fault is the final save only


@EXHAUSTIVE
@pytest.mark.distributed
def test_a_loader_giving_every_rank_the_same_samples_fails_sharding(tmp_path, monkeypatch):
    result, checks = rehearsal(
        tmp_path, monkeypatch, CONFIGS / "cpu_2proc.yaml", str(HERE / "faulty_pretrain.py"), "same-samples"
    )
    check = checks["data sharding"]
    assert check.status == "failed" and "read the same data" in check.detail and not result.passed


@EXHAUSTIVE
@pytest.mark.distributed
def test_a_loader_giving_the_ranks_of_a_tp_group_different_rows_fails_sharding(tmp_path, monkeypatch):
    result, checks = rehearsal(
        tmp_path, monkeypatch, CONFIGS / "cpu_2proc_tp.yaml", str(HERE / "faulty_pretrain.py"), "tp-split-rows"
    )
    check = checks["data sharding"]
    assert check.status == "failed" and "TP group" in check.detail and not result.passed


@EXHAUSTIVE
@pytest.mark.distributed
def test_a_script_that_does_not_resume_its_data_position_fails_resume(tmp_path, monkeypatch):
    result, checks = rehearsal(
        tmp_path, monkeypatch, CONFIGS / "cpu_2proc.yaml", str(HERE / "faulty_pretrain.py"), "no-data-resume"
    )
    check = checks["resume exactness"]
    assert check.status == "failed" and "data position" in check.detail
    assert checks["data sharding"].status == "passed"


def test_a_missing_consolidated_save_is_explained_by_the_config_that_caused_it(tmp_path):
    from hf_pretrain.rehearse.checks import consolidated_save

    (tmp_path / "run").mkdir()
    straight = RunResult("straight", [0, 0], 1.0, tmp_path / "launch.log", [_record(0, {}), _record(1, {})])
    fsdp = consolidated_save(straight, rehearsal_config(CONFIGS / "fsdp2_8gpu.yaml"), tmp_path)
    assert fsdp.status == "failed" and "SHARDED_STATE_DICT" in fsdp.detail and "FULL_STATE_DICT" in fsdp.fix
    zero3 = consolidated_save(straight, rehearsal_config(HERE / "zero3_no_gather.yaml"), tmp_path)
    assert "stage3_gather_16bit_weights_on_model_save is false" in zero3.detail
    ddp = consolidated_save(straight, rehearsal_config(CONFIGS / "cpu_2proc.yaml"), tmp_path)
    assert "no model weights" in ddp.detail and "save_model" in ddp.fix


def test_the_command_line_leaves_the_launch_flags_to_the_launch(capsys):
    from hf_pretrain.cli import main

    assert main(["rehearse", "--steps", "3", "accelerate", "launch", "--config_file", "nowhere.yaml"]) == 2
    assert "--config_file nowhere.yaml: no such file" in capsys.readouterr().err
    assert main(["rehearse", "--out", "x"]) == 2
    assert "no launch given" in capsys.readouterr().err


# What a rehearsal prints while it waits, and a SIGTERM in the middle of one


def test_the_waiting_line_says_the_step_the_fault_or_the_launch_s_last_line(tmp_path):
    log = tmp_path / "launch.log"
    log.write_text("W1207 some warning\n[data] 07-pack:   0%|\n\n")
    assert waiting_for([], None, 2, log, None) == (
        "waiting for the ranks to start training (the launch's last line: [data] 07-pack:   0%|)"
    )
    training = [_record(0, {1: [0], 2: [1]}, max_steps=6, finished=False), _record(1, {1: [2]}, finished=False)]
    assert waiting_for(training, None, 2, log, None) == "step 2 of 6 (2 of 2 ranks reporting)"
    assert waiting_for(training[:1], 1, 2, log, None) == "attempt 1: step 2 of 6 (1 of 2 ranks reporting)"
    done = [_record(0, {1: [0]}), _record(1, {1: [2]})]
    assert waiting_for(done, None, 2, log, None) == (
        "every rank finished training; waiting for the script (its final save) and the launch to end"
    )
    fault = {"rank": 1, "step": 5, "kind": "stop"}
    assert waiting_for(training, 0, 2, log, fault) == (
        "rank 1 stopped in step 5 (planted); waiting for the hang watchdog to notice and the launch to restart the ranks"
    )
    assert "killed in step 5 (planted); waiting for the launch to tear down" in waiting_for(
        training, None, 2, log, {**fault, "kind": "kill"}
    )


def test_the_deepspeed_op_build_says_it_is_building_and_leaves_no_process(tmp_path, capsys):
    """A rehearsal of a DeepSpeed config printed nothing while the op built (minutes the first time). The real
    build, cached here (DeepSpeed's import alone takes seconds): a line every 0.3 s, with the build's last line."""
    import psutil

    build_deepspeed_ops(tmp_path / "build.log", progress_s=0.3)
    lines = capsys.readouterr().out.splitlines()
    said = [
        re.fullmatch(
            r"\[rehearse\] DeepSpeed: building its CPU comm op, (\d+) s so far \(the build's last line: .+\)", x
        )
        for x in lines
    ]
    assert len(lines) >= 2 and all(said), lines
    assert [int(m.group(1)) for m in said] == sorted(int(m.group(1)) for m in said)
    assert (tmp_path / "build.log").exists()
    left = [p for p in psutil.Process().children(recursive=True) if "ShareMemCommBuilder" in " ".join(p.cmdline())]
    assert left == []


@pytest.mark.distributed
def test_a_sigterm_ends_the_rehearsal_and_every_process_of_its_launch(tmp_path):
    """`timeout 150 hf-pretrain rehearse ...` left `accelerate launch` and both ranks running under PID 1. Here: the
    real command, SIGTERMed once both ranks of its first run are up and it has said what it waits for (a line a
    second); it must exit 143 and no process of its tree may survive it."""
    import signal
    import subprocess
    import sys
    import threading
    import time

    import psutil

    command = [sys.executable, "-m", "hf_pretrain.cli", "rehearse", "--out", str(tmp_path), "--steps", "6",
               "--save-steps", "2", "--kill-at", "5", "--no-recovery", "--progress-seconds", "1",
               "accelerate", "launch", "--config_file", str(CONFIGS / "cpu_2proc.yaml"), "examples/pretrain.py"]  # fmt: skip
    rehearsal = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: [lines.append(line) for line in rehearsal.stdout], daemon=True).start()
    tree: set = set()
    try:
        deadline = time.time() + 240
        while time.time() < deadline and rehearsal.poll() is None:
            with contextlib.suppress(psutil.Error):  # the rehearsal may have ended: the assertion below says so
                tree |= set(psutil.Process(rehearsal.pid).children(recursive=True))
            ranks = [p for p in tree if _is_rank(p)]
            waited = [line for line in lines if re.match(r"\[rehearse\] straight: \d+ s, ", line)]
            if len(ranks) == 2 and len(waited) >= 2:
                break
            time.sleep(0.2)
        assert len(ranks) == 2 and len(waited) >= 2, "".join(lines) + rehearsal.stderr.read()
        assert lines[0].startswith("[rehearse] model: writing") and any("straight: started: " in x for x in lines)
        seconds = [int(re.search(r": (\d+) s, ", line).group(1)) for line in waited]
        assert seconds == sorted(seconds) and len(set(seconds)) == len(seconds)  # a line a second, each later
        survivors = [p for p in tree if p.is_running()]
        assert len(survivors) >= 3  # the launcher and both ranks, when the signal goes
        rehearsal.send_signal(signal.SIGTERM)
        assert rehearsal.wait(timeout=60) == 128 + signal.SIGTERM
        assert "stopped by SIGTERM; no process of the launch is left running" in rehearsal.stderr.read()
        _, alive = psutil.wait_procs(survivors, timeout=10)
        assert alive == [], [p.cmdline() for p in alive]
    finally:  # a failed test leaves nothing running either
        rehearsal.kill()
        for process in tree:
            with contextlib.suppress(psutil.Error):
                process.kill()


def _is_rank(process) -> bool:
    import psutil

    with contextlib.suppress(psutil.Error):
        line = " ".join(process.cmdline())
        return process.is_running() and "probe.py" in line and "accelerate.commands.launch" not in line
    return False
