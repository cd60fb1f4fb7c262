import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from hf_pretrain.telemetry.jsonl import read_jsonl
from hf_pretrain.telemetry.straggler_rule import FIELDS, reading_of, reasons_mask, straggler_report, straggler_scores
from hf_pretrain.telemetry.underclock import underclock_warning
from tests.telemetry import engine_timelines as timelines

HERE = Path(__file__).resolve().parent


def row(compute, wait, step, clock=-1.0, power=-1.0, reasons=-1.0, local=0.0, wait_free=1.0):
    return dict(
        compute_s=compute,
        local_s=local,
        wait_s=wait,
        data_wait_s=0.0,
        step_s=step,
        sm_clock_mhz=clock,
        sm_clock_max_mhz=-1.0,
        power_w=power,
        utilization_pct=-1.0,
        memory_gib=-1.0,
        reasons=reasons,
        wait_free=wait_free,
        steps=4.0,
    )


def test_field_notes_straggler_message():
    # Two GB10s: rank 1 stuck at ~600 MHz; rank 0 (2190 MHz) waits 3.3 s of each 7.2 s step.
    rows = [row(3.9, 3.3, 7.2, clock=2190, power=80, reasons=0), row(7.2, 0.0, 7.2, clock=600, power=30, reasons=0)]
    metrics, warning = straggler_report(rows, ["node-a", "node-b"], threshold=0.75)
    assert (
        warning == "rank 1 (node-b) 1.8x slower, SM 600/2190 MHz, 30 W, no throttle flag; rank 0 waits 3.3 s of 7.2 s"
    )
    assert metrics["rank1_score"] == pytest.approx(3.9 / 7.2) and metrics["rank0_score"] == 1.0
    assert metrics["straggler_score_min"] == pytest.approx(0.5417, abs=1e-4)
    assert metrics["rank1_sm_clock_mhz"] == 600 and metrics["rank0_wait_s"] == 3.3
    # a limiting reason is named as such; reasons NVML did not report are not guessed either way
    _, capped = straggler_report([rows[0], {**rows[1], "reasons": 0x4}], ["node-a", "node-b"], 0.75)
    _, unknown = straggler_report([rows[0], {**rows[1], "reasons": -1.0}], ["node-a", "node-b"], 0.75)
    assert "throttle flag set" in capped and "throttle" not in unknown


def test_balanced_ranks_and_cpu_ranks_give_no_warning_and_no_made_up_clocks():
    metrics, warning = straggler_report([row(1.0, 0.1, 1.2), row(1.1, 0.0, 1.2)], ["a", "b"], 0.75)
    assert warning is None and metrics["straggler_score_min"] == pytest.approx(1 / 1.1)
    assert "rank0_sm_clock_mhz" not in metrics  # CPU ranks: no clock, not 0


@pytest.mark.parametrize("engine", timelines.ENGINES)
@pytest.mark.parametrize("micro_batches", [1, 4])
def test_the_field_straggler_is_named_under_every_engine(engine, micro_batches):
    """Rank 1 at 600 MHz, rank 0 at 2190: the simulated GPU timelines of each engine, through the one rule."""
    rows = timelines.rows(engine, [1.0, timelines.CLOCK_RATIO], micro_batches=micro_batches)
    # the step is the field's 7.2 s on both ranks: they are coupled by the collectives
    assert [r["step_s"] for r in rows] == pytest.approx([7.2, 7.2], abs=0.01)
    metrics, warning = straggler_report(rows, ["node-a", "node-b"], threshold=0.75)
    assert warning is not None and warning.startswith("rank 1 (node-b)"), (engine, rows)
    assert metrics["straggler_slowest_rank"] == 1 and metrics["rank1_score"] < 0.75 <= metrics["rank0_score"]
    if engine == "ddp":  # compute ends at the last bucket: the healthy rank's wait is measured, as in the field
        assert re.search(r"1\.[89]x slower; rank 0 waits 3\.3 s of 7\.2 s$", warning)  # 7.2 / 3.9 = 1.85
        assert metrics["rank0_wait_s"] == pytest.approx(3.3, abs=0.05)
        assert metrics["rank1_score"] == pytest.approx(3.9 / 7.2, abs=0.01)
    else:  # DeepSpeed / FSDP: every rank waits for the slow one *inside* its micro-batches
        compute = [r["compute_s"] for r in rows]
        assert min(compute) / max(compute) > 0.95  # so compute alone cannot see it (the old rule never fired)
        assert re.search(r"3\.[67]x slower in its forward matmuls", warning)  # the linears: the clock ratio 3.65
        assert metrics["rank1_score"] == pytest.approx(600 / 2190, abs=0.01)
        assert "wait for it inside the collectives" in warning


