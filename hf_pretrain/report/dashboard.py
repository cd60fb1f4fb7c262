"""`render_report(run_dir)`: the run's telemetry as one PNG dashboard and an HTML page.

Reads `RUN_DIR/telemetry.jsonl` (written by `JsonlCallback`) and draws, against the optimizer step:
training and held-out loss with the learning rate on a second axis; tokens/s; MFU against spec and
against the measured ceiling (rates on axes from zero); SM clock, power, compute and wait time per
rank; memory; utilization beside power as a share of its limit; the downstream tasks' centered
accuracy (0 = chance) and bits per byte; goodput (where the wall time went, stacked: productive, restarts,
checkpoint stalls, evaluations, other; its summary line is a row of the page's table). Rates, memory and
utilization are drawn on axes from zero. The HTML page opens
with a summary table (`summary.py`). Warnings of the run
(straggler, under-clock, attention fallback) are merged into episodes (consecutive logs carrying
one), drawn as a line at their start and a shaded span over their length on every panel, and
listed in the HTML page, with the realised token share of each source of a data mixture (`telemetry/mixture.py`)
beside its target. A series the device never reported is drawn as
the word "unavailable", not as a line at 0; a panel of something the run did not ask for says so ("not run
(pass --downstream_tasks)"). Written with matplotlib's Agg backend (no display
needed); the HTML page embeds the PNG and the warnings, so it is one self-contained file.
"""

from __future__ import annotations

import base64
import html
import re
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from ..telemetry.jsonl import FILENAME, read_records  # noqa: E402
from .summary import DOWNSTREAM_NOT_RUN, summary_rows  # noqa: E402

WARNING_KEYS = (
    "straggler_warning",
    "underclock_warning",
    "attention_fallback",
    "mfu_spec_warning",
    "mfu_measured_warning",
)
PANELS = (
    ("loss", "loss (nats/token): training, held-out; learning rate (right)", [r"^loss$", r"^eval_loss$"]),
    ("throughput", "tokens / s (all ranks)", [r"^tokens_per_second$"]),
    ("mfu", "MFU", [r"^mfu_spec$", r"^mfu_measured$"]),
    ("clock", "SM clock (MHz)", [r"^rank\d+_sm_clock_mhz$", r"^gpu_sm_clock_mhz$", r"^gpu_sm_clock_max_mhz$"]),
    ("power", "power (W)", [r"^rank\d+_power_w$", r"^gpu_power_w$", r"^gpu_power_limit_w$"]),
    (
        "wait",
        "seconds per step",
        [r"^rank\d+_wait_s$", r"^rank\d+_compute_s$", r"^wait_s$", r"^compute_s$", r"^data_wait_s$"],
    ),
    (
        "memory",
        "memory (GiB)",
        [r"^rank\d+_memory_gib$", r"^gpu_memory_used_gib$", r"^torch_peak_memory_gib$", r"^process_rss_gib$"],
    ),
    (
        "utilization",
        "utilization and power / limit (%)",
        [r"^gpu_utilization_pct$", r"^gpu_power_of_limit_pct$", r"^cpu_utilization_pct$"],
    ),
    ("downstream", "downstream: centered accuracy (0 = chance, 1 = perfect)", [r"^downstream/([^/]+/)?centered$"]),
    ("downstream_bpb", "downstream: bits per byte of the gold answer", [r"^downstream/[^/]+/bpb$"]),
    ("goodput", "time spent (s, since the run began)", [r"^goodput_(wall|productive|restart|checkpoint|eval)_s$"]),
)
# Rates, amounts and shares from zero: a drop from 9,000 to 8,500 tokens/s, or memory at 0.78-0.88 GiB, must not fill
# the panel; the utilization panel is a share (0-100 %).
FROM_ZERO = ("throughput", "mfu", "memory", "utilization")
# What an empty panel says: nothing measured on this device, or nothing asked for.
NOT_RUN = {
    "downstream": DOWNSTREAM_NOT_RUN,
    "downstream_bpb": DOWNSTREAM_NOT_RUN,
    "goodput": "not logged (telemetry off)",
}
# The goodput panel: the wall time stacked by where it went (what none of the counters names is "other").
GOODPUT_PARTS = ("productive", "restart", "checkpoint", "eval")


def series(records: list[dict], pattern: str) -> dict[str, tuple[list[int], list[float]]]:
    """Numeric series of every key matching `pattern`: key -> (steps, values)."""
    out: dict[str, tuple[list[int], list[float]]] = {}
    for record in records:
        for key, value in record.items():
            if re.match(pattern, key) and isinstance(value, (int, float)) and not isinstance(value, bool):
                steps, values = out.setdefault(key, ([], []))
                steps.append(record["step"])
                values.append(value)
    return out


