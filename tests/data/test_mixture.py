"""Weighted mixtures (`data/mixture.py`): token shares held at every point, a schedule, epochs per source, one order
for one config; a real `PretrainTrainer` run resumes it exactly and logs the realised shares (`telemetry/mixture.py`),
which `hf-pretrain report` shows."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from datasets import Dataset
from transformers import TrainerCallback

from hf_pretrain import PretrainForCausalLM, PretrainTrainer
from hf_pretrain.cli import main
from hf_pretrain.data.collator import PackedDocumentCollator
from hf_pretrain.data.mixture import MixtureConfig, MixtureDataset, mixture_order
from hf_pretrain.telemetry.jsonl import read_jsonl
from tests.conftest import quick_args, small_config

LENGTHS = {"web": (10, 129, 5000), "code": (50, 129, 800), "books": (100, 129, 300)}


def lengths(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {name: rng.integers(low, high, n) for name, (low, high, n) in LENGTHS.items()}


def sources(**weights) -> dict:
    return {name: {"path": "unused", **value} for name, value in weights.items()}


def cumulative_tokens(config: MixtureConfig, sizes: dict) -> tuple[np.ndarray, np.ndarray]:
    """Tokens of each source after each row of the order [rows, sources], and in all."""
    source, row = mixture_order(config, sizes)
    names = list(config.sources)
    tokens = np.array([sizes[names[s]][r] for s, r in zip(source, row)])
    per_source = np.zeros((len(source), len(names)))
    per_source[np.arange(len(source)), source] = tokens
    return np.cumsum(per_source, axis=0), np.cumsum(tokens)


def test_token_shares_hold_at_every_row_and_follow_the_schedule():
    sizes = lengths()
    config = MixtureConfig(
        sources=sources(web={"weight": 6}, code={"weight": 3}, books={"weight": 1}),
        total_tokens=400_000,
        schedule=[{"at_tokens": 200_000, "weights": {"web": 0.2, "code": 0.2, "books": 0.6}}],
    )
    per_source, total = cumulative_tokens(config, sizes)
    assert total[-1] >= 400_000 and total[-2] < 400_000  # stops at the first row reaching the total
    switch = int(np.searchsorted(total, 200_000)) + 1  # the first phase ends with the row reaching 200,000
    longest = max(s.max() for s in sizes.values())
    first = np.abs(per_source[:switch] - total[:switch, None] * np.array([0.6, 0.3, 0.1]))
    assert first.max() <= 2 * longest  # within two rows of the weights, at every row
    second = per_source[switch:] - per_source[switch - 1]
    expected = (total[switch:] - total[switch - 1])[:, None] * np.array([0.2, 0.2, 0.6])
    assert np.abs(second - expected).max() <= 2 * longest
    again = cumulative_tokens(config, sizes)
    np.testing.assert_array_equal(again[0], per_source)  # deterministic
    other = MixtureConfig(**{**config.__dict__, "seed": 1})
    assert not np.array_equal(mixture_order(other, sizes)[1], mixture_order(config, sizes)[1])


def test_epochs_per_source_read_each_row_that_many_times():
    sizes = lengths()
    config = MixtureConfig(sources=sources(web={"epochs": 1}, code={"epochs": 2}, books={"epochs": 0.5}))
    source, row = mixture_order(config, sizes)
    for index, (name, passes) in enumerate((("web", 1), ("code", 2))):
        counts = np.bincount(row[source == index], minlength=len(sizes[name]))
        assert counts.min() == counts.max() == passes
    books = row[source == 2]
    assert abs(len(books) - 150) <= 1 and len(set(books.tolist())) == len(books)  # half a pass, no repeat


def test_without_a_total_the_mixture_ends_before_any_source_repeats():
    sizes = lengths()
    config = MixtureConfig(sources=sources(web={"weight": 0.5}, books={"weight": 0.5}))
    source, row = mixture_order(config, {k: sizes[k] for k in ("web", "books")})
    assert len(set(row[source == 1].tolist())) == (source == 1).sum()  # books, the scarcer, read once at most
    assert (source == 1).sum() >= LENGTHS["books"][2] - 2


@pytest.mark.parametrize(
    "bad, message",
    [
        ({"sources": {}}, "give an object of name"),
        ({"sources": {"web": {"weight": 1}}}, "'path'"),
        ({"sources": sources(web={"weight": 1, "epochs": 1})}, "exactly one of weight"),
        ({"sources": sources(web={"weight": 1}, code={"epochs": 1})}, "not both"),
        ({"sources": sources(web={"weight": 1}), "schedule": [{"at_tokens": 5, "weights": {"web": 1}}]}, "needs total"),
        (
            {
                "sources": sources(web={"weight": 1}),
                "total_tokens": 9,
                "schedule": [{"at_tokens": 5, "weights": {"x": 1}}],
            },
            "sources of the mixture",
        ),
    ],
)
def test_a_bad_mixture_config_is_one_error_naming_the_fix(bad, message):
    with pytest.raises(ValueError, match=message):
        MixtureConfig(**bad)


# ---- a real run ------------------------------------------------------------------------------------------------------

EOS, PAD = 1, 0
RANGES = {"web": (3, 40), "code": (40, 80), "books": (80, 120)}  # each source's tokens: the source of a token


def packed_source(folder, name: str, rows: int, seed: int) -> str:
    """Packed rows of 8..32 tokens drawn from the source's own token range, ending with EOS."""
    rng = np.random.default_rng(seed)
    low, high = RANGES[name]
    ids = [[*rng.integers(low, high, int(rng.integers(7, 32))).tolist(), EOS] for _ in range(rows)]
    Dataset.from_dict({"input_ids": ids}).save_to_disk(str(folder / name))
    return str(folder / name)


