"""Restart advisor: continue, restart from scratch, or resume from the last checkpoint on a faster path?

A faster path (a kernel that was missing, a better precision recipe) found mid-run raises the
question the field notes answer with arithmetic. With `speedup` S the fraction of step time saved
(0.2: each step takes 80 % of the time), elapsed E and remaining R hours:

    continue                      R
    restart from scratch          (E + R)(1 - S) + overhead
    resume from the checkpoint    (R + h)(1 - S) + overhead     (h: hours since that checkpoint)

Restarting from scratch only pays while E < S (E + R) - overhead: while the elapsed time is below
the saved fraction of the whole run. For a 20 % speedup on a 7-day run that is the first ~1.4 days,
"about the first day" once a restart's overhead is counted. hf_pretrain checkpoints do not depend
on the attention kernel or the data loader position format, so resuming on the faster path is
exact and usually beats both.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class RestartOption:
    name: str
    finishes_in_hours: float
    note: str


@dataclass
class RestartAdvice:
    recommendation: str
    options: list[RestartOption]
    restart_pays_until_elapsed_hours: float

    def table(self) -> str:
        lines = [f"{o.name:<28} finishes in {o.finishes_in_hours:8.1f} h   {o.note}" for o in self.options]
        lines.append(f"restarting from scratch pays only while elapsed < {self.restart_pays_until_elapsed_hours:.1f} h")
        lines.append(f"recommendation: {self.recommendation}")
        return "\n".join(lines)


def _check(name: str, value: float, low: float, high: float | None = None) -> None:
    if value < low or (high is not None and value >= high):
        bound = f"in [{low}, {high})" if high is not None else f">= {low}"
        raise ValueError(f"{name}={value} is invalid: it must be {bound}.")


def advise_restart(
    elapsed_hours: float,
    remaining_hours: float,
    speedup: float,
    hours_since_checkpoint: float | None = None,
    overhead_hours: float = 0.0,
) -> RestartAdvice:
    """Hours to finish for each option and the fastest one (ties go to continuing as is)."""
    _check("elapsed_hours", elapsed_hours, 0)
    _check("remaining_hours", remaining_hours, 0)
    _check("speedup", speedup, 0, 1)
    _check("overhead_hours", overhead_hours, 0)
    factor = 1 - speedup
    options = [
        RestartOption("continue", remaining_hours, "keep the current path"),
        RestartOption(
            "restart from scratch",
            (elapsed_hours + remaining_hours) * factor + overhead_hours,
            f"redo {elapsed_hours:.1f} h of work on the faster path",
        ),
    ]
    if hours_since_checkpoint is not None:
        _check("hours_since_checkpoint", hours_since_checkpoint, 0)
        options.append(
            RestartOption(
                "resume from last checkpoint",
                (remaining_hours + hours_since_checkpoint) * factor + overhead_hours,
                f"lose {hours_since_checkpoint:.1f} h since the checkpoint; checkpoints do not depend on the kernel",
            )
        )
    best = min(options, key=lambda o: (round(o.finishes_in_hours, 9), o.name != "continue"))
    break_even = max(0.0, speedup * (elapsed_hours + remaining_hours) - overhead_hours)
    return RestartAdvice(best.name, options, break_even)
