"""The straggler rule: which rank is slow, from every rank's timings and sensor reading.

Why two compute measures. On a GPU the host only enqueues kernels, so a slow device does not make
its own host slower: its slowness appears as *wait* on every other rank. Device clocks fix that for
DDP: the fast ranks' events stop at their last bucket while the slow rank's run to its own. Under
DeepSpeed and FSDP there is no such hook, and every collective inside forward/backward (ZeRO-3's
and FSDP's parameter all-gathers, ZeRO-2's reduce-scatters, the all-gather after ZeRO-1/2's
optimizer, which DeepSpeed runs inside `backward`, AutoTP's row-parallel all-reduces, Ulysses'
all-to-alls) makes each rank wait for the slowest *inside*
its micro-batch: `compute_s` comes out equal on all ranks and can never name one. There the rule
reads `local_s` instead.

The rule (`straggler_report`, one function for every engine; rows from every rank). Every `every`
steps the ranks exchange their window's medians with their SM clock, power, utilization, throttle
reasons and memory (one small all_gather). If every rank's `compute_s` is its own work (DDP
with the bucket hook, one process) the score of a rank is the best `compute_s` / its
own; else the best `local_s` / its own, per multiply-add (`local_work`) where every rank counted
them: ranks holding unequal shards of the linears (AutoTP's uneven splits) do unequal work, and
a rank with 1.5x the matmuls is not slow for taking longer. Equal shards (every other engine, an
even split) leave the ratio as it was. The per-call overhead of small matmuls does not scale with
their size: at the tests' width of 128 on a CPU a rank with 1.5x the multiply-adds took about as
long, so per multiply-add the other looked slow (a score of 0.54 once in two windows); at 512 the
time followed the multiply-adds (raw scores 0.74 and 0.62, per multiply-add 0.90 and 0.93), as
large matmuls on a GPU should (not measured on one). A rank with a score below `threshold` (0.75) is a
straggler: "rank 1 (node-b) 1.8x slower, SM 600/2190 MHz, 30 W, no throttle flag; rank 0 waits
3.3 s of 7.2 s" (the waits where they are measured). An under-clocked rank (the one rule of
`underclock.py`, on its gathered reading) is reported by rank 0 as well, so a problem on any rank
reaches the logs, `report_to`, the JSONL stream and the report. `local_s` is not timed under
`torch.compile` (hooks would break the graph): compiled DeepSpeed/FSDP runs keep only the
compute measure, which cannot see a straggler there.

`straggler_report(rows, hosts, threshold)` returns the metrics to log and the warning (or None);
`StragglerCallback` (`straggler.py`) gathers the rows. Pure functions over plain dicts, so the rule is
tested on recorded and simulated timelines of every engine (tests/telemetry/engine_timelines.py).
"""

from __future__ import annotations

from .sensors import LIMITING_REASONS, THROTTLE_REASONS

TIMES = ("compute_s", "local_s", "wait_s", "data_wait_s", "step_s")
SENSORS = ("sm_clock_mhz", "sm_clock_max_mhz", "power_w", "utilization_pct", "memory_gib")
# wait_free: 1 when compute_s is this rank's own work (no collective inside it); reasons: NVML's mask, -1 unknown;
# steps: how many timed steps the medians cover (0 on a GPU whose first steps are not read yet: no verdict then)
# local_work: the multiply-adds `local_s` timed (0: none timed, or a row from before it was gathered)
FIELDS = (*TIMES, *SENSORS, "reasons", "wait_free", "steps", "local_work")
REASON_BITS = {name: bit for bit, name in THROTTLE_REASONS.items()}


def _secs(seconds: float) -> str:
    return f"{seconds:.1f} s" if seconds >= 1 else f"{seconds:.2f} s"


def straggler_basis(rows: list[dict]) -> str:
    """`compute` when every rank's compute is its own work, else `local` (when every rank timed its linears)."""
    if all(r.get("wait_free", 0) > 0 for r in rows):
        return "compute"
    return "local" if all(r.get("local_s", 0) > 0 for r in rows) else "compute"


