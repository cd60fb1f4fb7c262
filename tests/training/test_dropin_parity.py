"""Drop-in parity: the same script under `Trainer` and `PretrainTrainer`, with plain `TrainingArguments`.

Setups that are not ours: a regression model with a non-Llama config, a model returning tuples, a
model without a config, rows without `input_ids`, an `IterableDataset`, evaluation without metrics,
gradient accumulation, callbacks at init, resumes (mid-epoch, across an epoch, with another batch
size). Losses, weights, `state.log_history` and the arguments must be what `Trainer` gives, apart
from the differences listed in docs/training.md (speed metrics differ between any two runs, so they
are left out of the comparison, as `Trainer`'s own tests do).
"""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest
import torch
from datasets import Dataset
from torch import nn
from transformers import PretrainedConfig, PreTrainedModel, Trainer, TrainerCallback, TrainingArguments

from hf_pretrain import PretrainForCausalLM, PretrainTrainer
from tests.conftest import small_config

RUN_TO_RUN = ("_runtime", "_per_second")  # speed metrics: different in any two runs, Trainer's too


class RegressionConfig(PretrainedConfig):  # no max_position_embeddings, no vocabulary
    model_type = "parity-regression"

    def __init__(self, a=0.0, b=0.0, **kwargs):
        super().__init__(**kwargs)
        self.a, self.b = a, b


class RegressionPreTrainedModel(PreTrainedModel):
    config_class = RegressionConfig
    base_model_prefix = "regression"
    main_input_name = "input_x"

    def __init__(self, config):
        super().__init__(config)
        self.a = nn.Parameter(torch.tensor(config.a).float())
        self.b = nn.Parameter(torch.tensor(config.b).float())
        self.post_init()

    def forward(self, input_x, labels=None, **kwargs):
        y = input_x * self.a + self.b
        if labels is None:
            return (y,)
        return (nn.functional.mse_loss(y, labels), y)  # a tuple, not a ModelOutput


class ConfiglessModel(nn.Module):  # a custom nn.Module: no config at all
    def __init__(self):
        super().__init__()
        self.config = None
        self.linear = nn.Linear(4, 1)

    def forward(self, features, labels=None):
        y = self.linear(features).squeeze(-1)
        return {"loss": nn.functional.mse_loss(y, labels), "logits": y}


def regression_rows(n=64, seed=42) -> Dataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g)
    y = 2.0 * x + 3.0 + 0.1 * torch.randn(n, generator=g)
    return Dataset.from_dict({"input_x": x.tolist(), "labels": y.tolist()})


def feature_rows(n=48) -> Dataset:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(n, 4, generator=g)
    return Dataset.from_dict({"features": x.tolist(), "labels": x.sum(-1).tolist()})


class RegressionStream(torch.utils.data.IterableDataset):
    def __iter__(self):
        for row in regression_rows(40):
            yield {"input_x": torch.tensor(row["input_x"]), "labels": torch.tensor(row["labels"])}


def token_rows(n=32, seq=16) -> Dataset:
    g = torch.Generator().manual_seed(1)
    ids = (torch.randint(0, 128, (n, 1), generator=g) + 3 * torch.arange(seq)) % 128
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})


def plain_args(output_dir, **overrides) -> TrainingArguments:
    defaults = dict(
        per_device_train_batch_size=8,
        learning_rate=0.1,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=7,
        use_cpu=True,
        disable_tqdm=True,
    )
    return TrainingArguments(output_dir=str(output_dir), **{**defaults, **overrides})


def regression_model():
    torch.manual_seed(0)
    return RegressionPreTrainedModel(RegressionConfig())


def train(trainer_cls, model, output_dir, data, resume=None, callbacks=None, **overrides):
    args = plain_args(output_dir, **overrides)
    before = dataclasses.asdict(args)
    trainer = trainer_cls(model=model, args=args, train_dataset=data, callbacks=callbacks)
    trainer.train(resume_from_checkpoint=resume)
    assert dataclasses.asdict(args) == before, "the user's TrainingArguments were written to"
    return trainer


def history(trainer) -> list[dict]:
    return [{k: v for k, v in h.items() if not k.endswith(RUN_TO_RUN)} for h in trainer.state.log_history]


def losses(trainer) -> dict[int, float]:
    return {h["step"]: h["loss"] for h in trainer.state.log_history if "loss" in h}


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def assert_same_run(ours, theirs):
    assert history(ours) == history(theirs)
    mine, reference = weights(ours.model), weights(theirs.model)
    assert mine.keys() == reference.keys()
    assert all(torch.equal(mine[k], reference[k]) for k in mine)


