"""One-shot GPU check: the figures hf_pretrain claims on GPUs, measured in one run of at most ~8 minutes.

    python benchmarks/gpu_check.py                  # on a CUDA GPU: writes gpu_check.json, prints the table
    python benchmarks/gpu_check.py --dry-run        # the same code on tiny configs on a CPU (< 2 minutes)
    python benchmarks/gpu_check.py --only mfu_bf16,straggler_2proc

Each check has a goal and ends `pass`, `fail`, `ran` (a dry run, or a device that cannot judge the
goal: the figure is printed, not judged), `skipped: <why>` (a package or a capability is missing:
"skipped: torchao not installed"), or `error: <what>` (with the traceback's end in the JSON).

| check | what runs | goal (on a GPU) |
|---|---|---|
| `mfu_bf16` | `PretrainTrainer`, bf16, the `0.9b` preset (~0.9 B) on packed rows of 2048 tokens; MFU from its own `ThroughputCallback` logs | `mfu_spec` >= 0.50 |
| `fp8_vs_bf16` | the `1.4b` preset, seq 2048, decoder layers compiled, bf16 autocast vs torchao fp8 linears; tokens/s from CUDA events | fp8 / bf16 >= 1.25 |
| `flex_vs_sdpa` | one sliding-window attention layer (the `0.9b` preset's W = 1024, seq 2048), forward + backward: flex (block-sparse window) vs SDPA with the dense window mask | SDPA time / flex time >= 2 |
| `packed_equality` | packed rows of several documents vs each document alone, on `sdpa` and `flex_attention`, in the device dtype | max abs logit diff <= 2 % of the logits' range (bf16), 1e-4 (fp32) |
| `memory_estimate` | one fp32 training step of the `1.4b` preset (seq 2048, batch 2, fused AdamW) | `estimate_memory` within +-10 % of `torch.cuda.max_memory_allocated` |
| `step_time_events` | `ThroughputCallback`'s `step_time_s` (CUDA events) around bf16 steps vs the synchronised wall time and the host's enqueue time | events within 5 % of the synchronised wall time |
| `straggler_2proc` | `PretrainTrainer`, 2 processes on the one GPU (DDP over gloo), rank 1 slowed on the device (`torch.cuda._sleep`, tests/training/faults.py `slow_down_rank`) | the straggler rule names rank 1 |

Packages: `mfu_bf16` and `straggler_2proc` need `datasets` (`PretrainTrainer` imports the data
chain), `fp8_vs_bf16` needs `torchao`; nothing here imports `datasets` or `torchao` at module
import time, and a missing one skips only the checks that need it. hf_pretrain is imported from
this checkout (the parent folder) when it is not installed. transformers older than setup.cfg's
floor is tried anyway and named in the env row and in any error. docs/benchmarks.md says which
wheels to carry to a GPU machine without network.
"""

from __future__ import annotations

import argparse
import gc
import importlib.metadata
import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # the checkout travels without being installed; benchmarks/ and tests/ import from it
    sys.path.insert(0, str(ROOT))

TRANSFORMERS_FLOOR = (5, 24)
EOS = 2


class Skip(Exception):
    """A check that cannot run here; the message says why ("torchao not installed")."""


@dataclass
class Sizes:
    """The shapes of one run: the GPU check's, or the dry run's tiny ones."""

    mfu_preset: str = "0.9b"
    mfu_seq: int = 2048
    mfu_batch: int = 8
    mfu_steps: int = 12
    fp8_preset: str = "1.4b"
    fp8_seq: int = 2048
    fp8_batch: int = 8
    fp8_steps: int = 12
    attn_seq: int = 2048
    attn_window: int = 1024
    attn_heads: int = 16
    attn_head_dim: int = 128
    attn_batch: int = 4
    memory_preset: str = "1.4b"
    memory_seq: int = 2048
    memory_batch: int = 2
    events_preset: str = "1.4b"
    events_seq: int = 2048
    events_batch: int = 4
    events_steps: int = 6
    straggler_preset: str = "gpt2-124m"
    straggler_seq: int = 512
    straggler_batch: int = 4
    straggler_steps: int = 12
    straggler_sleep_s: float = 0.05
    packed_backends: tuple[str, ...] = ("sdpa", "flex_attention")
    compile: bool = True
    warmup: int = 3


