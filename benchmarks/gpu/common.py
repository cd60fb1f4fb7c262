"""What every check of benchmarks/gpu_check.py shares: the run's context and sizes, and the small helpers.

Nothing here imports `datasets` or `torchao` at import time: a missing one skips only the checks that
need it, each saying what to carry (`require`).
"""

from __future__ import annotations

import gc
import importlib.metadata
import importlib.util
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
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
    overhead_preset: str = "gpt2-124m"
    overhead_seq: int = 1024
    overhead_batch: int = 8
    overhead_steps: int = 40  # timed steps: whole straggler windows and logging intervals (a mean over them)
    overhead_straggler_every: int = 20
    overhead_logging_steps: int = 10
    overhead_rounds: int = 2
    packed_backends: tuple[str, ...] = ("sdpa", "flex_attention")
    compile: bool = True
    compile_backend: str = "inductor"
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
    overhead_preset="tiny",
    overhead_seq=64,
    overhead_batch=2,
    overhead_steps=4,
    overhead_straggler_every=4,
    overhead_logging_steps=2,
    overhead_rounds=1,
    packed_backends=("sdpa",),  # flex compiles C++ kernels on a CPU (minutes); its CPU test: test_packed_documents
    compile=False,  # the fp8 check's regional compile; the MFU check traces with Dynamo's "eager" backend instead
    compile_backend="eager",
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


def model_optimizer_batch(ctx: Context, preset: str, seq: int, batch: int, lr: float):
    """A seeded `preset` model in training mode on the device, its AdamW (fused on CUDA) and a batch of ids."""
    from hf_pretrain import PretrainForCausalLM, get_preset

    config = get_preset(preset, max_position_embeddings=seq)
    torch.manual_seed(0)
    model = PretrainForCausalLM(config).to(ctx.device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, fused=ctx.cuda)
    ids = torch.randint(3, config.vocab_size, (batch, seq), device=ctx.device)
    return model, optimizer, ids


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


def training_logs(run_dir: Path, after_step: int = 0) -> list[dict]:
    """The training logs a run wrote to its telemetry.jsonl (the measured values, which `state.log_history` does not
    keep: hf_pretrain/callback.py), past `after_step`: what the trial reads too (hf_pretrain/trial.py)."""
    from hf_pretrain.telemetry.jsonl import read_jsonl

    return [r for r in read_jsonl(run_dir) if "loss" in r and r["step"] > after_step]


def median_of(logs: list[dict], key: str) -> float | None:
    """The median of `key` over `logs`, None when no log has it (a figure the run did not measure)."""
    values = [r[key] for r in logs if isinstance(r.get(key), (int, float))]
    return statistics.median(values) if values else None
