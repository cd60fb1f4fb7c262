"""The checklist on screen and `rehearsal.md`: what was rehearsed, as what, each check, the runs and their logs."""

from __future__ import annotations

from pathlib import Path

import yaml

from .launch import RESTARTS
from .run import Rehearsal

MARK = {"passed": "passed", "failed": "FAILED", "not run": "not run"}


def header(rehearsal: Rehearsal) -> list[str]:
    topology = rehearsal.topology
    nodes = f"{topology.nodes} nodes x 1 process over 127.0.0.1" if topology.nodes > 1 else "1 node"
    lines = [
        f"launch     {rehearsal.request.launch.command}",
        f"rehearsed  {topology.processes} gloo processes ({nodes}), {topology.describe()}",
        f"model      {rehearsal.model}",
        f"steps      {rehearsal.request.steps}, checkpoints every {rehearsal.request.save_steps}, "
        f"rank {topology.processes - 1} killed in step {rehearsal.request.kill_at}",
    ]
    if rehearsal.request.recovery:
        lines.append(
            f"recovery   the restarted and hung runs allow one restart ({' '.join(RESTARTS)}) and resume with "
            "--resume_from_checkpoint auto"
        )
    lines += [f"changed    {note}" for note in rehearsal.notes]
    return lines


def checklist(rehearsal: Rehearsal) -> str:
    lines = header(rehearsal) + [""]
    for check in rehearsal.checks:
        lines.append(f"[{MARK[check.status]:>7}] {check.name:<28} {check.detail}")
        if check.fix:
            lines.append(f"{'':10}{'fix':<29}{check.fix}")
    runs = ", ".join(f"{run.name} {run.seconds:.0f} s" for run in rehearsal.runs)
    verdict = "PASSED" if rehearsal.passed else "FAILED"
    lines += ["", f"rehearsal {verdict} in {rehearsal.seconds:.0f} s ({runs}); {rehearsal.request.out}/rehearsal.md"]
    return "\n".join(lines)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def write_markdown(rehearsal: Rehearsal) -> Path:
    out = rehearsal.request.out
    rows = [
        f"| {check.name} | {MARK[check.status]} | {_cell(check.detail)} | {_cell(check.fix)} |"
        for check in rehearsal.checks
    ]
    runs = [
        f"| {run.name} | {run.seconds:.1f} | {run.returncodes} | {run.hung or ''} | `{run.log}` |"
        for run in rehearsal.runs
    ]
    text = "\n".join(
        [
            f"# Rehearsal: {'passed' if rehearsal.passed else 'FAILED'}",
            "",
            "```",
            *header(rehearsal),
            "```",
            "",
            "| check | status | detail | fix |",
            "|---|---|---|---|",
            *rows,
            "",
            "| run | seconds | exit codes | stopped because | log |",
            "|---|---|---|---|---|",
            *runs,
            "",
            f"The rehearsal's accelerate config (`{out / 'accelerate_config.yaml'}`):",
            "",
            "```yaml",
            yaml.safe_dump(rehearsal.topology.config, sort_keys=False).strip(),
            "```",
            "",
        ]
    )
    path = out / "rehearsal.md"
    path.write_text(text)
    return path