@pytest.mark.parametrize("engine", timelines.ENGINES)
@pytest.mark.parametrize("world, slow", [(4, 2), (8, 0)])
def test_the_slow_rank_of_a_larger_world_is_named(engine, world, slow):
    slowdown = [1.0] * world
    slowdown[slow] = 3.0  # matmuls 3x slower: the whole step ~1.6x
    rows = timelines.rows(engine, slowdown, jitter=0.03, seed=world)
    metrics, warning = straggler_report(rows, [f"node-{r}" for r in range(world)], threshold=0.75)
    assert warning is not None and metrics["straggler_slowest_rank"] == slow, (engine, warning)
    assert [r for r in range(world) if metrics[f"rank{r}_score"] < 0.75] == [slow]


@pytest.mark.parametrize("engine", timelines.ENGINES)
@pytest.mark.parametrize("seed", range(5))
def test_healthy_ranks_with_jitter_are_quiet_under_every_engine(engine, seed):
    rows = timelines.rows(engine, [1.0] * 4, jitter=0.05, seed=seed, micro_batches=2)
    metrics, warning = straggler_report(rows, ["a", "b", "c", "d"], threshold=0.75)
    assert warning is None and metrics["straggler_score_min"] > 0.85


def test_the_basis_is_compute_only_where_compute_is_each_rank_own_work():
    ddp, zero3 = timelines.rows("ddp", [1.0, 2.0]), timelines.rows("zero3", [1.0, 2.0])
    assert straggler_scores(ddp)[1] == "compute" and straggler_scores(zero3)[1] == "local"
    # no linear timing (a compiled model): the compute measure is all there is, blind under ZeRO-3
    blind = [{**r, "local_s": 0.0} for r in zero3]
    scores, basis = straggler_scores(blind)
    assert basis == "compute" and min(scores) > 0.95
    # a rank with no step read yet (GPU events still pending) gives no verdict rather than a score of 0
    assert straggler_scores([row(0.0, 0.0, 0.0), row(1.0, 0.1, 1.2)])[0] == [1.0, 1.0]


def test_ranks_holding_unequal_shards_are_judged_per_multiply_add():
    """AutoTP splits heads and MLP columns unevenly where they do not divide (and gives ranks past the KV heads no
    attention shard): a rank holding twice the work takes twice as long in its linears without being slow."""
    even = row(1.0, 0.1, 1.2, wait_free=0.0)
    rows = [{**even, "local_s": 0.02, "local_work": 2e9}, {**even, "local_s": 0.01, "local_work": 1e9}]
    metrics, warning = straggler_report(rows, ["a", "b"], 0.75)
    assert warning is None and metrics["straggler_score_min"] == pytest.approx(1.0)
    # a rank 1.5x slower per multiply-add is named, though its linears took less time than the other's (half the work)
    slow = [rows[0], {**rows[1], "local_s": 0.015}]
    metrics, warning = straggler_report(slow, ["a", "b"], 0.75)
    assert metrics["straggler_slowest_rank"] == 1 and warning.startswith("rank 1 (b) 1.5x slower in its forward")
    assert metrics["rank1_score"] == pytest.approx(2 / 3)
    # a row without the count (a rank whose linears were not timed): the raw times, as before
    assert straggler_scores([rows[0], {**rows[1], "local_work": 0.0}])[0] == pytest.approx([0.5, 1.0])