DRY = Sizes(
    mfu_preset="tiny",
    mfu_seq=128,
    mfu_batch=2,
    mfu_steps=4,
    fp8_preset="tiny",
    fp8_seq=64,
    fp8_batch=2,
    fp8_steps=3,
    attn_seq=128,
    attn_window=32,
    attn_heads=2,
    attn_head_dim=16,
    attn_batch=1,
    memory_preset="tiny",
    memory_seq=64,
    memory_batch=2,
    events_preset="tiny",
    events_seq=64,
    events_batch=2,
    events_steps=3,
    straggler_preset="tiny",
    straggler_seq=64,
    straggler_batch=2,
    straggler_steps=4,
    straggler_sleep_s=0.1,
    packed_backends=("sdpa",),  # flex compiles C++ kernels on a CPU (minutes); its CPU test: test_packed_documents
    compile=False,
    warmup=2,
)


@dataclass
class Context:
    device: torch.device
    sizes: Sizes
    dry_run: bool
    workdir: Path

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    @property
    def dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.cuda else torch.float32

    def judge(self, ok: bool) -> bool | None:
        """A goal is judged on a GPU only: on a dry run the figure is printed, not passed or failed."""
        return None if self.dry_run or not self.cuda else bool(ok)


# ---- helpers ---------------------------------------------------------------------------------


def version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def missing(package: str, why: str = "") -> str | None:
    """Why a check cannot run without `package`, or None when it is installed."""
    if importlib.util.find_spec(package) is not None:
        return None
    return f"{package} not installed" + (f" ({why})" if why else "")


def transformers_too_old() -> bool:
    found = version("transformers") or "0"
    return tuple(int(p) for p in found.split(".")[:2] if p.isdigit()) < TRANSFORMERS_FLOOR


def transformers_note() -> str:
    floor = ".".join(map(str, TRANSFORMERS_FLOOR))
    return f"transformers {version('transformers')}" + (
        f" (hf_pretrain needs >= {floor})" if transformers_too_old() else ""
    )


def old_transformers() -> str | None:
    """hf_pretrain's model calls transformers' `create_causal_mask(cache=...)`, which 5.24 introduced."""
    return f"{transformers_note()}: the model calls create_causal_mask(cache=...)" if transformers_too_old() else None


def trainer_missing() -> str | None:
    return missing("datasets", "PretrainTrainer imports hf_pretrain.data, which reads with datasets")


def require(*reasons: str | None) -> None:
    """Skip the check, naming everything it lacks here."""
    lacking = [r for r in reasons if r]
    if lacking:
        raise Skip("; ".join(lacking) + ": carry the wheels, docs/benchmarks.md")