class Seen(TrainerCallback):
    def __init__(self):
        self.losses = {}

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses[state.global_step] = logs["loss"]


class Recording(PretrainTrainer):
    """The micro-batches trained, in order."""

    def training_step(self, model, inputs, *args, **kwargs):
        self.trained.append(inputs["input_ids"].clone())
        return super().training_step(model, inputs, *args, **kwargs)


def train(output_dir, data: MixtureDataset, stop_at=None, resume=None):
    torch.manual_seed(0)
    args = quick_args(
        output_dir,
        max_steps=12,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=3e-3,
        save_strategy="steps",
        save_steps=6,
        measure_peak_tflops=False,
    )
    seen = Seen()

    class Stop(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == stop_at:
                control.should_training_stop = True

    model = PretrainForCausalLM(small_config())
    collator = PackedDocumentCollator(EOS, pad_token_id=PAD)
    trainer = Recording(model=model, args=args, train_dataset=data, data_collator=collator)
    trainer.trained = []
    trainer.add_callback(seen)
    trainer.add_callback(Stop())
    trainer.train(resume_from_checkpoint=resume)
    return trainer.trained, seen.losses


def test_a_mixture_trains_resumes_exactly_and_logs_its_shares(tmp_path, capsys):
    config = MixtureConfig(
        sources={
            "web": {"path": packed_source(tmp_path, "web", 200, 1), "weight": 0.5},
            "code": {"path": packed_source(tmp_path, "code", 60, 2), "weight": 0.3},
            "books": {"path": packed_source(tmp_path, "books", 40, 3), "weight": 0.2},
        },
        total_tokens=4_000,  # ~200 rows: the 12 steps of 8 rows stay in the first pass
        schedule=[{"at_tokens": 1_000, "weights": {"web": 0.2, "code": 0.2, "books": 0.6}}],
    )
    data = MixtureDataset(config)
    assert len(data) > 12 * 8
    straight_batches, straight_losses = train(tmp_path / "straight", data)
    first_batches, first_losses = train(tmp_path / "resumed", data, stop_at=6)
    second_batches, second_losses = train(tmp_path / "resumed", MixtureDataset(config), resume=True)
    assert {**first_losses, **second_losses} == straight_losses  # identical floats
    assert (len(first_batches), len(second_batches)) == (12, 12), (len(first_batches), len(second_batches))
    drawn = torch.cat([b.flatten() for b in first_batches + second_batches])
    assert torch.equal(drawn, torch.cat([b.flatten() for b in straight_batches]))  # the same rows, in order
    assert len(straight_batches) == 12 * 2
    trained = dict.fromkeys(RANGES, 0)  # the tokens trained per source, read off the batches (EOS included)
    for row in (row for batch in straight_batches for row in batch.tolist()):
        real = [t for t in row if t != PAD]
        trained[next(n for n, (low, high) in RANGES.items() if low <= real[0] < high)] += len(real)
    logs = [r for r in read_jsonl(tmp_path / "straight") if "loss" in r]
    last = logs[-1]
    assert {name: last[f"mixture/{name}/tokens"] for name in RANGES} == trained
    step_six = next(r for r in logs if r["step"] == 6)
    assert step_six["mixture/web/target"] == 0.5 and last["mixture/books/target"] == 0.6
    assert abs(step_six["mixture/web/share"] - 0.5) < 0.1
    assert main(["report", str(tmp_path / "straight")]) == 0
    printed = capsys.readouterr().out
    assert "data mixture at step 12: web" in printed and "(target 0.600)" in printed
    assert "Data mixture (step 12)" in (tmp_path / "straight" / "report.html").read_text()


def test_under_sequence_parallelism_the_shares_count_one_batch_per_group(tmp_path):
    """The ranks of an SP group train the same rows (each a part of every row): 2 ranks with sp_size 2 are one
    data-parallel group, so a step trains 8 rows of the mixture, not 16 (the count a world of 2 would give)."""
    from types import SimpleNamespace

    from hf_pretrain.telemetry.mixture import MixtureCallback

    config = MixtureConfig(
        sources={
            "web": {"path": packed_source(tmp_path, "web", 200, 1), "weight": 0.5},
            "code": {"path": packed_source(tmp_path, "code", 60, 2), "weight": 0.5},
        },
        total_tokens=4_000,
    )
    data = MixtureDataset(config)
    args = SimpleNamespace(per_device_train_batch_size=8, world_size=2, gradient_accumulation_steps=1)
    state = SimpleNamespace(global_step=3)
    logged = {}
    for sp in (1, 2):
        callback = MixtureCallback(data, ranks_per_row=sp)
        callback.on_train_begin(args, state, None)
        logged[sp] = sum(v for k, v in callback.metrics_for_log(state).items() if k.endswith("/tokens"))
    assert logged[2] == sum(data.tokens_per_source(3 * 8).values()) < logged[1]
