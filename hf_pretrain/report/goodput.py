"""The run's goodput in one line, from the last training log that carries it (`telemetry/goodput.py`).

`goodput_summary(records)`: e.g. `goodput 0.83 at step 52000: 139.7 h productive of 168.0 h; lost to 3 restarts
5.1 h, checkpoint stalls 12.0 min (36 saves, 20.0 s each), evaluations 1.1 h, other (start-up, data, logging) 21.7 h`; None for a run
logged without it (telemetry off, or before goodput was logged).
"""

from __future__ import annotations

KINDS = (("restart", "lost to {restarts} restart{s}"), ("checkpoint", "checkpoint stalls"), ("eval", "evaluations"))


def _duration(seconds: float) -> str:
    return (
        f"{seconds / 3600:.1f} h"
        if seconds >= 3600
        else f"{seconds / 60:.1f} min"
        if seconds >= 60
        else f"{seconds:.1f} s"
    )


def last_goodput(records: list[dict]) -> dict | None:
    """The last training log that carries goodput (None: telemetry off, or before goodput was logged)."""
    return next((r for r in reversed(records) if isinstance(r.get("goodput"), (int, float))), None)


def goodput_summary(records: list[dict]) -> str | None:
    last = last_goodput(records)
    if last is None:
        return None
    wall, productive = last["goodput_wall_s"], last["goodput_productive_s"]
    restarts = int(last.get("goodput_restarts", 0))
    parts, other = [], wall - productive
    for kind, label in KINDS:
        seconds = last.get(f"goodput_{kind}_s", 0.0)
        other -= seconds
        part = f"{label.format(restarts=restarts, s='' if restarts == 1 else 's')} {_duration(seconds)}"
        saves = int(last.get("goodput_saves", 0))
        if kind == "checkpoint" and saves:  # one save's stall: what `hf-pretrain plan --checkpoint-seconds` takes
            part += f" ({saves} save{'' if saves == 1 else 's'}, {_duration(seconds / saves)} each)"
        parts.append(part)
    parts.append(f"other (start-up, data, logging) {_duration(max(other, 0.0))}")
    return (
        f"goodput {last['goodput']:.2f} at step {last['step']}: {_duration(productive)} productive of "
        f"{_duration(wall)}; " + ", ".join(parts)
    )