def test_a_gathered_reading_round_trips_to_the_same_underclock_verdict():
    from hf_pretrain.telemetry.sensors import NvmlSensors
    from tests.telemetry.nvml_fixtures import GB10, GB10_STUCK, GB10_STUCK_NO_UTIL, H100_SXM, H200_IDLE, FakeNvml

    for fixture in (GB10, GB10_STUCK, GB10_STUCK_NO_UTIL, H100_SXM, H200_IDLE):
        reading = NvmlSensors(nvml=FakeNvml(fixture)).read()
        gathered = {
            "sm_clock_mhz": reading.get("gpu_sm_clock_mhz", -1.0),
            "sm_clock_max_mhz": reading.get("gpu_sm_clock_max_mhz", -1.0),
            "power_w": reading.get("gpu_power_w", -1.0),
            "utilization_pct": reading.get("gpu_utilization_pct", -1.0),
            "reasons": reasons_mask(reading.get("gpu_throttle_reasons")),
        }
        assert set(gathered) < set(FIELDS)
        local = underclock_warning(reading, rank=1, host="node-b")
        remote = underclock_warning(reading_of(gathered), rank=1, host="node-b")
        assert local == remote, fixture["name"]


def test_each_linear_forward_is_timed_on_the_sampled_steps_only():
    from types import SimpleNamespace

    import torch
    from transformers import TrainerControl, TrainerState

    from hf_pretrain import PretrainForCausalLM
    from hf_pretrain.telemetry.straggler import LOCAL_SAMPLES, StragglerCallback, timed_linears
    from tests.conftest import small_config

    model = PretrainForCausalLM(small_config())
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules())
    callback, state, control = StragglerCallback(every=5), TrainerState(), TrainerControl()
    callback.trainer = SimpleNamespace(model=model, model_wrapped=model, args=SimpleNamespace(torch_compile=False))
    args = SimpleNamespace(process_index=0, world_size=1, device=torch.device("cpu"))
    callback.on_train_begin(args, state, control)
    ids = torch.randint(0, 128, (2, 16))
    hooked, samples = [], []
    for step in range(1, 6):
        callback.on_step_begin(args, state, control)
        hooked.append(bool(model.model.layers[0].mlp.up_proj._forward_hooks))
        callback.before_micro_batch()
        model(input_ids=ids, labels=ids).loss.backward()
        callback.record_micro_batch(0.0, 0.0)
        assert not model.lm_head._forward_hooks  # the head is never hooked: the chunked loss stays on
        if hooked[-1]:
            assert len(callback._local) == linears - 1  # one window per other linear of the forward
        state.global_step = step
        if step == 5:  # the exchange empties the window: read it first
            local, compute = list(callback.window["local_s"]), list(callback.window["compute_s"])
        callback.on_step_end(args, state, control)
        samples.append(len(callback.window["local_s"]))
        assert not model.model.layers[0].mlp.up_proj._forward_hooks  # removed after every step
    # the last LOCAL_SAMPLES steps of the window of 5 timed their linears; the first two paid nothing for it
    assert hooked == [False, False, True, True, True] and LOCAL_SAMPLES == 3
    assert samples == [0, 0, 1, 2, 0] and len(local) == 2 and len(compute) == 4
    logged = callback.metrics_for_log(state)  # the exchange at step 5: medians over the sampled steps
    assert 0 < logged["local_s"] < logged["compute_s"] <= logged["step_s"]
    # the multiply-adds the timed linears did each step: tokens x in x out of every linear but the head
    macs = sum(ids.numel() * m.in_features * m.out_features for m in timed_linears(model))
    assert callback.work == [] and callback._local_row()["local_work"] == 0  # emptied by the exchange
    assert macs > 0 and callback._work == macs
    model(input_ids=ids)  # outside a step (evaluation, generation): not hooked, not timed
    assert len(callback._local) == linears - 1  # unchanged: nothing is timed outside a step
    callback.on_train_end(args, state, control)
    assert callback._handles == []
    # a compiled model is not hooked (hooks would break its graph): no linear timing, no error
    callback.trainer.args.torch_compile = True
    callback.on_train_begin(args, state, control)
    callback.on_step_begin(args, TrainerState(global_step=4), control)
    assert callback._handles == [] and callback._linears == []