def straggler_scores(rows: list[dict]) -> tuple[list[float], str]:
    """Per rank: the best rank's time / its own, on the basis of `straggler_basis`; and the basis. On `local`, each
    rank's seconds per multiply-add of its timed linears where every rank counted them (shards of unequal width)."""
    basis = straggler_basis(rows)
    values = [r[f"{basis}_s"] for r in rows]
    if basis == "local" and all(r.get("local_work", 0) > 0 for r in rows):
        values = [r["local_s"] / r["local_work"] for r in rows]
    best = min(values)
    if best <= 0:  # a rank without a timed step: nothing to compare
        return [1.0] * len(rows), basis
    return [best / v for v in values], basis


def reasons_mask(reasons: str | None) -> float:
    """NVML's clocks-event mask from the decoded names (`gpu_throttle_reasons`), -1 when unknown."""
    if reasons is None:
        return -1.0
    return float(sum(REASON_BITS.get(name, 0) for name in reasons.split(",")))


def reading_of(row: dict) -> dict:
    """A sensor reading (the keys of `telemetry/sensors.py`) from a gathered row: what is -1 was not read."""
    reading = {}
    for field, key in (
        ("sm_clock_mhz", "gpu_sm_clock_mhz"),
        ("sm_clock_max_mhz", "gpu_sm_clock_max_mhz"),
        ("power_w", "gpu_power_w"),
        ("utilization_pct", "gpu_utilization_pct"),
    ):
        if row.get(field, -1) >= 0:
            reading[key] = row[field]
    mask = int(row.get("reasons", -1))
    if mask >= 0:
        reading["gpu_throttle_reasons"] = ",".join(n for b, n in THROTTLE_REASONS.items() if mask & b) or "none"
    return reading


def straggler_report(rows: list[dict], hosts: list[str], threshold: float) -> tuple[dict, str | None]:
    """Scores per rank from each rank's medians; the warning text when one is below `threshold`."""
    scores, basis = straggler_scores(rows)
    metrics: dict[str, float | str] = {}
    for rank, row in enumerate(rows):
        metrics[f"rank{rank}_score"] = scores[rank]
        for key in ("compute_s", "local_s", "wait_s", "data_wait_s"):
            if key in row:
                metrics[f"rank{rank}_{key}"] = row[key]
        for key in ("sm_clock_mhz", "power_w", "memory_gib"):
            if row.get(key, -1) >= 0:
                metrics[f"rank{rank}_{key}"] = row[key]
    metrics["straggler_score_min"] = min(scores)
    slow = [r for r, s in enumerate(scores) if s < threshold]
    if not slow:
        return metrics, None
    metrics["straggler_slowest_rank"] = min(slow, key=lambda r: scores[r])
    fastest = max(range(len(rows)), key=lambda r: scores[r])
    parts = []
    for rank in slow:
        row = rows[rank]
        text = f"rank {rank} ({hosts[rank]}) {1 / scores[rank]:.1f}x slower"
        text += "" if basis == "compute" else " in its forward matmuls"
        if row.get("sm_clock_mhz", -1) >= 0:
            fast_clock = rows[fastest].get("sm_clock_mhz", -1)
            text += f", SM {row['sm_clock_mhz']:.0f}" + (f"/{fast_clock:.0f} MHz" if fast_clock >= 0 else " MHz")
            text += f", {row['power_w']:.0f} W" if row.get("power_w", -1) >= 0 else ""
            mask = int(row.get("reasons", -1))
            if mask >= 0:
                limiting = set(reading_of(row)["gpu_throttle_reasons"].split(",")) & LIMITING_REASONS
                text += ", throttle flag set" if limiting else ", no throttle flag"
        parts.append(text)
    if basis == "compute":
        waits = [
            f"rank {r} waits {_secs(rows[r]['wait_s'])} of {_secs(rows[r]['step_s'])}"
            for r in range(len(rows))
            if r not in slow
        ]
        tail = "; " + ", ".join(waits) if waits else ""
    else:  # ZeRO / FSDP: the others' wait sits inside their collectives, not separable from their compute
        tail = f"; the other ranks wait for it inside the collectives (step {_secs(rows[fastest]['step_s'])})"
    return metrics, "; ".join(parts) + tail
