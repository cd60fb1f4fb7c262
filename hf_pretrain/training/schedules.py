"""Learning-rate schedules for pretraining: cosine with warmup, floor and token-positioned restarts; WSD.

Each schedule is a pure function of *progress* (tokens seen, or optimizer steps when no token count
is given) returning the factor applied to the peak learning rate, wrapped as a
`torch.optim.lr_scheduler.LambdaLR` by `get_cosine_restarts_schedule` / `get_wsd_schedule`, and
usable by name from `PretrainingArguments` (`lr_scheduler_type="cosine_restarts"` or `"wsd"`, options
in `lr_scheduler_kwargs`, the way transformers users already configure schedules).

- cosine_restarts: linear warmup to the peak, cosine decay to `floor` (a fraction of the peak) at
  the end of training. A restart at position R lifts the learning rate by `rebound` of the gap
  to the peak (0.3: 30 % of the way back up), optionally over `warmup` of its own, then decays by
  cosine to the floor again at the end: the field notes' 7B recipe restarted once at 30 B tokens
  with a 30 % rebound and gained 2 % validation loss.
- wsd (warmup-stable-decay): linear warmup, constant peak, then a decay over the last
  `decay_fraction` of training to `floor`, shaped `linear`, `cosine` or `1-sqrt`.

Positions are tokens when the schedule gets a `tokens_seen` callable (PretrainTrainer passes its
real-token counter), so restarts land at the same token count whatever the batch size; otherwise
they are optimizer steps. Written by hand: transformers' schedules are step-based and have no
floor-with-restarts or token positions; the shapes themselves are the usual ones.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from torch.optim.lr_scheduler import LambdaLR

SCHEDULES = ("cosine_restarts", "wsd")
DECAY_SHAPES = ("linear", "cosine", "1-sqrt")


@dataclass(frozen=True)
class Restart:
    at: float  # position (tokens or steps) where the restart happens
    rebound: float = 0.3  # fraction of the gap to the peak the learning rate jumps back up by
    warmup: float = 0.0  # position span over which it climbs to the rebound (0: a jump)


def _cosine(start: float, end: float, fraction: float) -> float:
    return end + (start - end) * 0.5 * (1 + math.cos(math.pi * min(max(fraction, 0.0), 1.0)))


def cosine_restarts_factor(
    position: float, total: float, warmup: float, floor: float = 0.1, restarts: Sequence[Restart] = ()
) -> float:
    """Learning-rate factor at `position` of `total` (same unit): warmup, cosine to `floor`, restarts."""
    if position < warmup:
        return position / warmup
    segment_start, start_value = warmup, 1.0
    for restart in sorted(restarts, key=lambda r: r.at):
        if position < restart.at:
            break
        before = _cosine(start_value, floor, (restart.at - segment_start) / max(total - segment_start, 1e-12))
        peak = before + restart.rebound * (1.0 - before)
        if position < restart.at + restart.warmup:
            return before + (peak - before) * (position - restart.at) / restart.warmup
        segment_start, start_value = restart.at + restart.warmup, peak
    return _cosine(start_value, floor, (position - segment_start) / max(total - segment_start, 1e-12))


def wsd_factor(
    position: float, total: float, warmup: float, decay_fraction: float = 0.2, floor: float = 0.0, shape: str = "1-sqrt"
) -> float:
    """Warmup-stable-decay factor at `position` of `total`."""
    if position < warmup:
        return position / warmup
    decay_start = total * (1 - decay_fraction)
    if position < decay_start:
        return 1.0
    fraction = min((position - decay_start) / max(total - decay_start, 1e-12), 1.0)
    drop = {"linear": fraction, "cosine": 0.5 * (1 - math.cos(math.pi * fraction)), "1-sqrt": math.sqrt(fraction)}[
        shape
    ]
    return 1.0 - (1.0 - floor) * drop


def _check(**values) -> None:
    for name, (value, ok, allowed) in values.items():
        if not ok(value):
            raise ValueError(f"lr_scheduler_kwargs[{name!r}]={value!r} is invalid: {allowed}.")


def _lambda(factor: Callable[[float], float], tokens_seen: Callable[[], float] | None) -> Callable[[int], float]:
    return (lambda step: factor(tokens_seen())) if tokens_seen is not None else (lambda step: factor(step))


def get_cosine_restarts_schedule(
    optimizer,
    total: float,
    warmup: float,
    floor: float = 0.1,
    restarts: Sequence[Restart | dict] = (),
    tokens_seen: Callable[[], float] | None = None,
) -> LambdaLR:
    """LambdaLR of `cosine_restarts_factor`; positions are tokens when `tokens_seen` is given, else steps."""
    restarts = [r if isinstance(r, Restart) else Restart(**r) for r in restarts]
    _check(
        floor=(floor, lambda v: 0 <= v <= 1, "use a fraction of the peak in [0, 1]"),
        warmup=(warmup, lambda v: 0 <= v <= total, f"it must be in [0, total={total}]"),
        restarts=(
            restarts,
            lambda rs: all(warmup <= r.at < total and 0 <= r.rebound <= 1 and r.warmup >= 0 for r in rs),
            "each restart needs warmup <= at < total, rebound in [0, 1] and warmup >= 0",
        ),
    )
    return LambdaLR(
        optimizer, _lambda(lambda p: cosine_restarts_factor(p, total, warmup, floor, restarts), tokens_seen)
    )


def get_wsd_schedule(
    optimizer,
    total: float,
    warmup: float,
    decay_fraction: float = 0.2,
    floor: float = 0.0,
    shape: str = "1-sqrt",
    tokens_seen: Callable[[], float] | None = None,
) -> LambdaLR:
    """LambdaLR of `wsd_factor`; positions are tokens when `tokens_seen` is given, else steps."""
    _check(
        decay_fraction=(decay_fraction, lambda v: 0 < v <= 1, "it must be in (0, 1]"),
        shape=(shape, lambda v: v in DECAY_SHAPES, f"use one of {list(DECAY_SHAPES)}"),
        floor=(floor, lambda v: 0 <= v <= 1, "use a fraction of the peak in [0, 1]"),
        warmup=(warmup, lambda v: 0 <= v < total * (1 - decay_fraction) or v == 0, "warmup must end before the decay"),
    )
    return LambdaLR(
        optimizer, _lambda(lambda p: wsd_factor(p, total, warmup, decay_fraction, floor, shape), tokens_seen)
    )


def build_schedule(
    name: str,
    optimizer,
    num_training_steps: int,
    num_warmup_steps: int,
    kwargs: dict | None,
    tokens_seen: Callable[[], float] | None = None,
) -> LambdaLR:
    """The schedule `name` for the Trainer. With `total_tokens` in `kwargs`, positions are tokens (`tokens_seen`),
    and `warmup_tokens` / restart `at` are tokens; otherwise steps, warmup from the Trainer's warmup arguments."""
    kwargs = dict(kwargs or {})
    total_tokens = kwargs.pop("total_tokens", None)
    if total_tokens is not None:
        if tokens_seen is None:
            raise ValueError("lr_scheduler_kwargs['total_tokens'] needs a token counter: use PretrainTrainer.")
        total, warmup = float(total_tokens), float(kwargs.pop("warmup_tokens", 0.008 * total_tokens))
    else:
        total, warmup, tokens_seen = float(num_training_steps), float(num_warmup_steps), None
    if name == "cosine_restarts":
        return get_cosine_restarts_schedule(optimizer, total, warmup, tokens_seen=tokens_seen, **kwargs)
    if name == "wsd":
        return get_wsd_schedule(optimizer, total, warmup, tokens_seen=tokens_seen, **kwargs)
    raise ValueError(f"lr_scheduler_type={name!r} is not an hf_pretrain schedule; use one of {list(SCHEDULES)}.")


def plot_schedule(
    factor: Callable[[float], float],
    total: float,
    peak_lr: float,
    out: str,
    tokens_per_step: float | None = None,
    title: str = "",
) -> str:
    """PNG of the learning rate against position (tokens, or steps), with a step axis when `tokens_per_step` is known."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [total * i / 2000 for i in range(2001)]
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ax.plot(xs, [peak_lr * factor(x) for x in xs], linewidth=2)
    ax.set_xlabel("tokens" if tokens_per_step else "optimizer steps")
    ax.set_ylabel("learning rate")
    ax.grid(alpha=0.3)
    if tokens_per_step:
        top = ax.secondary_xaxis("top", functions=(lambda t: t / tokens_per_step, lambda s: s * tokens_per_step))
        top.set_xlabel("optimizer steps")
    ax.set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out
