"""`hf-pretrain trial`: a short side-by-side run of precision recipes that picks one.

Newer is not faster: on one pair of machines PyTorch-native FP8 took 3.149 s/step and 51.9 GiB
against Transformer Engine FP8's 3.967 s and 73.3 GiB, and NVFP4 saved 7 % memory but ran 7 %
slower. `run_trial` trains the same config on the same data and seed for `steps` optimizer steps
under each recipe, each in a fresh Python process (no kernel cache, allocator state or compiled
graph leaks from one recipe into the next), and reports per recipe: median and 10th-90th
percentile step time over the steps after `warmup_steps`, tokens/s, peak memory (the CUDA
allocator's peak on a GPU, the process's peak RSS on a CPU), MFU against spec and measured
ceiling, mean power where the GPU exposes it, the final loss, and whether the recipe ran
`emulated` (no native kernels on this device: fp8 off fp8 tensor cores, bf16 on a CPU without
bf16 instructions; `precision.recipes.emulated`).

Step times are `ThroughputCallback`'s `step_time_s`: CUDA events from step begin to step end on a
GPU (the optimizer included; the device's own time, not the host's kernel-enqueue time), the host
clock on a CPU. The final loss is the mean of the last `loss_window` (5) logged losses: one step's
loss is noise at the 0.05-nat scale the recipes are compared on. The packed blocks separate
documents by the trial tokenizer's own EOS id.

The recommendation is the fastest *native* recipe whose final loss is within `loss_tolerance`
nats of the best native one: an emulated recipe is timed on kernels it will not run on, so it is
recommended only when no native recipe ran. A recipe that cannot run here is listed with the
reason, never dropped. `trial.json` and `trial.md` are written to the output directory.

N steps rank the recipes; they do not predict the hours a full run saves (warm-up, data, restarts
and checkpointing are not in them). For torchao's fp8, compile (`--torch-compile`) is what makes
it fast on a GPU; rank compiled recipes against compiled ones.
"""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

CAVEAT = "N steps rank the recipes; they do not predict the hours a full run saves."
COLUMNS = (
    "recipe",
    "status",
    "reason",
    "median_step_s",
    "step_s_p10",
    "step_s_p90",
    "tokens_per_second",
    "peak_memory_gib",
    "memory_kind",
    "mfu_spec",
    "mfu_spec_warning",
    "mfu_measured",
    "mean_power_w",
    "final_loss",
    "emulated",
    "step_time_vs_first",
    "memory_vs_first",
)


@dataclass
class TrialSpec:
    config: str
    recipe: str
    steps: int
    warmup_steps: int
    seq_len: int
    batch_size: int
    seed: int
    data_dir: str
    out_dir: str
    eos_token_id: int
    torch_compile: bool = False
    loss_window: int = 5


def prepare_trial_data(config, out_dir: Path, seq_len: int) -> tuple[Path, int]:
    """Packed blocks of the embedded corpus with a BPE sized for the config, shared by every recipe; and its EOS id.

    The data chain of `hf-pretrain data prepare` (`run_pipeline`) without clean and dedup: the recipes are
    compared on the same blocks, whatever they hold."""
    from transformers import AutoTokenizer

    from .data.chain import run_pipeline
    from .data.corpus import write_embedded_corpus
    from .data.pipeline_config import PipelineConfig
    from .data.prepared import packed_path, tokenizer_path

    data_dir = out_dir / "data"
    corpus = write_embedded_corpus(data_dir / "corpus")
    prepared = data_dir / "prepared"
    pipeline = PipelineConfig(
        input=str(corpus["train"].parent),
        output_dir=str(prepared),
        heldout_fraction=0.05,
        clean=None,
        dedup=None,
        tokenizer={"vocab_size": min(config.vocab_size, 8192)},
        pack={"seq_len": seq_len, "mode": "concat"},
    )
    run_pipeline(pipeline, verbose=False)
    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path(prepared)))
    return packed_path(prepared, "train"), tokenizer.eos_token_id


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def final_loss(losses: list[float], window: int) -> float:
    """The mean of the last `window` logged losses (all of them when fewer were logged)."""
    if not losses:
        raise ValueError("no loss was logged: the recipe trained no step")
    return statistics.fmean(losses[-window:])


def repeat_to(data, rows: int):
    """`data` cycled up to `rows` rows when it has fewer (a long context leaves few blocks of a small corpus)."""
    return data.select([i % len(data) for i in range(rows)]) if len(data) < rows else data