def test_regression_model_with_a_non_llama_config_and_tuple_outputs(tmp_path):
    data = regression_rows()
    theirs = train(Trainer, regression_model(), tmp_path / "t", data, num_train_epochs=2)
    ours = train(PretrainTrainer, regression_model(), tmp_path / "p", data, num_train_epochs=2)
    assert len(losses(theirs)) == 16
    assert_same_run(ours, theirs)


def test_model_without_config_and_rows_without_input_ids(tmp_path):
    data = feature_rows()
    theirs = train(Trainer, _configless(), tmp_path / "t", data, max_steps=6)
    ours = train(PretrainTrainer, _configless(), tmp_path / "p", data, max_steps=6)
    assert len(losses(theirs)) == 6
    assert_same_run(ours, theirs)


def _configless():
    torch.manual_seed(0)
    return ConfiglessModel()


def test_iterable_dataset(tmp_path):
    theirs = train(Trainer, regression_model(), tmp_path / "t", RegressionStream(), max_steps=8)
    ours = train(PretrainTrainer, regression_model(), tmp_path / "p", RegressionStream(), max_steps=8)
    assert_same_run(ours, theirs)


def test_gradient_accumulation_and_callbacks_given_at_init(tmp_path):
    class Events(TrainerCallback):
        def __init__(self):
            self.events = []

        def on_step_end(self, args, state, control, **kwargs):
            self.events.append(("step", state.global_step))

        def on_log(self, args, state, control, logs=None, **kwargs):
            self.events.append(("log", sorted(k for k in logs if not k.endswith(RUN_TO_RUN))))

    runs = {}
    for name, cls in (("t", Trainer), ("p", PretrainTrainer)):
        events = Events()
        trainer = train(
            cls,
            regression_model(),
            tmp_path / name,
            regression_rows(),
            callbacks=[events],
            gradient_accumulation_steps=3,
            per_device_train_batch_size=4,
            max_steps=5,
        )
        runs[name] = trainer, events
        assert events in trainer.callback_handler.callbacks
        assert [type(c) for c in trainer.callback_handler.callbacks] == [
            type(c) for c in runs["t"][0].callback_handler.callbacks
        ]
    ours, theirs = runs["p"][1].events, runs["t"][1].events
    assert [e for e in ours if e[0] == "step"] == [e for e in theirs if e[0] == "step"]
    logged = lambda events: [keys for kind, keys in events if kind == "log"]  # noqa: E731
    # on_log sees the Trainer's keys, plus the measured ones (step time...) that reach report_to and the console
    assert all(set(t) <= set(o) for o, t in zip(logged(ours), logged(theirs), strict=True))
    assert_same_run(runs["p"][0], runs["t"][0])


def test_evaluate_without_metrics_reports_what_trainer_reports(tmp_path):
    data = regression_rows(24)
    results = {}
    for name, cls in (("t", Trainer), ("p", PretrainTrainer)):
        trainer = cls(model=regression_model(), args=plain_args(tmp_path / name), eval_dataset=data)
        results[name] = {k: v for k, v in trainer.evaluate().items() if not k.endswith((*RUN_TO_RUN, "_time"))}
    assert "eval_loss" in results["p"] and results["p"] == results["t"]


def test_evaluate_of_a_causal_lm_adds_perplexity_and_keeps_the_loss(tmp_path):
    data = token_rows(8)
    results = {}
    for name, cls in (("t", Trainer), ("p", PretrainTrainer)):
        torch.manual_seed(0)
        trainer = cls(model=PretrainForCausalLM(small_config()), args=plain_args(tmp_path / name), eval_dataset=data)
        results[name] = trainer.evaluate()
    assert results["p"]["eval_loss"] == pytest.approx(results["t"]["eval_loss"], rel=1e-6)
    assert results["p"]["eval_perplexity"] == pytest.approx(
        torch.tensor(results["p"]["eval_loss"]).exp().item(), rel=1e-4
    )
    assert "eval_perplexity" not in results["t"]  # the one documented addition