def collator_module():
    """hf_pretrain/data/collator.py on its own: importing `hf_pretrain.data` would import `datasets`."""
    spec = importlib.util.spec_from_file_location("hf_pretrain_collator", ROOT / "hf_pretrain" / "data" / "collator.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (its dataclass looks itself up there)
    spec.loader.exec_module(module)
    return module


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def packed_rows(vocab: int, seq: int, rows: int, seed: int = 0) -> list[dict]:
    """Rows of `seq` tokens holding documents of 64..seq/2 tokens, each ended by EOS (packed pretraining data)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(rows):
        ids = torch.randint(3, vocab, (seq,), generator=g)
        pos = 0
        while pos < seq:
            pos += int(torch.randint(min(64, seq // 4), max(seq // 2, 2), (1,), generator=g))
            if pos < seq:
                ids[pos] = EOS
        out.append({"input_ids": ids.tolist()})
    return out


def timed_steps(model, optimizer, ids, steps: int, dtype: torch.dtype, device: torch.device) -> list[float]:
    """Seconds of each training step (forward, backward, optimizer) on the device's clock, read after the loop."""
    from hf_pretrain.telemetry.timing import DeviceClock, PendingIntervals

    clock = DeviceClock(device)
    pending = PendingIntervals(clock, limit=steps + 1)
    for _ in range(steps):
        start = clock.mark()
        with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        pending.push({"step": (start, clock.mark())})
    sync(device)
    return [r["step"] for r in pending.pop_done()]


def train_args(ctx: Context, out: Path, **overrides):
    from hf_pretrain import PretrainingArguments

    defaults = dict(
        output_dir=str(out),
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        logging_steps=1,
        dataloader_num_workers=0,
        seed=0,
        bf16=ctx.cuda,
        attn_fallback="ignore",
        use_cpu=not ctx.cuda,
    )
    return PretrainingArguments(**{**defaults, **overrides})


# ---- the checks ------------------------------------------------------------------------------


def check_env(ctx: Context) -> dict:
    name = torch.cuda.get_device_name(ctx.device) if ctx.cuda else "cpu (dry run)" if ctx.dry_run else "cpu"
    capability = ".".join(map(str, torch.cuda.get_device_capability(ctx.device))) if ctx.cuda else None
    packages = {p: version(p) for p in ("datasets", "torchao", "flash-attn", "transformer-engine", "deepspeed")}
    missing = [p for p, v in packages.items() if v is None]
    text = f"{name}" + (f" (sm {capability})" if capability else "") + f", torch {torch.__version__}"
    text += f", CUDA {torch.version.cuda}" if torch.version.cuda else ""
    text += f", {transformers_note()}" + (f"; not installed: {', '.join(missing)}" if missing else "")
    return {"result": text, "value": None, "pass": None, "details": {"packages": packages, "capability": capability}}


def check_mfu_bf16(ctx: Context) -> dict:
    require(old_transformers(), trainer_missing())
    from transformers import PrinterCallback

    from hf_pretrain import PretrainForCausalLM, PretrainTrainer, get_preset
    from hf_pretrain.data.collator import PackedDocumentCollator

    s = ctx.sizes
    config = get_preset(s.mfu_preset, max_position_embeddings=s.mfu_seq)
    data = packed_rows(config.vocab_size, s.mfu_seq, s.mfu_batch * (s.mfu_steps + 1))
    args = train_args(ctx, ctx.workdir / "mfu", max_steps=s.mfu_steps, per_device_train_batch_size=s.mfu_batch)
    torch.manual_seed(0)
    trainer = PretrainTrainer(
        model=PretrainForCausalLM(config), args=args, train_dataset=data, data_collator=PackedDocumentCollator(EOS)
    )
    trainer.remove_callback(PrinterCallback)  # the table below is the output, not one dict per step
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h and h["step"] > s.warmup]
    median = lambda key: statistics.median(v) if (v := [h[key] for h in logs if key in h]) else None  # noqa: E731
    mfu_spec, mfu_measured, step = median("mfu_spec"), median("mfu_measured"), median("step_time_s")
    tokens = median("tokens_per_second")
    kernels = {kind: choice.backend for kind, choice in (trainer.model.attention_plan or {}).items()}
    del trainer
    free_memory()
    text = f"mfu_spec {mfu_spec:.3f}" if mfu_spec is not None else "mfu_spec unavailable (no spec peak for this chip)"
    text += f", mfu_measured {mfu_measured:.3f}" if mfu_measured is not None else ""
    text += f", {tokens:,.0f} tokens/s, {step:.3f} s/step" if tokens and step else ""
    text += f", attention {kernels}"
    judged = None if mfu_spec is None else ctx.judge(mfu_spec >= 0.5)  # no spec peak (a CPU): nothing to judge
    return {"result": text, "value": mfu_spec, "pass": judged, "details": {"logs": logs[-3:], "kernels": kernels}}


