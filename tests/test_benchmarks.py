"""The benchmark scripts run (their timings are printed, never asserted)."""

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def load(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_step_time_benchmark_runs_and_prints_a_ratio(capsys):
    ratios = load("step_time").main(["--presets", "tiny", "--rounds", "1", "--steps", "2", "--seq-len", "32"])
    assert set(ratios) == {"tiny"} and ratios["tiny"] > 0
    assert "ratio" in capsys.readouterr().out


@pytest.mark.slow
def test_attention_benchmark_times_every_backend_that_runs_here(capsys):
    load("attention").main(["--seq-len", "64", "--window", "16", "--heads", "2", "--head-dim", "16", "--repeats", "1"])
    out = capsys.readouterr().out
    assert "full sdpa" in out and "window 16 sdpa" in out and "eager" in out and "x the fastest" in out


def test_resume_benchmark_agrees_on_the_next_batch_and_prints_ratios(capsys):
    ratios = load("resume").main(["--samples", "20000", "--positions", "10", "1000"])
    assert set(ratios) == {10, 1000} and all(r > 0 for r in ratios.values())
    assert "positioned" in capsys.readouterr().out


@pytest.mark.slow
def test_async_checkpoint_benchmark_times_the_stall_of_both_kinds_of_save(tmp_path, capsys):
    sizes = ["--layers", "1", "--hidden", "64", "--vocab", "512", "--rounds", "1", "--steps", "6", "--save-every", "2"]
    results = load("async_checkpoint").main([*sizes, "--out", str(tmp_path)])
    assert len(results["async"]) == len(results["sync"]) == 2 and len(results["ratio"]) == len(results["first"]) == 1
    assert "stall async / sync, saves after a run's first: median" in capsys.readouterr().out


@pytest.mark.slow
def test_data_pipeline_benchmark_runs_every_step(tmp_path, capsys):
    rates = load("data_pipeline").main(
        ["--mb", "0.3", "--vocab-size", "400", "--seq-len", "128", "--workdir", str(tmp_path)]
    )
    assert {"read", "clean", "exact_dedup", "minhash_dedup", "tokenizer", "pack train"} <= set(rates)
    assert "tokens/s" in capsys.readouterr().out


@pytest.mark.slow
def test_muon_benchmark_prints_the_step_ratio_and_both_differences(tmp_path, capsys):
    result = load("muon").main(["--steps", "3", "--seq-len", "32", "--repeats", "2", "--workdir", str(tmp_path)])
    assert set(result) == {"step_time_ratio", "equal_steps_difference", "equal_time_difference"}
    assert result["step_time_ratio"] > 0  # a timing: printed, never bounded (it was 10.1 on a loaded CI machine)
    assert abs(result["equal_steps_difference"]) < 10 and abs(result["equal_time_difference"]) < 10  # nats/token
    out = capsys.readouterr().out
    assert "Muon / AdamW" in out and "equal wall-clock" in out and "optimizer: Muon for 28 hidden matrices" in out


@pytest.mark.exhaustive  # make test: FSDP2 against ZeRO-3 in tests/distributed/
@pytest.mark.distributed
def test_fsdp2_benchmark_runs_both_strategies_and_prints_ratios(capsys):
    small = ["--steps", "4", "--layers", "2", "--vocab", "1024", "--hidden", "128", "--seq", "32", "--batch", "2"]
    ratios = load("fsdp2").main(small)
    assert set(ratios) == {"step_s", "model_state_bytes", "rss_growth_bytes"} and all(r > 0 for r in ratios.values())
    assert ratios["model_state_bytes"] < 0.6  # each rank holds about half of the states (a count, not a time)
    assert "ratio FSDP2/DDP" in capsys.readouterr().out


@pytest.mark.exhaustive  # make test: compiled against eager in tests/training/test_compile.py
def test_compile_benchmark_times_eager_whole_model_and_blocks(capsys):
    args = ["--layers", "1", "--hidden", "64", "--vocab", "256", "--seq", "32", "--steps", "1", "--backend", "eager"]
    results = load("compile").main(args)  # Dynamo traces, no compiler: the smoke of every code path in seconds
    assert set(results) == {1} and set(results[1]) == {"eager", "model", "blocks"}
    assert results[1]["blocks"]["graphs"] == 1 and results[1]["model"]["breaks"] == 0
    assert results[1]["model"]["loss"] == pytest.approx(results[1]["eager"]["loss"], rel=1e-5)
    assert "x eager" in capsys.readouterr().out


@pytest.mark.exhaustive
def test_data_scale_benchmark_runs_on_the_local_executor(capsys):
    results = load("data_scale").main(["--docs", "200", "--scales", "1", "2", "--executors", "local"])
    quality = results[("quality", 2)]
    assert quality["sharded"]["recall"] == quality["one"]["recall"]
    assert "docs/s/core" in capsys.readouterr().out


def test_telemetry_overhead_is_the_mean_over_whole_windows_of_sampled_steps():
    """The callbacks load a few steps on purpose (linears timed on 3 steps of each straggler window, JSONL at the
    logging steps): the overhead is the mean over whole windows, which counts them, where a median hides them."""
    module = load("telemetry_overhead")
    runs = {True: [1.0, 1.0, 1.0, 5.0], False: [1.0, 1.0, 1.0, 1.0]}  # one sampled step 4x dearer
    result = module.overhead(2, lambda extras: {"wall": runs[extras]})["wall"]
    assert result["ratio"] == pytest.approx(2.0) and result["round_ratios"] == pytest.approx([2.0, 2.0])
    assert result["steps"] == 8
    module.check_whole_windows(40, 20, 10)
    for steps in (30, 0):  # part of a straggler window; nothing
        with pytest.raises(ValueError, match="whole number of straggler windows"):
            module.check_whole_windows(steps, 20, 10)


@pytest.mark.slow
def test_telemetry_overhead_benchmark_times_whole_windows_and_prints_mean_ratios(capsys):
    args = ["--rounds", "1", "--steps", "4", "--straggler-every", "4", "--logging-steps", "2"]
    ratio = load("telemetry_overhead").main(args)
    out = capsys.readouterr().out
    assert ratio > 0 and "means over whole windows" in out and "4 steps each" in out and "cpu:" in out


@pytest.mark.distributed
def test_failure_exchange_benchmark_times_the_three_loops_on_gloo_ranks(capsys):
    results = load("failure_exchange").main(["--ranks", "2", "--steps", "3", "--rounds", "1", "--width", "64"])
    assert set(results) == {2} and {"none", "in flight", "per micro-batch"} <= set(results[2])
    assert results[2]["ratio"] > 0 and "2 gloo ranks: none" in capsys.readouterr().out


def test_writer_gil_benchmark_times_both_writers(tmp_path, capsys):
    results = load("writer_gil").main(["--gib", "0.01", "--dir", str(tmp_path)])
    assert set(results) == {"torch.save", "safetensors save_file"} and all(t > 0 for t, _ in results.values())
    assert "the main thread's longest wait" in capsys.readouterr().out and not list(tmp_path.iterdir())


def test_datatrove_parts_benchmark_prints_every_pair_and_fault(capsys):
    for name in ("datatrove", "spacy", "orjson", "zstandard"):
        pytest.importorskip(name, reason=f"datatrove's side needs {name}: pip install 'hf_pretrain[test]'")
    module = load("datatrove_parts")
    results = module.main(["--size", "tiny"])
    out = capsys.readouterr().out
    for pair in module.PAIRS:  # a row of measures per pair, both sides run (no "failed" line)
        assert f"\n{pair:<24} " in out and "docs/s per core" in out
    for case in module.FAULTS:
        assert f"\n{case:<24} ours:" in out
    assert "failed:" not in out and out.count("verdict:") == len(module.PAIRS) + len(module.FAULTS)
    assert results["exact dedup"]["ours"]["dropped"] == results["exact dedup"]["theirs"]["dropped"] > 0
    assert results["invalid UTF-8 lines"]["ours"]["value"]["dropped"] == {"invalid_utf8": 2}
