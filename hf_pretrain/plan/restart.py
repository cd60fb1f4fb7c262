"""Restart advisor: continue, restart from scratch, or resume from the last checkpoint on a faster path?

Planning arithmetic on a run's wall-clock hours, like `resilience.py`'s checkpoint interval, so it lives in
plan/ (an application: only `hf-pretrain advise-restart` calls it, and it imports nothing of the package). Not a
preflight (its question comes up during or after a run, not before it starts) and not training/recovery/ (the
trainer never asks it: a person does, with the hours their run has left).

A faster path (a kernel that was missing, a better precision recipe) found mid-run raises the
question the field notes answer with arithmetic. With a speedup s (0.2 = 20 % faster: 1.2x the
throughput, each step takes 1 / 1.2 of the time), elapsed E and remaining R hours on the current
path:

    continue                      R
    restart from scratch          (E + R) / (1 + s) + overhead
    resume from the checkpoint    (R + h) / (1 + s) + overhead     (h: hours since that checkpoint)

Restarting from scratch pays only while E < (E + R) * s / (1 + s) - overhead: while the elapsed
time is below the fraction of the whole run the faster path saves. For 20 % on a 7-day run that is
the first 28 hours, about the first day. hf_pretrain checkpoints do not depend on the attention
kernel, so resuming on the faster path is exact and beats both whenever a checkpoint is recent.
"""

from __future__ import annotations

import re
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


def parse_speedup(text: str | float) -> float:
    """'20%', '0.2' (20 % faster), '1.2x' or '2x' (throughput ratio) -> the gain s (0.2, 0.2, 0.2, 1.0)."""
    if isinstance(text, (int, float)):
        return float(text)
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(%|x|×)?\s*", str(text))
    if not match:
        raise ValueError(f"speedup={text!r} is invalid: write 20%, 0.2 (20 % faster) or 1.2x / 2x (throughput ratio).")
    value, unit = float(match.group(1)), match.group(2)
    return value / 100 if unit == "%" else value - 1 if unit in ("x", "×") else value


def _check(name: str, value: float, low: float, strict: bool = False) -> None:
    if value < low or (strict and value == low):
        raise ValueError(f"{name}={value} is invalid: it must be {'>' if strict else '>='} {low}.")


def advise_restart(
    elapsed_hours: float,
    remaining_hours: float,
    speedup: float | str,
    hours_since_checkpoint: float = 0.0,
    overhead_hours: float = 0.0,
) -> RestartAdvice:
    """Hours to finish for each option and the fastest one (ties go to continuing as is).

    `speedup` is the throughput gain of the faster path (0.2 or "20%" = 20 % faster, "2x" = twice
    as fast); `hours_since_checkpoint` is the work a resume repeats (0: a checkpoint right now).
    """
    gain = parse_speedup(speedup)
    _check("elapsed_hours", elapsed_hours, 0)
    _check("remaining_hours", remaining_hours, 0)
    _check("speedup", gain, 0, strict=True)
    _check("overhead_hours", overhead_hours, 0)
    _check("hours_since_checkpoint", hours_since_checkpoint, 0)
    if hours_since_checkpoint > elapsed_hours:
        raise ValueError(
            f"hours_since_checkpoint={hours_since_checkpoint} is invalid: it cannot exceed elapsed_hours={elapsed_hours}."
        )
    factor = 1 / (1 + gain)
    options = [
        RestartOption("continue", remaining_hours, "keep the current path"),
        RestartOption(
            "restart from scratch",
            (elapsed_hours + remaining_hours) * factor + overhead_hours,
            f"redo {elapsed_hours:.1f} h of work on the faster path",
        ),
        RestartOption(
            "resume from last checkpoint",
            (remaining_hours + hours_since_checkpoint) * factor + overhead_hours,
            f"repeat {hours_since_checkpoint:.1f} h since the checkpoint; checkpoints do not depend on the kernel",
        ),
    ]
    best = min(options, key=lambda o: (round(o.finishes_in_hours, 9), o.name != "continue"))
    break_even = max(0.0, (elapsed_hours + remaining_hours) * gain / (1 + gain) - overhead_hours)
    return RestartAdvice(best.name, options, break_even)