def check_fp8_vs_bf16(ctx: Context) -> dict:
    require(old_transformers(), missing("torchao", "the fp8 recipe is torchao's float8 training"))
    from hf_pretrain import PretrainForCausalLM, get_preset
    from hf_pretrain.chips import spec_tflops
    from hf_pretrain.modeling.accounting import flops_per_token
    from hf_pretrain.precision import apply_precision
    from hf_pretrain.precision.recipes import emulated
    from hf_pretrain.telemetry.peaks import device_name

    s = ctx.sizes
    config = get_preset(s.fp8_preset, max_position_embeddings=s.fp8_seq)
    ids = torch.randint(3, config.vocab_size, (s.fp8_batch, s.fp8_seq), device=ctx.device)
    rates, notes = {}, []
    for recipe in ("bf16", "fp8"):
        torch.manual_seed(0)
        model = PretrainForCausalLM(config).to(ctx.device).train()
        if recipe == "fp8":
            apply_precision(model, "fp8", device=ctx.device)
        if s.compile:
            for layer in model.model.layers:  # regional compilation: one block's graph, reused by every layer
                layer.compile()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=ctx.cuda)
        times = timed_steps(model, optimizer, ids, s.fp8_steps, ctx.dtype, ctx.device)[s.warmup :]
        rates[recipe] = s.fp8_batch * s.fp8_seq / statistics.median(times)
        del model, optimizer
        free_memory()
    ratio = rates["fp8"] / rates["bf16"]
    spec = spec_tflops(device_name(ctx.device), "bf16") if ctx.cuda else None
    mfu = flops_per_token(config, s.fp8_seq) * rates["bf16"] / 1e12 / spec if spec else None
    why = emulated("fp8", ctx.device)
    if why:
        notes.append(f"fp8 emulated here ({why})")
    text = f"fp8 {rates['fp8']:,.0f} vs bf16 {rates['bf16']:,.0f} tokens/s: {ratio:.2f}x"
    text += f" ({'compiled' if s.compile else 'eager'}; bf16 mfu_spec {mfu:.3f})" if mfu else ""
    text += "; " + "; ".join(notes) if notes else ""
    return {"result": text, "value": ratio, "pass": None if why else ctx.judge(ratio >= 1.25), "details": rates}


def check_flex_vs_sdpa(ctx: Context) -> dict:
    require(old_transformers())
    from benchmarks.attention import window_pair
    from hf_pretrain import PretrainForCausalLM
    from hf_pretrain.modeling.attention import (
        SLIDING,
        Environment,
        LayerNeed,
        attention_forward,
        build_attention_masks,
        config_for_backend,
        unavailable_reason,
    )

    s = ctx.sizes
    config = window_pair(s.attn_window, s.attn_heads, s.attn_head_dim, s.attn_seq)
    model = PretrainForCausalLM(config).to(ctx.device)
    env = Environment.detect(ctx.device, ctx.dtype, training=True)
    need = LayerNeed(SLIDING, s.attn_window, packed=False)
    for backend in ("flex_attention", "sdpa"):
        why_not = unavailable_reason(backend, need, env, requested=True)
        if why_not:
            raise Skip(f"{backend} cannot train a window layer here: {why_not}")
    shape = (s.attn_batch, s.attn_heads, s.attn_seq, s.attn_head_dim)
    embeds = torch.empty(s.attn_batch, s.attn_seq, 1, device=ctx.device, dtype=ctx.dtype)
    attn = model.model.layers[0].self_attn
    seconds = {}
    for backend in ("flex_attention", "sdpa"):
        attn.config = config_for_backend(config, backend)
        mask = build_attention_masks({SLIDING: attn.config}, embeds, None, None, None)[SLIDING]
        q, k, v = (torch.randn(shape, device=ctx.device, dtype=ctx.dtype, requires_grad=True) for _ in range(3))

        def step(mask=mask, q=q, k=k, v=v):
            out, _ = attention_forward(attn, q, k, v, mask)
            out.float().sum().backward()

        seconds[backend] = median_seconds(step, ctx.device, repeats=5)
    del model
    free_memory()
    ratio = seconds["sdpa"] / seconds["flex_attention"]
    text = (
        f"window {s.attn_window} at seq {s.attn_seq}, fwd+bwd: flex {seconds['flex_attention'] * 1e3:.2f} ms, "
        f"SDPA dense mask {seconds['sdpa'] * 1e3:.2f} ms: {ratio:.2f}x"
    )
    return {"result": text, "value": ratio, "pass": ctx.judge(ratio >= 2.0), "details": seconds}


