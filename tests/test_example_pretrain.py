"""End-to-end: `accelerate launch examples/pretrain.py` as a user runs it, one and two CPU ranks."""

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_pretrain import PretrainConfig, PretrainForCausalLM
from hf_pretrain.presets import load_config

ROOT = Path(__file__).resolve().parents[1]
FAST = [
    "--max_steps",
    "250",
    "--seq_len",
    "128",
    "--per_device_train_batch_size",
    "8",
    "--warmup_steps",
    "20",
    "--logging_steps",
    "50",
]


def launch(out: Path, *launch_args: str, extra=(), data_dir: Path | None = None) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        *launch_args,
        str(ROOT / "examples" / "pretrain.py"),
        "--output_dir",
        str(out),
        *FAST,
        *extra,
    ]
    if data_dir:
        cmd += ["--data_cache_dir", str(data_dir)]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return proc


@pytest.mark.slow
@pytest.mark.parametrize("steps", [40, pytest.param(250, marks=pytest.mark.exhaustive)])
def test_default_job_trains_evaluates_saves_and_samples(tmp_path, capsys, steps):
    data = tmp_path / "data"
    proc = launch(
        tmp_path / "run",
        "--num_processes",
        "1",
        extra=["--max_steps", str(steps), "--logging_steps", "20"],
        data_dir=data,
    )
    summary = json.loads((tmp_path / "run" / "pretrain_summary.json").read_text())
    # 250 steps: the loss fell far below what a model that knows only token frequencies could reach; 40 steps
    # (make test): below that of uniform guessing over the vocabulary, learning under way
    bound = (
        summary["unigram_entropy"] - 0.5
        if steps == 250
        else math.log(PretrainConfig.from_pretrained(tmp_path / "run").vocab_size)
    )
    assert summary["heldout_loss"] < bound, summary
    # Real tokens of `steps` batches of 8 x 128 (an epoch's last batch may be short).
    assert (steps - 1) * 8 * 128 < summary["tokens_seen"] <= steps * 8 * 128 and summary["tokens_seen"] % 128 == 0
    assert summary["world_size"] == 1
    assert "held-out loss" in proc.stdout and "unigram entropy" in proc.stdout and "tokens_per_second" in proc.stdout
    assert set(summary["samples"]) == {"The for statement", "A class definition", "If 5x + 3 = 13, then x is"}
    assert all(isinstance(text, str) and text for text in summary["samples"].values())
    # The report says the held-out loss the job printed (it said "not logged": the final evaluate() ran outside
    # train(), unheard by the telemetry stream), and of the downstream panels that they were not asked for.
    from hf_pretrain.report.summary import summary_rows
    from hf_pretrain.telemetry.jsonl import read_jsonl

    rows = dict(summary_rows(tmp_path / "run", read_jsonl(tmp_path / "run")))
    assert rows["held-out loss"] == f"{summary['heldout_loss']:.4f}", rows

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "run")
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "run")
    assert isinstance(model, PretrainForCausalLM) and len(tokenizer) <= model.config.vocab_size
    ids = tokenizer("The for statement", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert torch.isfinite(model(ids).logits).all()

    # A second run's data step reuses corpus, tokenizer and packed blocks (here in-process: the launch is above).
    example = example_module()
    model_args, data_args, args = example.parse_args(
        ["--output_dir", str(tmp_path / "run2"), "--data_cache_dir", str(data), "--seq_len", "128"]
    )
    example.prepare_data(data_args, args, load_config(model_args.preset).vocab_size)
    again = capsys.readouterr().out
    assert "[tokenizer] loaded" in again and again.count("[reused cache]") == 2


@pytest.mark.exhaustive  # make test: DDP in tests/distributed/, the example's flags in one process below
@pytest.mark.distributed
def test_two_cpu_ranks_with_multi_gpu_launch(tmp_path):
    proc = launch(tmp_path / "run", "--multi_gpu", "--num_processes", "2", extra=["--max_steps", "6"])
    summary = json.loads((tmp_path / "run" / "pretrain_summary.json").read_text())
    assert summary["world_size"] == 2
    assert summary["tokens_seen"] == 6 * 2 * 8 * 128  # both ranks' tokens, gathered
    assert "2 process(es) on cpu" in proc.stdout


def example_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("pretrain_example", ROOT / "examples" / "pretrain.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_dtype_flag_sets_mixed_precision(tmp_path):
    example = example_module()
    model_args, _, args = example.parse_args(["--output_dir", str(tmp_path), "--dtype", "bf16"])
    dtype, args = example.resolve_dtype(model_args, args)
    assert dtype == "bf16" and args.bf16 and args.mixed_precision == "bf16"
    model_args, _, args = example.parse_args(["--output_dir", str(tmp_path), "--dtype", "fp32", "--bf16"])
    dtype, args = example.resolve_dtype(model_args, args)
    assert dtype == "fp32" and not args.bf16 and args.mixed_precision == "no"
    model_args, _, args = example.parse_args(["--output_dir", str(tmp_path), "--precision", "bf16", "--dtype", "fp32"])
    dtype, args = example.resolve_dtype(model_args, args)  # the recipe decides
    assert dtype == "bf16" and args.mixed_precision == "bf16"
    model_args, _, args = example.parse_args(["--output_dir", str(tmp_path)])  # auto on this CPU
    assert example.resolve_dtype(model_args, args)[0] == ("bf16" if torch.cuda.is_available() else "fp32")


def test_a_heldout_split_too_small_for_one_block_skips_evaluation(tmp_path, capsys):
    """The data's own `validation` split is the held-out one; one short document fills no block: no evaluation."""
    from datasets import Dataset, DatasetDict

    from hf_pretrain.data import embedded_documents

    train = Dataset.from_dict({"text": embedded_documents()[:80]})
    DatasetDict(train=train, validation=Dataset.from_dict({"text": ["a short held-out text"]})).save_to_disk(
        str(tmp_path / "saved")
    )
    example = example_module()
    flags = ["--output_dir", str(tmp_path / "run"), "--dataset_path", str(tmp_path / "saved"), "--clean", "False"]
    _, data_args, args = example.parse_args([*flags, "--seq_len", "64", "--vocab_size", "300"])
    tokenizer, packed, heldout = example.prepare_data(data_args, args, 300)
    out = capsys.readouterr().out
    assert heldout is None and len(packed) > 0 and len(tokenizer) <= 300
    assert "[data] " + str(tmp_path / "saved") + ": " in out and " / 1 held-out documents" in out
    assert "[pack] held-out: evaluation skipped: No 64-token block could be packed from 1 documents" in out


def test_help_lists_every_flag_without_crashing(capsys):
    import importlib.util

    spec = importlib.util.spec_from_file_location("pretrain_example", ROOT / "examples" / "pretrain.py")
    example = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = example  # dataclasses look their module up there
    spec.loader.exec_module(example)
    with pytest.raises(SystemExit) as exit_info:
        example.parse_args(["--help"])
    assert exit_info.value.code == 0 and "--lr_scheduler_type" in capsys.readouterr().out


@pytest.mark.parametrize(
    "flags, strategy",
    [(["--save_steps", "5"], "steps"), (["--save_steps=5", "--save_strategy=epoch"], "epoch"), ([], "no")],
)
def test_save_steps_given_alone_saves_at_those_steps(flags, strategy):
    """The example saves nothing by default; --save_steps alone saved nothing, silently (as plain `Trainer`,
    whose save_strategy defaults to "steps", it now saves)."""
    args = example_module().parse_args(["--output_dir", "unused", *flags])[2]
    assert args.save_strategy == strategy


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--window_pattern", "SXL"], "error: PretrainConfig.window_pattern='SXL' is invalid"),
        (["--window_pattern", "SL", "--sliding_window", "0"], "error: PretrainConfig.sliding_window=0 is invalid"),
        (["--seq_len", "4"], "error: seq_len=4 is too small"),
        (["--attention_backend", "fast"], "error: PretrainConfig.attention_backend='fast' is invalid"),
        (["--vocab_size", "100"], "error: vocab_size=100 is too small"),
        (["--heldout_fraction", "1.5"], "error: --heldout_fraction=1.5"),
        (["--dataset_path", "no/such/corpus"], "error: --dataset_path='no/such/corpus' does not exist"),
        (["--per_device_train_batch_size", "0"], "error: --per_device_train_batch_size 0 is invalid: use a whole"),
        (["--gradient_accumulation_steps", "0"], "error: --gradient_accumulation_steps 0 is invalid: use a whole"),
        (["--learning_rate", "-1"], "error: --learning_rate -1 is invalid: a learning rate is not negative"),
        (["--output_dir", "FILE"], "error: --output_dir FILE is a file, not a folder: pass a folder path"),
        (["--save_steps", "5", "--save_strategy", "no"], "error: --save_steps is given but --save_strategy is no"),
        (
            ["--seq_len", "100000", "--use_cpu", "True"],  # on a GPU with flash kernels it might fit
            "error: memory preflight: sequences of 100000 tokens x micro-batch 16 (fp32) need",
        ),
        pytest.param(
            ["--attention_backend", "flash_attention_2"],
            "error: attention_backend='flash_attention_2' cannot run the full layers here: needs a CUDA GPU",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU-only refusal"),
        ),
    ],
)
def test_flags_are_checked_before_any_data_work(tmp_path, capsys, flags, message):
    """Each first-hour mistake is one `error:` line naming the flag and the fix, exit 2, before any data work."""
    (tmp_path / "FILE").write_text("not a folder")
    flags = [str(tmp_path / "FILE") if f == "FILE" else f for f in flags]
    message = message.replace("FILE", str(tmp_path / "FILE"))
    example = example_module()
    with pytest.raises(SystemExit) as exit_info:
        example.main(["--output_dir", str(tmp_path / "run"), *flags])
    err = capsys.readouterr().err.splitlines()
    assert exit_info.value.code == 2 and err[-1].startswith(message), err
    assert not [line for line in err if line.startswith("Traceback")]
    assert not (tmp_path / "run" / "data").exists()  # no corpus written, no tokenizer trained