def run_worker(spec: TrialSpec) -> dict:
    """Train one recipe (in this process) and return its row."""
    from .data import PackedDocumentCollator
    from .data.prepared import load_split
    from .modeling import PretrainForCausalLM
    from .precision.recipes import emulated
    from .presets import load_config
    from .telemetry.jsonl import read_jsonl
    from .training import PretrainingArguments, PretrainTrainer

    torch.manual_seed(spec.seed)
    config = load_config(spec.config)
    config.max_position_embeddings = max(config.max_position_embeddings, spec.seq_len)
    data = load_split(Path(spec.data_dir))
    needed = spec.batch_size * (spec.steps + 1)
    data = repeat_to(data, needed)
    args = PretrainingArguments(
        output_dir=spec.out_dir,
        max_steps=spec.steps,
        per_device_train_batch_size=spec.batch_size,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        seed=spec.seed,
        precision=spec.recipe,
        disable_tqdm=True,
        attn_fallback="ignore",
        dataloader_num_workers=0,
        torch_compile=spec.torch_compile,
    )
    trainer = PretrainTrainer(
        model=PretrainForCausalLM(config),
        args=args,
        train_dataset=data,
        data_collator=PackedDocumentCollator(spec.eos_token_id),
    )
    trainer.train()
    records = read_jsonl(spec.out_dir)
    logs = [h for h in records if "loss" in h]  # measured values are not in state.log_history
    withheld = next((h["mfu_spec_warning"] for h in records if "mfu_spec_warning" in h), None)
    measured = [h for h in logs if h["step"] > spec.warmup_steps] or logs
    steps = [h["step_time_s"] for h in measured if "step_time_s" in h]
    mean = lambda key: statistics.fmean(v) if (v := [h[key] for h in measured if key in h]) else None  # noqa: E731
    on_gpu = torch.cuda.is_available() and args.device.type == "cuda"
    if on_gpu:
        torch.cuda.synchronize()
    peak = (
        torch.cuda.max_memory_allocated() / 2**30
        if on_gpu
        else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    )
    median = statistics.median(steps)
    emulation = emulated(spec.recipe, args.device)
    return {
        "recipe": spec.recipe,
        "status": "ok",
        "reason": f"emulated: {emulation}" if emulation else "",
        "median_step_s": median,
        "step_s_p10": _percentile(steps, 0.1),
        "step_s_p90": _percentile(steps, 0.9),
        "tokens_per_second": spec.batch_size * spec.seq_len * args.world_size / median,
        "peak_memory_gib": peak,
        "memory_kind": "CUDA allocator peak" if on_gpu else "process peak RSS",
        "mfu_spec": mean("mfu_spec"),
        "mfu_spec_warning": withheld,  # why an MFU above 1 was withheld (a peak or a timing that is wrong)
        "mfu_measured": mean("mfu_measured"),
        "mean_power_w": mean("gpu_power_w"),
        "final_loss": final_loss([h["loss"] for h in logs], spec.loss_window),
        "emulated": emulation is not None,
    }


def run_trial(
    config: str,
    recipes: list[str],
    steps: int = 30,
    warmup_steps: int = 5,
    seq_len: int | None = None,
    batch_size: int = 8,
    out_dir: str | Path = "trial",
    loss_tolerance: float = 0.05,
    seed: int = 0,
    torch_compile: bool = False,
    timeout_s: float = 3600,
    loss_window: int = 5,
) -> dict:
    """Run every recipe in a fresh process; write trial.json / trial.md; return the result dict."""
    from .precision.recipes import RECIPES, why_unavailable
    from .presets import load_config

    if warmup_steps >= steps:
        raise ValueError(f"warmup_steps={warmup_steps} is invalid: it must be below steps={steps}.")
    if not 1 <= loss_window <= steps:
        raise ValueError(f"loss_window={loss_window} is invalid: average between 1 and steps={steps} losses.")
    unknown = [r for r in recipes if r not in RECIPES]
    if unknown:
        raise ValueError(f"recipes={unknown} are unknown; use any of {list(RECIPES)}.")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    seq_len = seq_len or load_config(config).max_position_embeddings  # the real config's context by default
    data_dir, eos_token_id = prepare_trial_data(load_config(config), out, seq_len)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    for recipe in recipes:
        reason = why_unavailable(recipe, device)
        if reason:
            rows.append({"recipe": recipe, "status": "unavailable", "reason": reason})
            continue
        spec = TrialSpec(
            config,
            recipe,
            steps,
            warmup_steps,
            seq_len,
            batch_size,
            seed,
            str(data_dir),
            str(out / recipe),
            eos_token_id,
            torch_compile,
            loss_window,
        )
        rows.append(_run_in_fresh_process(spec, out / f"{recipe}.json", timeout_s))
    result = summarize(rows, steps, warmup_steps, loss_tolerance, loss_window)
    (out / "trial.json").write_text(json.dumps(result, indent=2))
    (out / "trial.md").write_text(to_markdown(result))
    return result