def warnings_of(records: list[dict]) -> list[tuple[int, str, str]]:
    return [(r["step"], key, r[key]) for r in records for key in WARNING_KEYS if isinstance(r.get(key), str)]


def episodes(records: list[dict]) -> list[tuple[int, int, str, str]]:
    """Warnings merged into episodes: (first step, last step, key, first text) of consecutive logs that carry one."""
    out: list[list] = []
    logged_steps = sorted({r["step"] for r in records})
    following = dict(zip(logged_steps, logged_steps[1:]))
    for step, key, text in warnings_of(records):
        same = [e for e in out if e[2] == key and following.get(e[1]) == step]
        if same:
            same[-1][1] = step
        else:
            out.append([step, step, key, text])
    return [tuple(e) for e in out]


def mixture_shares(records: list[dict]) -> tuple[int, dict[str, tuple[float, float]]]:
    """The last logged data mixture (`telemetry/mixture.py`): (step, source -> (realised share, target))."""
    for record in reversed(records):
        names = [k.split("/")[1] for k in record if k.startswith("mixture/") and k.endswith("/share")]
        if names:
            return record["step"], {n: (record[f"mixture/{n}/share"], record[f"mixture/{n}/target"]) for n in names}
    return 0, {}


def format_mixture(records: list[dict]) -> str:
    """One line: each source's realised token share and target at the last log, or "" without a mixture."""
    step, shares = mixture_shares(records)
    parts = [f"{name} {share:.3f} (target {target:.3f})" for name, (share, target) in shares.items()]
    return f"data mixture at step {step}: " + ", ".join(parts) if parts else ""


def render_report(run_dir: str | Path, out_dir: str | Path | None = None) -> tuple[Path, Path]:
    """Write `report.png` and `report.html` (into `out_dir`, default the run directory); say which lines of the
    stream were skipped (a line cut short when a run died is no record)."""
    run_dir = Path(run_dir)
    records, skipped = read_records(run_dir)
    if skipped:
        print(skipped_note(run_dir, skipped))
    if not records:
        raise FileNotFoundError(f"{run_dir}/telemetry.jsonl is missing or empty: run with telemetry=True first.")
    out = Path(out_dir or run_dir)
    out.mkdir(parents=True, exist_ok=True)
    for record in records:  # power as a share of the limit, on the utilization panel's scale
        if isinstance(record.get("gpu_power_of_limit"), (int, float)):
            record["gpu_power_of_limit_pct"] = 100 * record["gpu_power_of_limit"]
    spans = episodes(records)
    rows = (len(PANELS) + 1) // 2
    fig, axes = plt.subplots(rows, 2, figsize=(14, 3.5 * rows), sharex=True)
    for ax, (name, title, patterns) in zip(axes.flat, PANELS):
        drawn = {k: v for p in patterns for k, v in series(records, p).items()}
        if any(k.startswith("rank") for k in drawn):  # per-rank figures supersede this rank's own
            drawn = {k: v for k, v in drawn.items() if k.startswith("rank") or "limit" in k or "max" in k}
        if name == "goodput" and drawn:
            _stack_goodput(ax, records)
        else:
            for key, (steps, values) in sorted(drawn.items()):
                style = "--" if ("wait" in key or "limit" in key or "max" in key) else "-"
                aggregate = {"color": "black", "linewidth": 2.5} if key == "downstream/centered" else {"linewidth": 1.5}
                ax.plot(steps, values, style, marker="o", markersize=3, label=key, **aggregate)
        if drawn:
            ax.legend(fontsize=8, loc="best")
            ax.ticklabel_format(axis="y", useOffset=False, style="plain")
            _decorate(ax, name, records)
        else:
            empty = NOT_RUN.get(name, "unavailable on this device")
            ax.text(0.5, 0.5, empty, ha="center", va="center", transform=ax.transAxes, color="gray")
            ax.set_yticks([])
        for first, last, key, _ in spans:
            color = {"attention_fallback": "orange", "underclock_warning": "purple"}.get(key, "red")
            if last > first:
                ax.axvspan(first, last, color=color, alpha=0.12)
            ax.axvline(first, color=color, linestyle=":", linewidth=1.2)
            label = key.split("_")[0]
            ax.text(first, 0.98, label, transform=ax.get_xaxis_transform(), color=color, fontsize=7, va="top")
        ax.set_title(title, fontsize=11)
        ax.grid(alpha=0.3)
    for ax in axes.flat[len(PANELS) :]:
        ax.set_visible(False)
    for ax in axes[-1]:
        ax.set_xlabel("optimizer step")
    fig.suptitle(
        f"hf_pretrain run: {run_dir.resolve().name}  (dotted lines / shaded spans: warnings; red straggler, "
        "purple under-clock, orange attention fallback)",
        fontsize=12,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.98))  # room for the title
    png = out / "report.png"
    fig.savefig(png, dpi=90)
    plt.close(fig)
    page = out / "report.html"
    page.write_text(_html(run_dir, png, records, spans, skipped), encoding="utf-8")
    return png, page