def median_seconds(fn, device: torch.device, repeats: int) -> float:
    """Median device seconds of `fn` (CUDA events on a GPU), after one warm-up call (flex compiles there)."""
    from hf_pretrain.telemetry.timing import DeviceClock

    clock = DeviceClock(device)
    fn()
    sync(device)
    marks = []
    for _ in range(repeats):
        start = clock.mark()
        fn()
        marks.append((start, clock.mark()))
    sync(device)
    return statistics.median(clock.seconds(a, b) for a, b in marks)


def check_packed_equality(ctx: Context) -> dict:
    require(old_transformers())
    from hf_pretrain import PretrainForCausalLM, get_preset

    document_position_ids = collator_module().document_position_ids
    # boundaries differ in every row, but only two document lengths: flex compiles one kernel per shape
    lengths = ((16, 32, 16), (32, 16, 16), (16, 16, 16, 16))
    g = torch.Generator().manual_seed(0)
    rows = [[torch.randint(3, 128, (n - 1,), generator=g).tolist() + [EOS] for n in row] for row in lengths]
    width = max(sum(map(len, docs)) for docs in rows)
    ids = torch.full((len(rows), width), EOS)
    for r, docs in enumerate(rows):
        flat = [t for doc in docs for t in doc]
        ids[r, : len(flat)] = torch.tensor(flat)
    positions = document_position_ids(ids, EOS)
    results, worst = {}, 0.0
    for backend in ctx.sizes.packed_backends:
        torch.manual_seed(0)
        config = get_preset(
            "tiny",
            vocab_size=128,
            num_hidden_layers=4,
            window_pattern="SL",
            sliding_window=5,
            attention_backend=backend,
        )
        model = PretrainForCausalLM(config).to(device=ctx.device, dtype=ctx.dtype).eval()
        with torch.no_grad():
            try:
                packed = model(input_ids=ids.to(ctx.device), position_ids=positions.to(ctx.device)).logits.float()
            except Exception as err:  # a backend this device cannot run: say which and why
                results[backend] = f"did not run: {type(err).__name__}: {str(err)[:120]}"
                continue
            scale = packed.abs().max().item()
            diff = 0.0
            for r, docs in enumerate(rows):
                start = 0
                for doc in docs:
                    alone = model(input_ids=torch.tensor([doc], device=ctx.device)).logits[0].float()
                    diff = max(diff, (packed[r, start : start + len(doc)] - alone).abs().max().item())
                    start += len(doc)
            # without restarting positions the later documents see the earlier ones: the check can fail
            leaky = model(input_ids=ids.to(ctx.device)).logits.float()
            leak = (leaky - packed).abs().max().item()
        tolerance = 0.02 * scale if ctx.dtype == torch.bfloat16 else 1e-4
        results[backend] = {"max_abs_diff": diff, "tolerance": tolerance, "leak_without_positions": leak}
        worst = max(worst, diff / tolerance)
        del model
    free_memory()
    ran = {b: r for b, r in results.items() if isinstance(r, dict)}
    if not ran:
        raise Skip("; ".join(f"{b} {r}" for b, r in results.items()))
    ok = all(r["max_abs_diff"] <= r["tolerance"] < r["leak_without_positions"] for r in ran.values())
    text = ", ".join(
        f"{b}: max diff {r['max_abs_diff']:.2e} (tol {r['tolerance']:.1e})" if isinstance(r, dict) else f"{b} {r}"
        for b, r in results.items()
    )
    judged = bool(ok) if ctx.cuda and not ctx.dry_run else None
    if ctx.dry_run and not ok:
        judged = False  # equality is a correctness property: it holds on a CPU too
    return {"result": text, "value": worst, "pass": judged, "details": results}