def _run_in_fresh_process(spec: TrialSpec, result_path: Path, timeout_s: float) -> dict:
    """One recipe in a new interpreter on one device; its output goes to RECIPE.log beside the result."""
    cmd = [sys.executable, "-m", "hf_pretrain.trial", json.dumps(asdict(spec)), str(result_path)]
    env = dict(os.environ)
    if torch.cuda.device_count() > 1:  # one device: the Trainer would otherwise wrap the model in DataParallel
        env["CUDA_VISIBLE_DEVICES"] = env.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
    log = result_path.with_suffix(".log")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout_s)
    except subprocess.TimeoutExpired as err:
        log.write_text(f"{err.stdout or ''}\n{err.stderr or ''}")
        return {"recipe": spec.recipe, "status": "failed", "reason": f"timed out after {timeout_s:.0f} s (see {log})"}
    log.write_text(proc.stdout + "\n" + proc.stderr)
    if proc.returncode != 0 or not result_path.exists():
        cause = f"killed by signal {-proc.returncode}" if proc.returncode < 0 else f"exit {proc.returncode}"
        errors = [line for line in proc.stderr.splitlines() if "Error" in line] or proc.stderr.strip().splitlines()[-1:]
        return {
            "recipe": spec.recipe,
            "status": "failed",
            "reason": f"{cause}: {(errors or ['no output'])[-1][:300]} (see {log})",
        }
    return json.loads(result_path.read_text())


def summarize(rows: list[dict], steps: int, warmup_steps: int, loss_tolerance: float, loss_window: int = 5) -> dict:
    """Ratios against the first recipe that ran, and the recommendation (a native recipe whenever one ran)."""
    ok = [r for r in rows if r["status"] == "ok"]
    full = [{c: r.get(c) for c in COLUMNS} for r in rows]
    recommendation = None
    if ok:
        first = ok[0]
        for row in full:
            if row["status"] == "ok":
                row["step_time_vs_first"] = row["median_step_s"] / first["median_step_s"]
                row["memory_vs_first"] = row["peak_memory_gib"] / first["peak_memory_gib"]
        pool = [r for r in ok if not r.get("emulated")] or ok  # emulated only when nothing native ran
        best_loss = min(r["final_loss"] for r in pool)
        close = [r for r in pool if r["final_loss"] <= best_loss + loss_tolerance]
        recommendation = min(close, key=lambda r: r["median_step_s"])["recipe"]
    return {
        "steps": steps,
        "warmup_steps": warmup_steps,
        "loss_tolerance": loss_tolerance,
        "loss_window": loss_window,
        "rows": full,
        "recommendation": recommendation,
        "note": CAVEAT,
    }


def _fmt(value, digits: int = 3) -> str:
    if value is None:
        return "n/a"
    return f"{value:.{digits}g}" if isinstance(value, float) else str(value)


def to_markdown(result: dict) -> str:
    head = [
        "recipe",
        "median s/step (p10-p90)",
        "tokens/s",
        "peak memory GiB",
        "MFU spec / measured",
        "power W",
        "final loss",
        "time vs first",
        "memory vs first",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in result["rows"]:
        if r["status"] != "ok":
            lines.append(f"| {r['recipe']} | {r['status']}: {r['reason']} |" + " |" * (len(head) - 2))
            continue
        lines.append(
            "| "
            + " | ".join(
                [
                    r["recipe"] + (" (emulated)" if r.get("emulated") else ""),
                    f"{_fmt(r['median_step_s'])} ({_fmt(r['step_s_p10'])}-{_fmt(r['step_s_p90'])})",
                    f"{r['tokens_per_second']:,.0f}",
                    f"{_fmt(r['peak_memory_gib'])} ({r['memory_kind']})",
                    f"{_fmt(r['mfu_spec'])} / {_fmt(r['mfu_measured'])}",
                    _fmt(r["mean_power_w"]),
                    _fmt(r["final_loss"], 4),
                    f"{r['step_time_vs_first']:.2f}x",
                    f"{r['memory_vs_first']:.2f}x",
                ]
            )
            + " |"
        )
    steps = f"{result['steps']} steps, the first {result['warmup_steps']} not timed"
    recommendation = result["recommendation"] or "none (no recipe ran)"
    return "\n".join(
        [
            f"# Precision trial ({steps})",
            "",
            *lines,
            "",
            f"Recommendation: **{recommendation}** (the fastest native recipe whose final loss, the mean of the last "
            f"{result.get('loss_window', 5)} logged, is within {result['loss_tolerance']} nats of the best native one).",
            *(
                [f"Emulated here (their times are not the device's): {', '.join(emulated_rows)}."]
                if (emulated_rows := [r["recipe"] for r in result["rows"] if r.get("emulated")])
                else []
            ),
            "",
            result["note"],
            "",
        ]
    )


if __name__ == "__main__":  # the fresh process of one recipe: python -m hf_pretrain.trial SPEC_JSON OUT
    row = run_worker(TrialSpec(**json.loads(sys.argv[1])))
    Path(sys.argv[2]).write_text(json.dumps(row))
