"""Figures of a multiple-choice task from the log-likelihood of each choice, as the field reports them.

Per example (ties go to the first choice, as `numpy.argmax` in lm-eval):
- `acc`: the choice with the highest log-likelihood is the gold one;
- `acc_norm`: the same after dividing each log-likelihood by the characters of its choice text
  (lm-eval's `acc_norm`, length-normalised per character);
- `acc_per_token`: divided by the continuation's tokens (nanochat's CORE ranks by mean token loss);
- `bpb`: bits per UTF-8 byte of the gold continuation as scored, -log2 p / bytes (OLMo's `bpb`,
  averaged over examples), which moves long before accuracy leaves chance.
Per task: their means, `chance` (the mean of 1 / number of choices), `centered` = (primary - chance)
/ (1 - chance) of the task's primary figure (nanochat's CORE; 0 at chance, 1 when perfect) and the
primary's standard error sqrt(p (1 - p) / (n - 1)) (lm-eval's `_stderr`). Across tasks, `centered`
is their mean.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from .tasks import Example

METRICS = ("acc", "acc_norm", "acc_per_token", "bpb")


def _first_argmax(values: Sequence[float]) -> int:
    return max(range(len(values)), key=lambda i: (values[i], -i))


@dataclass(frozen=True)
class ExampleResult:
    loglikelihoods: tuple[float, ...]
    tokens: tuple[int, ...]
    gold: int
    acc: float
    acc_norm: float
    acc_per_token: float
    bpb: float


def score_example(example: Example, loglikelihoods: Sequence[float], tokens: Sequence[int]) -> ExampleResult:
    lls = [float(v) for v in loglikelihoods]
    by_char = [ll / max(len(c), 1) for ll, c in zip(lls, example.choices)]
    by_token = [ll / n for ll, n in zip(lls, tokens)]
    gold_bytes = max(len(example.continuations[example.gold].encode("utf-8")), 1)
    return ExampleResult(
        tuple(lls),
        tuple(tokens),
        example.gold,
        float(_first_argmax(lls) == example.gold),
        float(_first_argmax(by_char) == example.gold),
        float(_first_argmax(by_token) == example.gold),
        -lls[example.gold] / (math.log(2) * gold_bytes),
    )


def stderr(p: float, n: int) -> float:
    return math.sqrt(p * (1 - p) / (n - 1)) if n > 1 else float("nan")


def chance_interval(chance: float, n: int, z: float = 2.576) -> tuple[float, float]:
    """Where the accuracy of a guesser falls on n examples, normal approximation of the binomial (z=2.576: 99 %),
    clipped to [0, 1] (an accuracy is never outside it; on a few examples the approximation's interval is)."""
    half = z * math.sqrt(chance * (1 - chance) / n)
    return max(0.0, chance - half), min(1.0, chance + half)


def task_figures(examples: Sequence[Example], results: Sequence[ExampleResult], primary: str) -> dict[str, float]:
    n = len(results)
    figures: dict[str, float] = {m: sum(getattr(r, m) for r in results) / n for m in METRICS}
    chance = sum(1 / len(e.choices) for e in examples) / n
    figures.update(
        n=n,
        chance=chance,
        centered=(figures[primary] - chance) / (1 - chance),
        stderr=stderr(figures[primary], n),
    )
    return figures


def at_chance(figures: dict[str, float], primary: str) -> bool:
    low, high = chance_interval(figures["chance"], int(figures["n"]))
    return low <= figures[primary] <= high


def centered_mean(per_task: dict[str, dict[str, float]]) -> float:
    return sum(f["centered"] for f in per_task.values()) / len(per_task)
