import json

import pytest
import torch
from transformers import PreTrainedTokenizerFast

from hf_pretrain.cli import main as cli
from hf_pretrain.trial import CAVEAT, COLUMNS, summarize

pytest.importorskip("torchao", reason="the fp8 recipe runs through torchao")


@pytest.mark.slow
def test_trial_command_end_to_end_on_cpu(tmp_path, capsys):
    out = tmp_path / "trial"
    code = cli(
        [
            "trial",
            "--config",
            "tiny",
            "--recipes",
            "fp32,fp8,te-nvfp4",
            "--steps",
            "4",
            "--warmup-steps",
            "1",
            "--loss-window",
            "3",
            "--seq-len",
            "64",
            "--batch-size",
            "4",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    result = json.loads((out / "trial.json").read_text())
    rows = {r["recipe"]: r for r in result["rows"]}
    assert [r["recipe"] for r in result["rows"]] == ["fp32", "fp8", "te-nvfp4"]  # order kept, nothing dropped
    assert all(set(r) == set(COLUMNS) for r in result["rows"])  # every row has every column
    unmeasured_here = ("reason", "mfu_spec", "mfu_measured", "mean_power_w", "mfu_spec_warning")
    measured = [c for c in COLUMNS if c not in unmeasured_here]
    assert all(rows[r][c] is not None for r in ("fp32", "fp8") for c in measured)  # ...filled where it ran
    for recipe in ("fp32", "fp8"):
        row = rows[recipe]
        assert row["status"] == "ok" and row["median_step_s"] > 0 and row["tokens_per_second"] > 0
        assert row["step_s_p10"] <= row["median_step_s"] <= row["step_s_p90"]
        assert row["peak_memory_gib"] > 0 and row["final_loss"] > 0
        assert row["mfu_spec"] is None and row["mean_power_w"] is None  # a CPU has neither: n/a, never 0
        assert row["mfu_spec_warning"] is None  # no spec peak, so nothing withheld
    # fp8 on a CPU has no native kernels: marked, no measured ceiling (no fp8 matmul here), never recommended
    assert rows["fp8"]["emulated"] is True and "no fp8 tensor cores" in rows["fp8"]["reason"]
    assert rows["fp8"]["mfu_measured"] is None and rows["fp32"]["mfu_measured"] > 0
    assert rows["fp32"]["emulated"] is False and rows["fp32"]["reason"] == ""
    assert rows["fp32"]["step_time_vs_first"] == 1.0
    assert rows["te-nvfp4"]["status"] == "unavailable" and "transformer_engine" in rows["te-nvfp4"]["reason"]
    assert result["recommendation"] == "fp32" and result["note"] == CAVEAT and result["loss_window"] == 3
    markdown = (out / "trial.md").read_text()
    assert "te-nvfp4 | unavailable" in markdown and CAVEAT in markdown and "Recommendation" in markdown
    assert "| fp8 (emulated) |" in markdown and "Emulated here" in markdown
    assert "runs EMULATED on cpu" in (out / "fp8.log").read_text()  # the run-time warning of the fp8 process
    assert CAVEAT in capsys.readouterr().out


def test_recommendation_is_the_fastest_within_the_loss_tolerance():
    def ok(recipe, step, loss, memory=10.0):
        return {"recipe": recipe, "status": "ok", "median_step_s": step, "peak_memory_gib": memory, "final_loss": loss}

    # Field notes: native FP8 3.149 s and 51.9 GiB against TE FP8's 3.967 s and 73.3 GiB.
    rows = [
        ok("te-fp8", 3.967, 3.10, 73.3),
        ok("fp8", 3.149, 3.11, 51.9),
        ok("te-nvfp4", 2.9, 3.40, 48.2),
        {"recipe": "te-mxfp8", "status": "unavailable", "reason": "needs Blackwell"},
    ]
    result = summarize(rows, 20, 5, loss_tolerance=0.05)
    by = {r["recipe"]: r for r in result["rows"]}
    assert result["recommendation"] == "fp8"  # te-nvfp4 is faster but its loss is 0.3 nats worse
    assert by["fp8"]["step_time_vs_first"] == pytest.approx(3.149 / 3.967)  # 20.6 % faster
    assert by["fp8"]["memory_vs_first"] == pytest.approx(51.9 / 73.3)
    assert by["te-mxfp8"]["step_time_vs_first"] is None and by["te-mxfp8"]["reason"] == "needs Blackwell"
    assert summarize(rows[-1:], 20, 5, 0.05)["recommendation"] is None


def test_an_emulated_recipe_is_never_recommended_over_a_native_one():
    def ok(recipe, step, loss, emulated=False):
        return {
            "recipe": recipe,
            "status": "ok",
            "median_step_s": step,
            "peak_memory_gib": 1.0,
            "final_loss": loss,
            "emulated": emulated,
        }

    # fp8 emulated on a CPU, faster in a noisy 4-step timing and with the better loss: still fp32
    rows = [ok("fp32", 0.104, 8.31), ok("fp8", 0.09, 8.20, emulated=True)]
    assert summarize(rows, 6, 2, 0.05)["recommendation"] == "fp32"
    assert summarize(rows[1:], 6, 2, 0.05)["recommendation"] == "fp8"  # nothing native ran: the only one
    # among native recipes the rule is unchanged: the fastest within the tolerance of the best native loss
    rows = [ok("fp32", 0.3, 8.31), ok("bf16", 0.2, 8.33), ok("fp8", 0.1, 8.0, emulated=True)]
    assert summarize(rows, 6, 2, 0.05)["recommendation"] == "bf16"


def test_the_final_loss_is_the_mean_of_the_last_losses():
    from hf_pretrain.trial import final_loss

    losses = [9.0, 8.0, 7.5, 7.0, 7.25, 6.75, 7.5]
    assert final_loss(losses, 5) == pytest.approx((7.5 + 7.0 + 7.25 + 6.75 + 7.5) / 5)
    assert final_loss(losses, 1) == 7.5 and final_loss(losses[:2], 5) == 8.5
    with pytest.raises(ValueError, match="no loss was logged"):
        final_loss([], 5)


def test_trial_data_is_packed_with_the_tokenizers_own_eos(tmp_path):
    from hf_pretrain.data.collator import document_position_ids
    from hf_pretrain.data.prepared import load_split, tokenizer_path
    from hf_pretrain.presets import load_config
    from hf_pretrain.trial import prepare_trial_data

    path, eos = prepare_trial_data(load_config("tiny"), tmp_path, 64)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(str(tokenizer_path(tmp_path / "data" / "prepared")))
    assert eos == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|eos|>")
    ids = torch.tensor(load_split(path)["input_ids"][:32])
    assert (ids == eos).any()  # documents end in that id inside the blocks...
    positions = document_position_ids(ids, eos)
    assert (positions[:, 1:] == 0).any()  # ...so the collator restarts positions after it


def test_bad_trial_arguments(tmp_path):
    from hf_pretrain.trial import run_trial

    with pytest.raises(ValueError, match="warmup_steps=5 is invalid"):
        run_trial("tiny", ["fp32"], steps=5, warmup_steps=5, out_dir=tmp_path)
    with pytest.raises(ValueError, match=r"recipes=\['int4'\] are unknown"):
        run_trial("tiny", ["int4"], out_dir=tmp_path)
    with pytest.raises(ValueError, match="loss_window=0 is invalid"):
        run_trial("tiny", ["fp32"], steps=5, warmup_steps=1, out_dir=tmp_path, loss_window=0)


def test_a_small_corpus_is_repeated_to_fill_the_steps():
    from datasets import Dataset

    from hf_pretrain.trial import repeat_to

    data = Dataset.from_dict({"input_ids": [[1], [2], [3]]})
    assert repeat_to(data, 7)["input_ids"] == [[1], [2], [3], [1], [2], [3], [1]]
    assert len(repeat_to(data, 2)) == 3