def test_a_sequence_above_the_presets_positions_is_extended_with_a_warning(tmp_path, capsys):
    example = example_module()
    model_args, data_args, args = example.parse_args(["--output_dir", str(tmp_path), "--seq_len", "2048"])
    example.check_arguments(model_args, data_args, args)
    assert "warning: --seq_len 2048 is above the 1024 positions of --preset tiny" in capsys.readouterr().err
    assert example.model_config(model_args, 2048).max_position_embeddings == 2048


def test_a_checkpoint_that_cannot_be_resumed_is_one_error_line(tmp_path, capsys):
    lines = [json.dumps({"text": f"document {i} about cats and dogs and the weather today"}) for i in range(64)]
    (tmp_path / "corpus.jsonl").write_text("\n".join(lines) + "\n")
    flags = ["--dataset_path", str(tmp_path / "corpus.jsonl"), "--clean", "False", "--dedup", "False"]
    flags += ["--seq_len", "32", "--vocab_size", "300", "--max_steps", "1", "--heldout_fraction", "0"]
    example = example_module()
    missing = tmp_path / "run" / "checkpoint-9"
    with pytest.raises(SystemExit) as exit_info:
        example.main(["--output_dir", str(tmp_path / "run"), *flags, "--resume_from_checkpoint", str(missing)])
    err = capsys.readouterr().err.splitlines()
    assert exit_info.value.code == 2 and err[-1].startswith(f"error: Can't find a valid checkpoint at {missing}")
    assert not (tmp_path / "run" / "data").exists()  # refused before any data work