def _stack_goodput(ax, records: list[dict]) -> None:
    """The wall time so far as stacked areas: productive, restarts, checkpoint stalls, evaluations, other."""
    logged = [r for r in records if isinstance(r.get("goodput_wall_s"), (int, float))]
    steps = [r["step"] for r in logged]
    parts = {k: [float(r.get(f"goodput_{k}_s") or 0.0) for r in logged] for k in GOODPUT_PARTS}
    wall = [float(r["goodput_wall_s"]) for r in logged]
    parts["other"] = [max(w - sum(p[i] for p in parts.values()), 0.0) for i, w in enumerate(wall)]
    colors = ("tab:green", "tab:red", "tab:orange", "tab:blue", "lightgray")
    ax.stackplot(steps, *parts.values(), labels=list(parts), colors=colors, alpha=0.8)
    ax.plot(steps, wall, "-", color="black", linewidth=1.2, label="wall")


def _decorate(ax, panel: str, records: list[dict]) -> None:
    if panel == "utilization":
        ax.set_ylim(0, 105)
    elif panel in FROM_ZERO:
        ax.set_ylim(bottom=0)
    elif panel == "downstream":
        ax.axhline(0, color="gray", linestyle=":", linewidth=1)
    elif panel == "loss" and (lr := series(records, r"^learning_rate$")):
        twin = ax.twinx()
        twin.plot(*lr["learning_rate"], ":", color="gray", linewidth=1.2, label="learning_rate")
        twin.set_ylim(bottom=0)
        twin.legend(fontsize=8, loc="upper center")


def _mixture_html(records: list[dict]) -> str:
    step, shares = mixture_shares(records)
    if not shares:
        return ""
    rows = "".join(
        f"<tr><td>{html.escape(n)}</td><td>{share:.3f}</td><td>{target:.3f}</td></tr>"
        for n, (share, target) in shares.items()
    )
    return (
        f"<h2>Data mixture (step {step})</h2><table><tr><th>source</th><th>realised token share</th>"
        f"<th>target</th></tr>{rows}</table>"
    )


def skipped_note(run_dir: Path, skipped: list[int]) -> str:
    lines = ", ".join(map(str, skipped[:5])) + (f" and {len(skipped) - 5} more" if len(skipped) > 5 else "")
    return (
        f"skipped {len(skipped)} line(s) of {run_dir / FILENAME} that are no record (line {lines}): a line cut "
        "short when the run died, or text that is not a JSON object with a step"
    )


def _html(
    run_dir: Path, png: Path, records: list[dict], spans: list[tuple[int, int, str, str]], skipped: list[int] = ()
) -> str:
    image = base64.b64encode(png.read_bytes()).decode()
    last = next((r for r in reversed(records) if "loss" in r), {})
    keys = ("loss", "tokens_per_second", "mfu_spec", "mfu_measured")
    summary = ", ".join(f"{k} {last[k]:.4g}" for k in keys if isinstance(last.get(k), (int, float))) or "none"
    items = (
        "".join(f"<li>steps {a}-{b}: <b>{html.escape(k)}</b>: {html.escape(t)}</li>" for a, b, k, t in spans)
        or "<li>none</li>"
    )
    table = "".join(
        f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in summary_rows(run_dir, records)
    )
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>hf_pretrain report: {html.escape(run_dir.name)}</title>"
        "<style>body{font-family:sans-serif;max-width:1300px;margin:auto}li{margin:4px 0}th{text-align:left;"
        "padding-right:16px}</style></head><body>"
        f"<h1>{html.escape(run_dir.name)}</h1><table>{table}</table><p>last training log: {html.escape(summary)}</p>"
        + (f"<p>{html.escape(skipped_note(run_dir, list(skipped)))}</p>" if skipped else "")
        + f"<h2>Warnings</h2><ul>{items}</ul>{_mixture_html(records)}<img alt='dashboard' style='width:100%' src='data:image/png;base64,{image}'>"
        "</body></html>"
    )