def launch(tmp_path, nproc, slow=None, accumulation=1, threshold=0.75, steps=8, every=4, engine="ddp"):
    """straggler_run.py on `nproc` CPU ranks: torchrun for DDP, AutoTP and SP (the DeepSpeed config and the SP size
    are arguments there, as in tests/distributed/), `accelerate launch` with the CPU configs for ZeRO-3
    (cpu_2proc.yaml + ds_configs/zero3.json) and FSDP2 (cpu_2proc_fsdp2.yaml)."""
    root = HERE.parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(root)}
    with socket.socket() as s:  # a free port for the rendezvous (torchrun's static rendezvous refuses port 0)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    script = [str(tmp_path), slow or "", str(accumulation), str(threshold), str(steps), str(every), engine]
    if engine not in ("zero3", "fsdp2"):  # DDP, AutoTP, SP
        launcher = ["torch.distributed.run", f"--nproc_per_node={nproc}", f"--master_port={port}"]
        cmd = [sys.executable, "-m", *launcher, "-m", "tests.telemetry.straggler_run", *script]
    else:
        config = (
            root
            / "examples"
            / "accelerate_configs"
            / ("cpu_2proc_fsdp2.yaml" if engine == "fsdp2" else "cpu_2proc.yaml")
        )
        launcher = ["accelerate.commands.launch", "--config_file", str(config), "--main_process_port", str(port)]
        cmd = [sys.executable, "-m", *launcher, str(HERE / "straggler_run.py"), *script]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900, cwd=root)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return read_jsonl(tmp_path), proc


@pytest.mark.distributed
@pytest.mark.exhaustive  # make test: the DDP rule on two real ranks in tests/test_gpu_check.py's dry run (straggler_2proc)
@pytest.mark.parametrize("accumulation", [1, 4])
def test_two_cpu_ranks_the_slow_one_is_named(tmp_path, accumulation):
    records, proc = launch(tmp_path, 2, slow="1:0.1", accumulation=accumulation)
    flagged = [r for r in records if "straggler_warning" in r]
    assert flagged, records
    assert flagged[0]["straggler_warning"].startswith("rank 1 (") and flagged[0]["straggler_slowest_rank"] == 1
    assert flagged[0]["rank1_score"] < 0.75 <= flagged[0]["rank0_score"]
    # rank 0 waits for the slow rank: at least the injected 0.1 s of CPU time per micro-batch, more in wall time
    # on a loaded machine; the slow rank hardly waits
    assert flagged[0]["rank0_wait_s"] > 0.06 * accumulation
    assert flagged[0]["rank1_wait_s"] < 0.5 * flagged[0]["rank0_wait_s"]
    # the rank is slowed inside its linears: their forward time (the measure ZeRO / FSDP runs are judged on)
    # names it too
    assert 0 < flagged[0]["rank0_local_s"] < 0.75 * flagged[0]["rank1_local_s"]
    assert "straggler at step" in proc.stderr + proc.stdout


@pytest.mark.distributed
@pytest.mark.parametrize("engine", ["fsdp2", pytest.param("zero3", marks=pytest.mark.exhaustive)])
def test_under_sharding_the_rank_slow_in_its_linears_is_named(tmp_path, engine):
    """ZeRO-3 and FSDP2 gather weights inside forward and backward, so every rank waits for the slow one inside
    its compute: the rule reads `local_s`, each rank's own linear forward time. One real 2-rank run per engine."""
    first = assert_rank_one_named_by_its_linears(tmp_path, engine)
    # the other ranks' wait is in the gathers inside forward and backward
    assert "wait for it inside the collectives" in first["straggler_warning"]