@pytest.mark.parametrize("content", ["", "\n  \n"])
def test_an_empty_or_blank_dataset_is_one_line(tmp_path, capsys, content):
    (tmp_path / "corpus.jsonl").write_text(content)
    example = example_module()
    with pytest.raises(SystemExit) as exit_info:
        example.main(["--output_dir", str(tmp_path / "run"), "--dataset_path", str(tmp_path / "corpus.jsonl")])
    error = capsys.readouterr().err.splitlines()[-1]
    assert exit_info.value.code == 2 and error.startswith("error: No document could be read from ")
    assert "corpus.jsonl" in error and "blank" in error


def test_the_eval_line_says_above_when_the_loss_is_above_the_unigram_entropy():
    example = example_module()
    assert example.nats_versus(7.795, 6.543) == "1.252 nats above it"  # printed "-1.252 nats below"
    assert example.nats_versus(3.5, 6.543) == "3.043 nats below it"


def prepared_source(example, tmp_path, name: str, documents: list[str], tokenizer: str | None = None) -> Path:
    """One source as `prepare` writes it: its own documents, the tokenizer trained here or the one given."""
    corpus = tmp_path / f"{name}.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": d}) for d in documents) + "\n")
    flags = ["--output_dir", str(tmp_path / "unused"), "--dataset_path", str(corpus), "--clean", "False"]
    flags += ["--dedup", "False", "--seq_len", "64", "--data_cache_dir", str(tmp_path / name)]
    flags += ["--tokenizer_name_or_path", tokenizer] if tokenizer else ["--vocab_size", "300"]
    _, data_args, args = example.parse_args(flags)
    example.prepare_data(data_args, args, 300)
    return tmp_path / name / "prepared"