def check_memory_estimate(ctx: Context) -> dict:
    require(old_transformers())
    from hf_pretrain import PretrainForCausalLM, get_preset
    from hf_pretrain.distributed.memory import estimate_memory

    s = ctx.sizes
    config = get_preset(s.memory_preset, max_position_embeddings=s.memory_seq)
    free_memory()
    baseline = torch.cuda.memory_allocated(ctx.device) if ctx.cuda else 0
    torch.manual_seed(0)
    model = PretrainForCausalLM(config).to(ctx.device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=ctx.cuda)
    small = torch.randint(3, config.vocab_size, (1, 8), device=ctx.device)
    timed_steps(model, optimizer, small, 1, torch.float32, ctx.device)  # gradients and Adam's states now exist
    ids = torch.randint(3, config.vocab_size, (s.memory_batch, s.memory_seq), device=ctx.device)
    if ctx.cuda:
        torch.cuda.reset_peak_memory_stats(ctx.device)
    timed_steps(model, optimizer, ids, 1, torch.float32, ctx.device)
    peak = torch.cuda.max_memory_allocated(ctx.device) - baseline if ctx.cuda else None
    kernels = {kind: choice.backend for kind, choice in (model.attention_plan or {}).items()}
    flash = all(backend != "eager" for backend in kernels.values())  # sdpa / flex / FA keep no s x s scores
    estimate = estimate_memory(config, 0, 1, "fp32", s.memory_seq, s.memory_batch, flash_attention=flash)
    del model, optimizer
    free_memory()
    if peak is None:
        text = f"estimate {estimate.total / 2**30:.2f} GiB; no CUDA allocator to measure on a CPU"
        return {"result": text, "value": None, "pass": None, "details": estimate.to_dict()}
    ratio = estimate.total / peak
    text = (
        f"{s.memory_preset} fp32 seq {s.memory_seq} x {s.memory_batch}: estimate {estimate.total / 2**30:.2f} GiB, "
        f"max_memory_allocated {peak / 2**30:.2f} GiB ({ratio - 1:+.1%})"
    )
    return {"result": text, "value": ratio, "pass": ctx.judge(abs(ratio - 1) <= 0.10), "details": estimate.to_dict()}


def check_step_time_events(ctx: Context) -> dict:
    require(old_transformers())
    from types import SimpleNamespace

    from transformers import TrainerControl, TrainerState

    from hf_pretrain import PretrainForCausalLM, get_preset
    from hf_pretrain.telemetry.throughput import ThroughputCallback

    s = ctx.sizes
    config = get_preset(s.events_preset, max_position_embeddings=s.events_seq)
    torch.manual_seed(0)
    model = PretrainForCausalLM(config).to(ctx.device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=ctx.cuda)
    ids = torch.randint(3, config.vocab_size, (s.events_batch, s.events_seq), device=ctx.device)
    timed_steps(model, optimizer, ids, 2, ctx.dtype, ctx.device)  # warm-up
    args = SimpleNamespace(device=ctx.device, world_size=1, bf16=ctx.cuda, fp16=False, precision=None)
    state, control = TrainerState(), TrainerControl()
    state.max_steps = s.events_steps
    callback = ThroughputCallback(seq_len=s.events_seq, measure_ceiling=False)
    callback.on_train_begin(args, state, control, model=model)
    enqueue, wall = [], []
    for step in range(1, s.events_steps + 1):
        sync(ctx.device)
        start = time.perf_counter()
        callback.on_step_begin(args, state, control)
        with torch.autocast(ctx.device.type, dtype=ctx.dtype, enabled=ctx.cuda):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)
        state.global_step = step
        callback.on_step_end(args, state, control)
        enqueue.append(time.perf_counter() - start)  # what a host clock without a sync would log
        sync(ctx.device)
        wall.append(time.perf_counter() - start)
    events = callback.metrics_for_log(state)["step_time_s"]
    del model, optimizer
    free_memory()
    host, queued = statistics.fmean(wall), statistics.fmean(enqueue)
    text = (
        f"step_time_s (events) {events * 1e3:.1f} ms, synchronised wall {host * 1e3:.1f} ms "
        f"({events / host - 1:+.1%}), host enqueue only {queued * 1e3:.1f} ms ({queued / host:.0%} of the wall)"
    )
    return {
        "result": text,
        "value": events / host,
        "pass": ctx.judge(abs(events / host - 1) <= 0.05),
        "details": {"events": events, "wall": host, "enqueue": queued},
    }


