"""GenerationProbeCallback: the exact-match rule, and real greedy probes in a training run (console, logs, JSONL)."""

import io
import json
import os
import socket
import subprocess
import sys
import textwrap
from contextlib import contextmanager, redirect_stdout
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from datasets import Dataset
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, TrainerCallback, default_data_collator

import hf_pretrain.precision
from hf_pretrain import PretrainForCausalLM, PretrainingArguments, PretrainTrainer
from hf_pretrain.evaluation import GenerationProbeCallback, exact_match, normalize_answer, parse_prompt
from hf_pretrain.telemetry.jsonl import read_jsonl
from tests.conftest import quick_args, small_config

ROOT = Path(__file__).resolve().parents[2]
VOCAB = 128


@pytest.mark.parametrize(
    "completion,expected,match",
    [
        (" 2", "2", True),
        (" 2. The answer", "2", True),
        ("\n 2\nNext question", "2", True),
        ('"2",', "2", True),
        ("(2)", "2", True),
        (": 2", "2", True),  # a word of punctuation only is skipped
        (" 20", "2", False),
        (" x = 2", "2", False),
        ("", "2", False),
        ("   \n", "2", False),
        ("two", "2", False),
        (" Paris is", "paris", True),
        (" X = 2.", "x = 2", True),
        (" x = 3", "x = 2", False),
        (" x =", "x = 2", False),  # shorter than the answer
        ("1\n2", "2", False),  # only the first line counts
    ],
)
def test_exact_match_rule(completion, expected, match):
    assert exact_match(completion, expected) is match


def test_normalisation_and_prompt_parsing():
    assert normalize_answer("  Two Words\nmore") == "two words"
    assert parse_prompt("If 5x + 3 = 13, then x is=> 2 ") == ("If 5x + 3 = 13, then x is", "2")
    assert parse_prompt("f = x => x + 1 =>2") == ("f = x => x + 1 ", "2")  # the last separator splits
    assert parse_prompt("The for statement") == "The for statement"
    with pytest.raises(ValueError, match="empty after normalisation"):
        GenerationProbeCallback([("prompt", " . ")], every_n_steps=1)
    with pytest.raises(ValueError, match="every_n_steps"):
        GenerationProbeCallback(["prompt"], every_n_steps=0, at_end=False)
    with pytest.raises(ValueError, match="at least one prompt"):
        GenerationProbeCallback([], every_n_steps=1)


def test_probe_steps():
    probe = GenerationProbeCallback(["prompt"], every_n_steps=4)
    state = SimpleNamespace(global_step=0, max_steps=10)
    due = []
    for step in range(0, 11):
        state.global_step = step
        if probe.due(state):
            due.append(step)
            probe._last_step = step
    assert due == [4, 8, 10]
    assert not probe.due(state)  # the same step is not probed twice...
    probe.on_train_begin(None, state, None)
    assert probe.due(state)  # ...unless a new train() reaches it again
    only_end = GenerationProbeCallback(["prompt"], every_n_steps=0)
    assert [s for s in range(11) if only_end.due(SimpleNamespace(global_step=s, max_steps=10))] == [10]


def word_tokenizer() -> PreTrainedTokenizerFast:
    """Token i is the word `t{i}`; t0 is EOS and padding."""
    tokenizer = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="t0", pad_token="t0")


def plus_three(n=64, seq=24) -> Dataset:
    """Rows where every token is the previous + 3 (mod the vocabulary), never t0."""
    starts = torch.randint(1, VOCAB, (n, 1), generator=torch.Generator().manual_seed(1))
    ids = (starts + 3 * torch.arange(seq)) % VOCAB
    ids[ids == 0] = 1
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})


class Recorder(TrainerCallback):
    """Stands in for a `report_to` integration: receives every log; checks the mode training steps run in."""

    def __init__(self):
        self.logs, self.modes = [], []

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        self.modes.append(model.training)

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.logs.append((state.global_step, dict(logs)))


PROMPTS = [("t3 t6 t9", "t12"), ("t100 t103 t106", "t109 t112"), ("t3 t6 t9", "t13"), "t50"]


