"""How often a run can afford the downstream suite: `hf-pretrain plan`'s "downstream" row.

One evaluation scores every request once, forward only: about a third of the FLOPs a training token
costs (2N of 6N), so its time is the suite's tokens / (3 x the run's tokens/s), at the training's
MFU (small evaluation batches run below it: a floor, not a promise). The interval keeps the suite
under `share` of the run (1 %) and to at most `CURVE_POINTS` evaluations. The suite's tokens are its
UTF-8 bytes (contexts and continuations of the seeded subset) / `bytes_per_token` (4: an English
BPE of 32k-50k tokens; hf_pretrain's tokenizer reports its own with `data train-tokenizer`).
"""

from __future__ import annotations

import math

from .data import MissingTaskData
from .tasks import build_examples, resolve_tasks

BYTES_PER_TOKEN = 4.0
CURVE_POINTS = 50  # enough evaluations for a curve; more only cost time


def suite_bytes(tasks: str = "default", examples: int = 500, seed: int = 1234) -> int:
    total = 0
    for task in resolve_tasks(tasks):
        for e in build_examples(task, limit=examples, seed=seed).examples:
            total += sum(len((c + k).encode("utf-8")) for c, k in zip(e.contexts, e.continuations))
    return total


def evaluation_every(
    steps: int,
    step_seconds: float,
    tokens_per_second: float,
    share: float = 0.01,
    tasks: str = "default",
    examples: int = 500,
) -> tuple[int, float, float]:
    """(steps between evaluations, tokens of one evaluation, its seconds)."""
    tokens = suite_bytes(tasks, examples) / BYTES_PER_TOKEN
    seconds = tokens / (3 * tokens_per_second)
    every = max(1, math.ceil(seconds / (share * step_seconds)), math.ceil(steps / CURVE_POINTS))
    return every, tokens, seconds


def plan_row(plan, share: float = 0.01) -> str:
    try:
        every, tokens, seconds = evaluation_every(plan.steps, plan.step_seconds, plan.tokens_per_second, share)
    except MissingTaskData as err:
        return f"unavailable: {err}"
    count = max(plan.steps // every, 1)
    spent = count * seconds / (plan.steps * plan.step_seconds)
    return (
        f"default suite, 500 examples a task: ~{tokens / 1e6:.1f} M tokens forward, ~{seconds:.0f} s an evaluation; "
        f"--downstream_tasks default --downstream_every {every}: {count} evaluations, ~{spent:.2%} of the run"
    )