def assert_rank_one_named_by_its_linears(tmp_path, engine: str) -> dict:
    """Rank 1 slowed by 0.1 s per forward inside its timed linears, on 2 ranks of `engine`: named on the local basis
    (no DDP bucket hook), with equal shards scored by their local times; the first record that flags it."""
    records, proc = launch(tmp_path, 2, slow="1:0.1", engine=engine)
    flagged = [r for r in records if "straggler_warning" in r]
    assert flagged, records
    first = flagged[0]
    assert first["straggler_slowest_rank"] == 1 and first["straggler_warning"].startswith("rank 1 (")
    assert "in its forward matmuls" in first["straggler_warning"]
    assert first["rank1_score"] == pytest.approx(first["rank0_local_s"] / first["rank1_local_s"])
    assert first["rank1_score"] < 0.75 <= first["rank0_score"]
    # rank 1's linears carry the injected 0.1 s per forward (spread over them) on top of their own work
    assert first["rank1_local_s"] - first["rank0_local_s"] == pytest.approx(0.1, rel=0.5)
    assert "straggler at step" in proc.stderr + proc.stdout
    return first


@pytest.mark.distributed
@pytest.mark.exhaustive  # make test: the rule on jittered healthy timelines of every engine (above)
def test_two_balanced_cpu_ranks_and_one_process_are_quiet(tmp_path):
    # Two equal ranks sharing two cores with whatever else runs here: a score of 0.5 (one rank twice as slow) is
    # a straggler, the jitter of a busy machine is not (medians over 8 steps)
    records, _ = launch(tmp_path / "two", 2, threshold=0.5, steps=16, every=8)
    logs = [r for r in records if "straggler_score_min" in r]
    assert logs and all("straggler_warning" not in r for r in records)
    single, _ = launch(tmp_path / "one", 1)
    one = next(r for r in single if "straggler_score_min" in r)
    # one process waits for nobody: what is not compute is the optimizer step and callbacks (a few ms; more on a
    # busy machine), never most of the step
    assert one["straggler_score_min"] == 1.0 and one["wait_s"] < 0.5 * one["step_s"] and "rank1_score" not in one


TP_SP = ["autotp", pytest.param("sp", marks=pytest.mark.exhaustive)]


@pytest.mark.distributed
@pytest.mark.parametrize("engine", TP_SP)
def test_under_tensor_and_sequence_parallelism_the_rank_slow_in_its_linears_is_named(tmp_path, engine):
    """AutoTP=2 (ZeRO-1) and Ulysses SP=2 (ZeRO-3) on 2 gloo ranks: one group whose ranks train equal shards of one
    batch and wait for each other inside forward (AutoTP's row-parallel all-reduce, Ulysses' all-to-all). The rule
    reads `local_s`: under AutoTP the column-parallel layers DeepSpeed put in place of q/k/v, gate and up (no
    collective in their forward), under SP the plain linears."""
    assert_rank_one_named_by_its_linears(tmp_path, engine)


@pytest.mark.distributed
@pytest.mark.exhaustive  # make test: the slowed rank named under AutoTP (above), equal and unequal work by the rule
@pytest.mark.parametrize("engine", ["autotp", "sp", "autotp-uneven"])
def test_under_tensor_and_sequence_parallelism_equal_ranks_are_quiet(tmp_path, engine):
    """Nobody slowed: no warning at the threshold of the DDP case (0.5: jitter is not half speed), every rank scored
    on its linears. `autotp-uneven`: rank 0 holds 1.5x rank 1's multiply-adds (all the attention) and takes longer
    in its linears (measured 1.35x and 1.6x: raw scores of 0.74 and 0.62), and is not named (0.90 and 0.93 per multiply-add)."""
    threshold = 0.75 if engine == "autotp-uneven" else 0.5
    records, _ = launch(tmp_path, 2, threshold=threshold, engine=engine)
    logs = [r for r in records if "straggler_score_min" in r]
    assert logs and all("straggler_warning" not in r for r in records), logs
    assert all(r["rank0_local_s"] > 0 and r["rank1_local_s"] > 0 for r in logs)  # scored on the linears
    if engine == "autotp-uneven":
        assert all(r["rank0_local_s"] > r["rank1_local_s"] for r in logs)  # the larger shard takes longer