@pytest.fixture(scope="module")
def probed_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("probe")
    torch.manual_seed(0)
    model = PretrainForCausalLM(small_config(num_hidden_layers=2))
    calls = []  # (training, grad enabled) of every forward
    model.register_forward_pre_hook(lambda module, args: calls.append((module.training, torch.is_grad_enabled())))
    entered = []
    original = hf_pretrain.precision.high_precision

    @contextmanager
    def counting_high_precision(m):
        entered.append(m)
        with original(m) as inner:
            yield inner

    probe = GenerationProbeCallback(PROMPTS, every_n_steps=4, max_new_tokens=4)
    recorder = Recorder()
    args = quick_args(
        out,
        max_steps=10,
        per_device_train_batch_size=16,
        learning_rate=1e-2,
        warmup_steps=0,
        lr_scheduler_type="constant",
        logging_steps=5,  # the probe's steps 4 and 8 are not logging steps: it asks for a log itself
        measure_peak_tflops=False,
        seed=0,
    )
    trainer = PretrainTrainer(
        model=model,
        args=args,
        train_dataset=plus_three(),
        data_collator=default_data_collator,
        processing_class=word_tokenizer(),
        callbacks=[probe, recorder],
    )
    hf_pretrain.precision.high_precision = counting_high_precision
    try:
        console = io.StringIO()
        with redirect_stdout(console):
            trainer.train()
    finally:
        hf_pretrain.precision.high_precision = original
    return dict(
        out=out,
        trainer=trainer,
        probe=probe,
        recorder=recorder,
        calls=calls,
        entered=entered,
        console=console.getvalue(),
    )


def test_probe_runs_at_its_steps_and_reaches_console_logs_jsonl_and_report_to(probed_run):
    console, recorder = probed_run["console"], probed_run["recorder"]
    steps = [4, 8, 10]  # every 4 steps, and the last step
    for step in steps:
        assert f"[probe] step {step}: 't3 t6 t9' -> '" in console
        assert f"[probe] step {step}: 't50' -> '" in console
    assert console.count("[probe] step") == len(steps) * len(PROMPTS)
    history = probed_run["trainer"].state.log_history
    for source in (
        [(h["step"], h) for h in history],
        recorder.logs,
        [(r["step"], r) for r in read_jsonl(probed_run["out"])],
    ):
        probed = [(step, logs) for step, logs in source if "probe_0" in logs]
        assert [step for step, _ in probed] == steps
        for _, logs in probed:
            assert all(isinstance(logs[f"probe_{i}"], str) for i in range(len(PROMPTS)))
            scored = [exact_match(logs[f"probe_{i}"], PROMPTS[i][1]) for i in range(3)]
            assert logs["probe_exact_match"] == pytest.approx(sum(scored) / 3)
            assert "loss" in logs  # merged into a training log
    logged_at = [step for step, logs in recorder.logs if "loss" in logs]
    assert logged_at == [4, 5, 8, 10]  # logging_steps=5, plus the probe's steps 4 and 8
    # each completion is printed (and logged as dict) on the console as well
    assert "'probe_0': 't12" in console


def test_probe_generates_greedily_in_eval_mode_and_restores_training(probed_run):
    calls, recorder = probed_run["calls"], probed_run["recorder"]
    assert set(calls) == {(True, True), (False, False)}  # training forwards, and eval forwards without grad
    assert all(recorder.modes)  # every training step started in train mode again
    generated = sum(1 for training, _ in calls if not training)
    assert 3 * len(PROMPTS) <= generated <= 3 * len(PROMPTS) * 4  # up to max_new_tokens forwards per prompt
    assert probed_run["entered"] and all(m is probed_run["trainer"].model for m in probed_run["entered"])


def test_exact_match_on_real_completions_of_a_learned_rule(probed_run):
    final = [r for r in probed_run["probe"].history if r.step == 10]
    assert [r.prompt for r in final] == [p if isinstance(p, str) else p[0] for p in PROMPTS]
    right, right_two_words, wrong, unscored = final
    # trained on "each token is the previous + 3": the completions continue the sequence
    assert right.completion.startswith("t12 t15") and right.match is True
    assert right_two_words.completion.startswith("t109 t112") and right_two_words.match is True
    assert wrong.completion == right.completion and wrong.match is False  # same completion, wrong expected answer
    assert unscored.match is None and unscored.expected is None
    last = [logs for step, logs in probed_run["recorder"].logs if step == 10 and "probe_0" in logs][0]
    assert last["probe_exact_match"] == pytest.approx(2 / 3)


def test_probe_restores_train_mode_when_generation_fails():
    model = PretrainForCausalLM(small_config(num_hidden_layers=1)).train()
    probe = GenerationProbeCallback(["t1"], every_n_steps=1)

    def broken(*args, **kwargs):
        assert not model.training
        raise RuntimeError("boom")

    model.generate = broken
    with pytest.raises(RuntimeError, match="boom"):
        probe.probe(model, word_tokenizer())
    assert model.training


