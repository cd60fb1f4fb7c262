import math

import pytest
import torch

from hf_pretrain import PretrainForCausalLM, PretrainingArguments, PretrainTrainer
from hf_pretrain.cli import main as cli
from hf_pretrain.training.schedules import (
    Restart,
    cosine_restarts_factor,
    get_cosine_restarts_schedule,
    get_wsd_schedule,
    wsd_factor,
)
from tests.conftest import quick_args, small_config
from tests.training.test_trainer import dataset

B = 1e9


def test_cosine_warmup_end_floor_and_monotonic_pieces():
    total, warmup = 100 * B, 0.8 * B  # the 7B recipe: warmup 0.8 %, cosine to 10 %
    f = lambda t: cosine_restarts_factor(t, total, warmup, floor=0.1)  # noqa: E731
    assert f(0) == 0 and f(warmup / 2) == pytest.approx(0.5) and f(warmup) == pytest.approx(1.0)
    assert f(total) == pytest.approx(0.1) and f(2 * total) == pytest.approx(0.1)
    mid = warmup + (total - warmup) / 2
    assert f(mid) == pytest.approx(0.55)  # halfway down the cosine
    values = [f(warmup + i * (total - warmup) / 100) for i in range(101)]
    assert all(a >= b for a, b in zip(values, values[1:]))


def test_restart_rebounds_by_its_fraction_of_the_gap_and_decays_to_the_floor_again():
    total, warmup, floor = 100 * B, 0.8 * B, 0.1
    restarts = [Restart(at=30 * B, rebound=0.3), Restart(at=70 * B, rebound=0.5, warmup=1 * B)]
    f = lambda t: cosine_restarts_factor(t, total, warmup, floor, restarts)  # noqa: E731
    plain = lambda t: cosine_restarts_factor(t, total, warmup, floor)  # noqa: E731
    before = plain(30 * B - 1)
    assert f(30 * B) == pytest.approx(before + 0.3 * (1 - before), abs=1e-6)  # the jump, 30 % of the gap
    before2 = f(70 * B - 1)
    assert f(70 * B) == pytest.approx(before2, abs=1e-6)  # a restart with warmup climbs instead of jumping
    assert f(70.5 * B) == pytest.approx(before2 + 0.5 * 0.5 * (1 - before2), abs=1e-6)
    assert f(71 * B) == pytest.approx(before2 + 0.5 * (1 - before2), abs=1e-6)
    assert f(total) == pytest.approx(floor)
    tail = [f(71 * B + i * 29 * B / 50) for i in range(51)]
    assert all(a >= b for a, b in zip(tail, tail[1:]))


@pytest.mark.parametrize("shape, at_half", [("linear", 0.55), ("cosine", 0.55), ("1-sqrt", 1 - 0.9 * math.sqrt(0.5))])
def test_wsd_stable_then_decay(shape, at_half):
    f = lambda s: wsd_factor(s, 1000, 10, decay_fraction=0.2, floor=0.1, shape=shape)  # noqa: E731
    assert f(5) == pytest.approx(0.5) and f(10) == 1.0 and f(799) == 1.0
    assert f(900) == pytest.approx(at_half) and f(1000) == pytest.approx(0.1)


def test_token_positioned_restarts_hold_under_changing_batch_sizes():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    seen = {"tokens": 0}
    schedule = get_cosine_restarts_schedule(
        optimizer,
        total=10_000,
        warmup=100,
        floor=0.1,
        restarts=[{"at": 5_000, "rebound": 0.3}],
        tokens_seen=lambda: seen["tokens"],
    )
    lrs = []
    for step in range(200):
        seen["tokens"] += 32 if step < 100 else 128  # the batch grows mid-run
        optimizer.step()
        schedule.step()
        lrs.append((seen["tokens"], optimizer.param_groups[0]["lr"]))
    at, lr = next((t, lr) for t, lr in lrs if t >= 5_000)
    assert lr == pytest.approx(cosine_restarts_factor(at, 10_000, 100, 0.1, [Restart(5_000, 0.3)]))
    jumps = [(t, b - a) for (t, a), (_, b) in zip(lrs, lrs[1:]) if b > a + 1e-9 and t > 100]
    assert len(jumps) == 1 and 4_800 < jumps[0][0] < 5_000  # exactly one rebound, where the tokens say


def test_bad_options_name_the_key():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    with pytest.raises(ValueError, match=r"lr_scheduler_kwargs\['floor'\]=2"):
        get_cosine_restarts_schedule(optimizer, 100, 10, floor=2)
    with pytest.raises(ValueError, match=r"lr_scheduler_kwargs\['shape'\]='square'"):
        get_wsd_schedule(optimizer, 100, 10, shape="square")


def test_by_name_through_pretraining_arguments(tmp_path):
    args = quick_args(
        tmp_path,
        max_steps=20,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        measure_peak_tflops=False,
        warmup_steps=4,
        lr_scheduler_type="wsd",
        lr_scheduler_kwargs={"decay_fraction": 0.25, "floor": 0.1, "shape": "linear"},
    )
    trainer = PretrainTrainer(model=PretrainForCausalLM(small_config()), args=args, train_dataset=dataset())
    trainer.train()
    lrs = [h["learning_rate"] for h in trainer.state.log_history if "learning_rate" in h]
    assert max(lrs) == pytest.approx(1e-3) and lrs[7] == pytest.approx(1e-3)  # stable
    assert lrs[-1] == pytest.approx(1e-3 * wsd_factor(19, 20, 4, 0.25, 0.1, "linear"))


def test_plot_schedule_writes_a_png(tmp_path, capsys):
    out = tmp_path / "lr.png"
    assert (
        cli(
            [
                "plot-schedule",
                "--total-tokens",
                "100e9",
                "--tokens-per-step",
                "65536",
                "--restart",
                "30e9:0.3",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    assert out.read_bytes()[:4] == b"\x89PNG" and "wrote" in capsys.readouterr().out


def test_the_schedule_survives_rebuilding_the_arguments():
    import dataclasses

    args = PretrainingArguments(output_dir="unused", lr_scheduler_type="cosine_restarts")
    rebuilt = dataclasses.replace(args, bf16=False)  # what examples/pretrain.py does to settle the dtype
    assert rebuilt.pretrain_schedule == "cosine_restarts"