def check_straggler_2proc(ctx: Context) -> dict:
    require(old_transformers(), trainer_missing())
    out = ctx.workdir / "straggler"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    procs = []
    for rank in (0, 1):
        env = {
            **os.environ,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "WORLD_SIZE": "2",
            "RANK": str(rank),
            "LOCAL_RANK": "0" if ctx.cuda else str(rank),  # both ranks on the one GPU
            "LOCAL_WORLD_SIZE": "2",
            "OMP_NUM_THREADS": "1",
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        }
        cmd = [sys.executable, __file__, "--worker", "straggler", "--workdir", str(out)]
        cmd += ["--dry-run"] if ctx.dry_run else []
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = [p.communicate(timeout=300)[0] for p in procs]
    if any(p.returncode for p in procs):
        tail = outputs[0][-1500:] + outputs[1][-1500:]
        raise RuntimeError(f"a rank failed ({[p.returncode for p in procs]}): {tail}")
    from hf_pretrain.telemetry.jsonl import read_jsonl

    records = read_jsonl(out)
    flagged = [r for r in records if "straggler_warning" in r]
    scored = [r for r in records if "rank1_score" in r]
    named = bool(flagged) and all(r["straggler_slowest_rank"] == 1 for r in flagged)
    if flagged:
        text = f"{len(flagged)} of {len(scored)} exchanges flagged: {flagged[0]['straggler_warning']}"
    else:
        text = f"no straggler named in {len(scored)} exchanges" + (
            f" (rank1_score {scored[-1]['rank1_score']:.2f})" if scored else ""
        )
    keys = ("rank0_compute_s", "rank1_compute_s", "rank0_wait_s", "rank1_wait_s", "rank0_local_s", "rank1_local_s")
    details = [{k: r.get(k) for k in ("step", "rank0_score", "rank1_score", *keys)} for r in scored]
    # naming the slowed rank is judged on a dry run too: two CPU ranks, one slowed on the host
    return {"result": text, "value": float(named), "pass": named, "details": details}


def straggler_worker(workdir: Path, sizes: Sizes, cuda: bool) -> None:
    """One rank of `check_straggler_2proc` (launched with RANK / WORLD_SIZE / MASTER_* set)."""
    from hf_pretrain import PretrainForCausalLM, PretrainTrainer, get_preset
    from hf_pretrain.data.collator import PackedDocumentCollator
    from tests.training.faults import slow_down_rank

    config = get_preset(sizes.straggler_preset, max_position_embeddings=sizes.straggler_seq)
    rows = sizes.straggler_batch * 2 * (sizes.straggler_steps + 1)
    ctx = Context(torch.device("cuda" if cuda else "cpu"), sizes, not cuda, workdir)
    args = train_args(
        ctx,
        workdir,
        max_steps=sizes.straggler_steps,
        per_device_train_batch_size=sizes.straggler_batch,
        logging_steps=4,
        straggler_every=4,
        ddp_backend="gloo",  # two ranks on one GPU: NCCL refuses a shared device
        measure_peak_tflops=False,
    )
    torch.manual_seed(0)
    model = PretrainForCausalLM(config)
    slow_down_rank(model, 1, sizes.straggler_sleep_s)  # the device of rank 1 is slow, its host is not
    trainer = PretrainTrainer(
        model=model,
        args=args,
        train_dataset=packed_rows(config.vocab_size, sizes.straggler_seq, rows),
        data_collator=PackedDocumentCollator(EOS),
    )
    trainer.train()
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()


