"""Attention preflight: which kernel each layer type runs, whether it wastes work, and what that costs.

The failure this exists for: FlashAttention is missing, the run falls back to SDPA, window layers
become dense masks, and a week runs at a fraction of the chip's speed while the one warning
scrolled past at step 0. `attention_preflight` prices every layer type's kernel against the best
kernel this hardware could run (`modeling.attention.best_backend`) with the FLOPs model of
`modeling.accounting` (a dense kernel does T keys per query, an exact window kernel
mean(min(i + 1, W))), so the cost is stated in step time, not only in attention. A 512 window at
2048 context on a dense mask does ~4.6x the attention work of an exact window kernel.

`enforce_attention_policy` applies `attn_fallback`: `warn` (print the table and the warning,
which `PretrainTrainer` repeats in its first logged metrics), `error` (refuse to start, saying how
to install the missing kernel or which `window_pattern` avoids the cost), `ignore`. The report is
written to `preflight.json` in the output directory in every case.
"""

from __future__ import annotations

import json
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..modeling.accounting import attention_flops_per_token, flops_per_token, mean_keys_per_query
from ..modeling.attention import Choice, Environment, LayerNeed, best_backend, layer_needs, plan_attention

POLICIES = ("warn", "error", "ignore")
INSTALL_HINTS = {
    "flash_attention_3": "install FlashAttention 3 (the `flash_attn_interface` module, built from flash-attention's hopper/ directory)",
    "flash_attention_2": "pip install flash-attn --no-build-isolation (or `pip install hf_pretrain[gpu]`)",
    "flex_attention": "upgrade torch to >= 2.5 for torch.nn.attention.flex_attention",
}


class AttentionFallbackError(RuntimeError):
    """Raised by `attn_fallback="error"` when a layer type runs on a slower kernel than the hardware allows."""


def keys_per_query(choice_efficient: bool, need: LayerNeed, seq_len: int) -> float:
    """Keys a kernel computes per query: exact for an efficient kernel, all T for a dense one."""
    return mean_keys_per_query(seq_len, need.window) if choice_efficient else float(seq_len)


@dataclass
class AttentionRow:
    layer_type: str
    label: str
    layers: int
    needs: str
    backend: str
    exact: bool
    efficient: bool
    reason: str
    best_backend: str
    attention_work_vs_best: float
    passed_over: dict[str, str] = field(default_factory=dict)