SCRIPT = textwrap.dedent(
    """
    import json, sys
    import torch
    from transformers import default_data_collator
    from hf_pretrain import PretrainForCausalLM, PretrainingArguments, PretrainTrainer
    from hf_pretrain.evaluation import GenerationProbeCallback
    from tests.conftest import quick_args, small_config
    from tests.evaluation.test_generation_probe import plus_three, word_tokenizer

    out, deepspeed = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else None)
    torch.manual_seed(0)
    model = PretrainForCausalLM(small_config(num_hidden_layers=2))
    generate, calls = model.generate, []
    model.generate = lambda *a, **k: calls.append(k.get("synced_gpus")) or generate(*a, **k)
    probe = GenerationProbeCallback([("t3 t6 t9", "t12"), "t50"], every_n_steps=2, max_new_tokens=3)
    args = quick_args(out, max_steps=4, per_device_train_batch_size=4, learning_rate=1e-2, logging_steps=3,
                      measure_peak_tflops=False, telemetry=False, deepspeed=deepspeed)
    trainer = PretrainTrainer(model=model, args=args, train_dataset=plus_three(32), data_collator=default_data_collator,
                              processing_class=word_tokenizer(), callbacks=[probe])
    trainer.train()
    probed = [h["step"] for h in trainer.state.log_history if "probe_0" in h]
    record = dict(rank=args.process_index, generate_calls=calls, probed_steps=probed)
    with open(f"{out}/rank-{args.process_index}.json", "w") as f:
        json.dump(record, f)
    trainer.accelerator.end_training()
    """
)


@pytest.mark.distributed
@pytest.mark.exhaustive  # make test: the probe under ZeRO-3 in test_downstream_training.py's launch
@pytest.mark.parametrize("zero3", [False, True], ids=["ddp", "zero3"])
def test_two_ranks_probe_without_deadlock(tmp_path, zero3):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    script = tmp_path / "probe_run.py"
    script.write_text(SCRIPT)
    config = ROOT / "examples" / "accelerate_configs" / "cpu_2proc.yaml"
    extra = [str(ROOT / "ds_configs" / "zero3.json")] if zero3 else []
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
    command += ["--main_process_port", port, str(script), str(tmp_path), *extra]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    ranks = [json.loads((tmp_path / f"rank-{r}.json").read_text()) for r in (0, 1)]
    # rank 0 prints each prompt once per probe (steps 2 and 4), no other rank prints
    assert result.stdout.count("[probe] step") == 2 * 2, result.stdout[-3000:]
    assert ranks[0]["probed_steps"] == [2, 4]
    assert ranks[1]["probed_steps"] == []
    if zero3:  # sharded parameters: every rank generates, in lockstep
        assert ranks[0]["generate_calls"] == ranks[1]["generate_calls"] == [True] * 4
    else:  # DDP: rank 0 alone, no collective
        assert ranks[0]["generate_calls"] == [False] * 4 and ranks[1]["generate_calls"] == []


@pytest.mark.skipif(
    not hasattr(PretrainingArguments, "probe_prompts"), reason="PretrainingArguments has no probe_* fields yet"
)
def test_probe_from_pretraining_arguments_is_attached_once_per_train(tmp_path):
    torch.manual_seed(0)
    args = quick_args(
        tmp_path,
        max_steps=4,
        per_device_train_batch_size=8,
        measure_peak_tflops=False,
        telemetry=False,
        probe_prompts=["t3 t6 t9=>t12", "t50"],
        probe_every=2,
        probe_max_new_tokens=2,
    )
    mine = GenerationProbeCallback(["t7"], every_n_steps=100)  # passed by the user: kept as it is
    trainer = PretrainTrainer(
        model=PretrainForCausalLM(small_config(num_hidden_layers=1)),
        args=args,
        train_dataset=plus_three(16),
        data_collator=default_data_collator,
        processing_class=word_tokenizer(),
        callbacks=[mine],
    )
    during = []

    class Attached(TrainerCallback):
        def on_train_end(self, args, state, control, **kwargs):
            during.append([c for c in trainer.callback_handler.callbacks if isinstance(c, GenerationProbeCallback)])

    trainer.add_callback(Attached())
    for _ in range(2):
        trainer.train()
        probes = during[-1]
        assert len(probes) == 2 and mine in probes
        after = [c for c in trainer.callback_handler.callbacks if isinstance(c, GenerationProbeCallback)]
        assert after == [mine]  # train() detaches what it attached: the list is the user's again
        attached = next(p for p in probes if p is not mine)
        assert attached.prompts == [("t3 t6 t9", "t12"), ("t50", None)] and attached.every_n_steps == 2
        assert [r.step for r in attached.history] == [2, 2, 4, 4]
        assert [r.step for r in mine.history[-1:]] == [4]
    probed = [h["step"] for h in trainer.state.log_history if "probe_exact_match" in h]
    assert probed == [2, 4]