def test_causal_lm_log_history_equals_trainer_and_telemetry_reaches_the_console_stream(tmp_path):
    data = token_rows()
    runs = {}
    for name, cls in (("t", Trainer), ("p", PretrainTrainer)):
        torch.manual_seed(0)
        runs[name] = train(
            cls, PretrainForCausalLM(small_config()), tmp_path / name, data, max_steps=4, learning_rate=3e-3
        )
    assert_same_run(runs["p"], runs["t"])
    records = [json.loads(line) for line in (tmp_path / "p" / "telemetry.jsonl").read_text().splitlines()]
    trained = [r for r in records if "loss" in r]
    assert len(trained) == 4 and all(r["tokens_per_second"] > 0 and r["step_time_s"] > 0 for r in trained)
    assert all("tokens_per_second" not in h for h in runs["p"].state.log_history)


def test_two_identical_runs_have_identical_state(tmp_path):
    data = token_rows()
    runs = []
    for name in ("a", "b"):
        torch.manual_seed(0)
        runs.append(
            train(
                PretrainTrainer,
                PretrainForCausalLM(small_config()),
                tmp_path / name,
                data,
                max_steps=3,
                learning_rate=3e-3,
            )
        )
    assert_same_run(*runs)


@pytest.mark.parametrize("resume_at", [5, 10], ids=["mid-epoch", "across-an-epoch"])
def test_resume_gives_the_uninterrupted_run(tmp_path, resume_at):
    data = regression_rows()  # 8 steps per epoch at batch 8
    common = dict(num_train_epochs=2, save_strategy="steps", save_steps=5)
    straight = {}
    for name, cls in (("t", Trainer), ("p", PretrainTrainer)):
        straight[name] = train(cls, regression_model(), tmp_path / name, data, **common)
    resumed = {}
    for name, cls in (("t", Trainer), ("p", PretrainTrainer)):
        checkpoint = str(tmp_path / name / f"checkpoint-{resume_at}")
        resumed[name] = train(cls, regression_model(), tmp_path / f"{name}-resumed", data, resume=checkpoint, **common)
    after = lambda trainer: {s: v for s, v in losses(trainer).items() if s > resume_at}  # noqa: E731
    assert len(after(straight["t"])) == 16 - resume_at
    assert after(resumed["p"]) == after(straight["p"]) == after(straight["t"]) == after(resumed["t"])
    assert_same_run(resumed["p"], resumed["t"])


def test_resume_with_another_batch_size_warns_and_does_what_trainer_does(tmp_path, caplog):
    data = regression_rows()
    for name, cls in (("t", Trainer), ("p", PretrainTrainer)):
        train(cls, regression_model(), tmp_path / name, data, max_steps=10, save_strategy="steps", save_steps=5)
    resumed = {}
    with caplog.at_level(logging.WARNING, logger="hf_pretrain"):
        for name, cls in (("t", Trainer), ("p", PretrainTrainer)):
            checkpoint = str(tmp_path / name / "checkpoint-5")
            resumed[name] = train(
                cls,
                regression_model(),
                tmp_path / f"{name}-4",
                data,
                resume=checkpoint,
                max_steps=10,
                per_device_train_batch_size=4,
            )
    assert "Cannot resume the data position exactly: samples_per_micro_batch is 4" in caplog.text
    assert [step for step in losses(resumed["p"]) if step > 5] == [6, 7, 8, 9, 10]
    assert_same_run(resumed["p"], resumed["t"])


def test_after_load_best_model_at_end_output_dir_holds_trainers_entries_and_the_documented_records(tmp_path):
    """A user listing output_dir after load_best_model_at_end finds Trainer's checkpoints and the run records
    docs/telemetry.md argues for (transformers writes its own run logs under output_dir too); with
    pretrain_extras=False, the listing of Trainer exactly."""
    from hf_pretrain import PretrainingArguments

    best = dict(num_train_epochs=2, eval_strategy="epoch", save_strategy="epoch", load_best_model_at_end=True)
    listed = {}
    for name, trainer_cls, arguments in (
        ("trainer", Trainer, plain_args),
        ("ours", PretrainTrainer, plain_args),
        ("ours-no-extras", PretrainTrainer, lambda out, **kw: PretrainingArguments(out, pretrain_extras=False, **kw)),
    ):
        out = tmp_path / name
        args = arguments(out, report_to="none", use_cpu=True, disable_tqdm=True, **best)
        data = regression_rows()
        trainer_cls(model=regression_model(), args=args, train_dataset=data, eval_dataset=data).train()
        listed[name] = {p.name for p in out.iterdir()}
    assert listed["trainer"] == {"checkpoint-8", "checkpoint-16"}
    assert listed["ours"] - listed["trainer"] == {"telemetry.jsonl", "recovery"}  # docs/telemetry.md
    assert listed["ours-no-extras"] == listed["trainer"]