@dataclass
class AttentionReport:
    device: str
    dtype: str
    training: bool
    packed: bool
    seq_len: int
    capability: tuple[int, int] | None
    kernel_versions: dict[str, str | None]
    torch_version: str
    rows: list[AttentionRow]
    attention_share: float  # of the step's FLOPs, with the chosen kernels
    step_cost_vs_best: float  # estimated step time, chosen kernels / best kernels
    warnings: list[str]

    def to_dict(self) -> dict:
        return asdict(self)

    def table(self) -> str:
        cap = f", capability {self.capability[0]}.{self.capability[1]}" if self.capability else ""
        head = (
            f"attention preflight: {self.device}{cap}, {self.dtype}, {'training' if self.training else 'inference'}, "
            f"context {self.seq_len}{', packed documents' if self.packed else ''}"
        )
        cols = ("layers", "needs", "backend", "exact", "efficient", "best here", "attn work vs best")
        cells = [
            (
                f"{r.layers} x {r.label}",
                r.needs,
                r.backend,
                "yes" if r.exact else "no",
                "yes" if r.efficient else "no",
                r.best_backend,
                f"{r.attention_work_vs_best:.2f}x",
            )
            for r in self.rows
        ]
        widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
        lines = [head] + ["  " + " | ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip() for row in [cols, *cells]]
        lines.append(
            f"  attention is {self.attention_share:.0%} of the step's FLOPs; estimated step time vs the best kernels "
            f"here: {self.step_cost_vs_best:.2f}x"
        )
        kernels = ", ".join(f"{k} {v or 'not installed'}" for k, v in self.kernel_versions.items())
        lines.append(f"  kernels: {kernels}; torch {self.torch_version}")
        lines += [f"  {r.label}: {r.backend}, {r.reason}" for r in self.rows]
        lines += [f"  WARNING: {w}" for w in self.warnings]
        return "\n".join(lines)


def _needs_text(need: LayerNeed, seq_len: int) -> str:
    parts = ["causal" if need.window is None else f"window {need.window} of {seq_len}"]
    return ", ".join(parts + (["packed docs"] if need.packed else []))


def attention_preflight(
    config, seq_len: int, env: Environment, packed: bool, plan: dict[str, Choice] | None = None
) -> AttentionReport:
    """The kernel of every layer type on `env`, against the best this hardware could run.

    `plan`: the kernels that will run (`plan_attention(config, env, packed)`, which the trainer computes once
    and pins on the model); planned here when not given (`hf-pretrain doctor`)."""
    needs = layer_needs(config, packed)
    plan = plan or plan_attention(config, env, packed)
    best = {t: best_backend(need, env) for t, need in needs.items()}
    chosen_keys = [keys_per_query(plan[t].efficient, needs[t], seq_len) for t in config.layer_types]
    best_keys = [keys_per_query(best[t].efficient, needs[t], seq_len) for t in config.layer_types]
    step_chosen = flops_per_token(config, seq_len, chosen_keys)
    step_best = flops_per_token(config, seq_len, best_keys)
    rows, warnings = [], []
    for t, need in needs.items():
        choice, ideal = plan[t], best[t]
        work = keys_per_query(choice.efficient, need, seq_len) / keys_per_query(ideal.efficient, need, seq_len)
        rows.append(
            AttentionRow(
                t,
                need.label,
                config.layer_types.count(t),
                _needs_text(need, seq_len),
                choice.backend,
                choice.exact,
                choice.efficient,
                choice.reason,
                ideal.backend,
                work,
                dict(choice.passed_over),
            )
        )
        if choice.backend != ideal.backend:
            warnings.append(_fallback_warning(need, choice, ideal, work, step_chosen / step_best, config))
        elif not choice.efficient and need.window is not None:
            dense = seq_len / mean_keys_per_query(seq_len, need.window)
            rows[
                -1
            ].reason += f"; no sparse kernel trains on {env.device}: the dense mask does {dense:.1f}x the window's work"
    return AttentionReport(
        env.device,
        str(env.dtype).removeprefix("torch."),
        env.training,
        packed,
        seq_len,
        env.capability,
        dict(env.kernel_versions),
        torch.__version__.split("+")[0],
        rows,
        attention_flops_per_token(config, seq_len, chosen_keys) / step_chosen,
        step_chosen / step_best,
        warnings,
    )


def _fallback_warning(need: LayerNeed, choice: Choice, ideal: Choice, work: float, step: float, config) -> str:
    missing = ideal.backend if ideal.backend in choice.passed_over else None
    why = f"{missing}: {choice.passed_over[missing]}" if missing else "it was requested"
    cost = (
        f"{work:.1f}x the attention work, estimated {step:.2f}x the step time"
        if work > 1
        else "the same FLOPs on a slower kernel (measure with benchmarks/attention.py)"
    )
    fixes = [INSTALL_HINTS[missing]] if missing in INSTALL_HINTS else []
    if config.attention_backend != "auto":
        fixes.append("set attention_backend='auto'")
    if need.window is not None and work > 1:
        fixes.append("or window_pattern='L' (no windows) to avoid the dense-mask cost")
    return (
        f"{need.label} layers run on {choice.backend} instead of {ideal.backend} ({why}): {cost}. "
        f"Fix: {'; '.join(fixes) or 'see the table'}."
    )


def enforce_attention_policy(
    report: AttentionReport, policy: str, output_dir: str | Path | None = None, run: dict | None = None
) -> None:
    """Write `preflight.json` (with `run`: more of what the run was started with, e.g. its precision), then warn
    (print), raise `AttentionFallbackError`, or stay quiet."""
    if policy not in POLICIES:
        raise ValueError(f"attn_fallback={policy!r} is invalid; use one of {list(POLICIES)}.")
    if output_dir is not None:
        path = Path(output_dir) / "preflight.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        written = {"attention": report.to_dict(), "host": platform.node(), **(run or {})}
        path.write_text(json.dumps(written, indent=2))
    if policy == "error" and report.warnings:
        raise AttentionFallbackError("attention preflight failed (attn_fallback='error'):\n" + report.table())
    if policy == "warn":
        print(report.table(), flush=True)
