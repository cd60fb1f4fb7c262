import pytest

from hf_pretrain.plan.restart import advise_restart, parse_speedup


def hours(advice):
    return {o.name: o.finishes_in_hours for o in advice.options}


@pytest.mark.parametrize(
    "text, gain", [("20%", 0.2), ("0.2", 0.2), (0.2, 0.2), ("1.2x", 0.2), ("2x", 1.0), (" 2 x ", 1.0)]
)
def test_speedup_forms(text, gain):
    assert parse_speedup(text) == pytest.approx(gain)


def test_restart_pays_only_in_about_the_first_day_of_a_week_for_20_percent():
    week = 7 * 24
    advice = advise_restart(elapsed_hours=12, remaining_hours=week - 12, speedup="20%", hours_since_checkpoint=12)
    assert advice.restart_pays_until_elapsed_hours == pytest.approx(28.0)  # 168 h x 0.2 / 1.2
    assert (
        hours(advice)["restart from scratch"] == pytest.approx(140.0)
        and advice.recommendation == "restart from scratch"
    )
    late = advise_restart(elapsed_hours=30, remaining_hours=week - 30, speedup=0.2, hours_since_checkpoint=30)
    assert late.recommendation == "continue"
    with_overhead = advise_restart(
        elapsed_hours=20, remaining_hours=week - 20, speedup=0.2, overhead_hours=10, hours_since_checkpoint=20
    )
    assert (
        with_overhead.restart_pays_until_elapsed_hours == pytest.approx(18.0)
        and with_overhead.recommendation == "continue"
    )


def test_resuming_on_the_faster_path_is_always_offered_and_usually_wins():
    advice = advise_restart(elapsed_hours=100, remaining_hours=68, speedup="2x", hours_since_checkpoint=0.5)
    assert [o.name for o in advice.options] == ["continue", "restart from scratch", "resume from last checkpoint"]
    assert hours(advice) == pytest.approx(
        {"continue": 68, "restart from scratch": 84, "resume from last checkpoint": 34.25}
    )
    assert advice.recommendation == "resume from last checkpoint"
    assert "recommendation: resume from last checkpoint" in advice.table()


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(speedup=0), "speedup"),
        (dict(speedup="fast"), "speedup"),
        (dict(elapsed_hours=-1), "elapsed_hours"),
        (dict(hours_since_checkpoint=5), "hours_since_checkpoint"),
    ],
)
def test_bad_inputs_name_the_field(kwargs, field):
    args = dict(elapsed_hours=1, remaining_hours=1, speedup=0.1) | kwargs
    with pytest.raises(ValueError, match=f"{field}="):
        advise_restart(**args)