CHECKS = {
    "env": ("-", check_env),
    "mfu_bf16": ("mfu_spec >= 0.50 (bf16, ~1B, seq 2048 packed)", check_mfu_bf16),
    "fp8_vs_bf16": ("fp8 / bf16 tokens/s >= 1.25", check_fp8_vs_bf16),
    "flex_vs_sdpa": ("dense-mask SDPA / flex time >= 2 (window layer)", check_flex_vs_sdpa),
    "packed_equality": ("packed = alone (sdpa, flex)", check_packed_equality),
    "memory_estimate": ("estimate within +-10 % of max_memory_allocated", check_memory_estimate),
    "step_time_events": ("event step time within 5 % of synced wall", check_step_time_events),
    "straggler_2proc": ("the slowed rank 1 is named", check_straggler_2proc),
}


def run_check(name: str, ctx: Context) -> dict:
    goal, fn = CHECKS[name]
    start = time.perf_counter()
    try:
        row = fn(ctx)
        status = {True: "pass", False: "fail", None: "ran"}[row["pass"]] if name != "env" else "-"
    except Skip as skip:
        row, status = {"result": "", "value": None, "pass": None}, f"skipped: {skip}"
    except ModuleNotFoundError as err:
        row, status = {"result": "", "value": None, "pass": None}, f"skipped: {err.name} not installed"
    except Exception as err:  # one check's failure never stops the others
        trace = traceback.format_exc()
        row = {"result": "", "value": None, "pass": False, "details": {"traceback": trace[-4000:]}}
        status = f"error: {type(err).__name__}: {str(err)[:300]} [{transformers_note()}]"
        print(trace, file=sys.stderr)
    free_memory()
    return {"check": name, "goal": goal, **row, "status": status, "seconds": round(time.perf_counter() - start, 1)}


def print_table(rows: list[dict]) -> None:
    width = 118
    print(f"{'check':<18}{'status':<10}{'seconds':>8}  result / goal")
    print("-" * width)
    for row in rows:
        status = row["status"] if len(row["status"]) <= 8 else row["status"].split(":")[0]
        print(f"{row['check']:<18}{status:<10}{row['seconds']:>8.1f}  {row['result'] or row['status']}")
        if row["check"] != "env":
            shown = status == row["status"] or not row["result"]  # a skip's or an error's text is shown above
            print(f"{'':<36}goal: {row['goal']}" + ("" if shown else f"  [{row['status']}]"))


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dry-run", action="store_true", help="tiny configs on the CPU: the same code, no goals")
    parser.add_argument("--only", default=None, help=f"comma-separated checks of {list(CHECKS)}")
    parser.add_argument("--out", default="gpu_check.json", help="where the JSON goes (default ./gpu_check.json)")
    parser.add_argument("--workdir", default=None, help="scratch directory (default: a temporary one)")
    parser.add_argument("--worker", choices=["straggler"], help=argparse.SUPPRESS)
    a = parser.parse_args(argv)
    sizes = DRY if a.dry_run else Sizes()
    if a.worker:
        straggler_worker(Path(a.workdir), sizes, cuda=not a.dry_run and torch.cuda.is_available())
        return []
    if not a.dry_run and not torch.cuda.is_available():
        parser.error("no CUDA GPU here: run with --dry-run (tiny configs on the CPU) or on a GPU machine")
    names = ["env", *[n for n in (a.only.split(",") if a.only else CHECKS) if n != "env"]]
    unknown = [n for n in names if n not in CHECKS]
    if unknown:
        parser.error(f"--only names unknown checks {unknown}; use any of {list(CHECKS)}")
    device = torch.device("cpu" if a.dry_run else "cuda")
    with tempfile.TemporaryDirectory() as tmp:
        ctx = Context(device, sizes, a.dry_run, Path(a.workdir or tmp))
        rows = []
        for name in names:
            rows.append(run_check(name, ctx))
            print(f"[{rows[-1]['seconds']:6.1f} s] {name}: {rows[-1]['status']} {rows[-1]['result']}", flush=True)
    report = {"dry_run": a.dry_run, "time": time.time(), "checks": rows}
    Path(a.out).write_text(json.dumps(report, indent=2, default=str))
    print()
    print_table(rows)
    print(f"\nwrote {a.out}")
    return rows


if __name__ == "__main__":
    main()