def test_a_mixture_of_prepared_sources_trains_in_its_order_with_their_tokenizer(tmp_path, capsys):
    """--mixture: the sources' shared tokenizer, the mixture's order as the training set, their held-out rows, the
    realised shares in the training logs; sources tokenized differently are one error line."""
    from hf_pretrain.data import embedded_documents
    from hf_pretrain.data.mixture import MixtureDataset
    from hf_pretrain.data.prepared import tokenizer_path

    example = example_module()
    docs = embedded_documents()
    web = prepared_source(example, tmp_path, "web", docs[:60])
    code = prepared_source(example, tmp_path, "code", docs[60:120], tokenizer=str(tokenizer_path(web)))
    mixture = {"sources": {"web": {"path": str(web), "weight": 0.7}, "code": {"path": str(code), "weight": 0.3}}}
    (tmp_path / "mixture.json").write_text(json.dumps(mixture))
    flags = ["--output_dir", str(tmp_path / "run"), "--mixture", str(tmp_path / "mixture.json"), "--seq_len", "64"]
    capsys.readouterr()
    summary = example.main([*flags, "--max_steps", "2", "--per_device_train_batch_size", "4", "--logging_steps", "1"])
    out = capsys.readouterr().out
    assert "[data] mixture: " in out and "web" in out and "code" in out
    assert summary["tokens_seen"] > 0 and "heldout_loss" in summary  # the sources' held-out rows evaluated
    logs = [json.loads(line) for line in (tmp_path / "run" / "telemetry.jsonl").read_text().splitlines()]
    trained = [entry for entry in logs if "mixture/web/share" in entry]
    assert trained and trained[-1]["mixture/web/target"] == pytest.approx(0.7)

    _, data_args, args = example.parse_args(flags)
    assert isinstance(example.prepare_mixture(data_args, args)[1], MixtureDataset)
    other = prepared_source(example, tmp_path, "other", docs[120:180])  # its own tokenizer
    mixture["sources"]["code"]["path"] = str(other)
    (tmp_path / "mixture.json").write_text(json.dumps(mixture))
    with pytest.raises(SystemExit) as exit_info:
        example.main(flags)
    error = capsys.readouterr().err.splitlines()[-1]
    assert exit_info.value.code == 2 and "were tokenized by different tokenizers" in error, error


def best_fit_source(tmp_path: Path, name: str, documents: list[str], tokenizer: str | None = None) -> Path:
    """A source prepared with best-fit packing (rows of different lengths, docs/data.md's own example mode)."""
    from hf_pretrain.data.chain import run_pipeline
    from hf_pretrain.data.pipeline_config import PipelineConfig

    corpus = tmp_path / f"{name}.jsonl"
    corpus.write_text("\n".join(json.dumps({"text": d}) for d in documents) + "\n")
    config = PipelineConfig(
        input=str(corpus),
        output_dir=str(tmp_path / name),
        heldout_fraction=0.1,
        clean=None,
        dedup=None,
        tokenizer={"path": tokenizer} if tokenizer else {"vocab_size": 300},
        pack={"seq_len": 64, "mode": "best_fit"},
    )
    run_pipeline(config, verbose=False)
    return tmp_path / name


def test_a_mixture_of_best_fit_sources_trains_and_resumes_exactly(tmp_path, capsys):
    """Best-fit rows differ in length: the example's collator pads them (it raised at the first batch), and a run
    resumed from a checkpoint of the straight run repeats its losses bit for bit."""
    from hf_pretrain.data import embedded_documents
    from hf_pretrain.data.prepared import load_packed, tokenizer_path
    from hf_pretrain.telemetry.jsonl import read_jsonl

    example = example_module()
    docs = embedded_documents()
    web = best_fit_source(tmp_path, "web", docs[:60])
    code = best_fit_source(tmp_path, "code", docs[60:120], tokenizer=str(tokenizer_path(web)))
    rows = load_packed(web)["train"]["input_ids"]
    assert len({len(r) for r in rows}) > 1  # the case: rows of different lengths
    mixture = {"sources": {"web": {"path": str(web), "weight": 0.6}, "code": {"path": str(code), "weight": 0.4}}}
    (tmp_path / "mixture.json").write_text(json.dumps(mixture))
    flags = ["--mixture", str(tmp_path / "mixture.json"), "--seq_len", "64", "--max_steps", "4", "--logging_steps", "1"]
    flags += ["--per_device_train_batch_size", "4", "--save_strategy", "steps", "--save_steps", "2"]
    example.main(["--output_dir", str(tmp_path / "straight"), *flags])
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    shutil.copytree(tmp_path / "straight" / "checkpoint-2", resumed / "checkpoint-2")
    example.main(["--output_dir", str(resumed), *flags, "--resume_from_checkpoint", "auto"])

    def losses(run: Path) -> dict[int, float]:
        return {r["step"]: r["loss"] for r in read_jsonl(run) if "loss" in r}

    straight = losses(tmp_path / "straight")
    assert set(straight) == {1, 2, 3, 4}
    assert losses(resumed) == {3: straight[3], 4: straight[4]}  # identical floats
