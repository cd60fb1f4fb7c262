"""Memory preflight: the run's estimated peak per process against the memory free for it, before the first step.

A run that does not fit is otherwise found by the kernel's OOM killer (`died with SIGKILL`, no word
of memory) or by a CUDA out-of-memory error minutes in. The estimate is `distributed/memory.py`'s
(weights, gradients, optimizer states, activations, dense attention masks, the loss); what is free:
- CUDA: `torch.cuda.mem_get_info` of the run's device;
- CPU: the host's available memory (psutil) shared by this node's processes, capped by the
  process's cgroup limit and address-space limit (`ulimit -v`) where they are lower;
plus what the model already holds there (its weights are part of the estimate). Over what is free:
`memory_preflight="error"` refuses (`MemoryPreflightError`) and `"warn"` warns; over
`WARN_FRACTION` of it, a warning. Either names the figures and the fixes that fit: a smaller
micro-batch, activation checkpointing, shorter sequences. The estimator stays in distributed/ (`hf-pretrain
estimate-memory`, the planner); this check sits a floor above it (`FLOORS` in tests/test_layers.py).
"""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass, replace
from pathlib import Path

from ..distributed.memory import GiB, MemoryEstimate, estimate_memory

WARN_FRACTION = 0.85
POLICIES = ("error", "warn", "ignore")


class MemoryPreflightError(ValueError):
    """The run's estimated memory exceeds what its device or host has free."""


@dataclass(frozen=True)
class RunShape:
    """What the estimate depends on (the arguments of `estimate_memory`)."""

    precision: str
    seq_len: int
    micro_batch: int
    checkpointing: bool = False
    zero: int = 0
    gpus: int = 1
    fsdp2: bool = False
    flash_attention: bool = True
    dense_mask_layers: int = 0
    offload: bool = False
    sp: int = 1  # Ulysses sequence parallelism: each rank holds 1/sp of every sequence
    tp: int = 1  # DeepSpeed AutoTP: each rank holds 1/tp of the split linears, ZeRO over world / tp ranks

    @classmethod
    def of_run(cls, args, config, plan: dict, seq_len: int, micro_batch: int | None = None, **sharding) -> RunShape:
        """A run's shape from its `TrainingArguments`, its attention plan (`kernel_memory`) and sequence length;
        `sharding`: `zero`, `fsdp2`, `offload`, `sp`, `tp` (none: DDP or one process)."""
        micro_batch = micro_batch or args.per_device_train_batch_size
        checkpointing = bool(args.gradient_checkpointing)
        kernels = kernel_memory(config, plan)
        return cls(
            precision_name(args), seq_len, micro_batch, checkpointing, gpus=args.world_size, **sharding, **kernels
        )

    def estimate(self, config) -> MemoryEstimate:
        return estimate_memory(
            config,
            self.zero,
            self.gpus,
            self.precision,
            self.seq_len,
            self.micro_batch,
            offload=self.offload,
            checkpointing=self.checkpointing,
            flash_attention=self.flash_attention,
            fsdp2=self.fsdp2,
            dense_mask_layers=self.dense_mask_layers,
            sp=self.sp,
            tp=self.tp,
        )


def precision_name(args) -> str:
    """The estimator's precision of a run: its recipe, else its autocast dtype."""
    recipe = getattr(args, "precision", None)
    return recipe or ("bf16" if args.bf16 else "fp16" if args.fp16 else "fp32")


def kernel_memory(config, plan: dict) -> dict:
    """`flash_attention` and `dense_mask_layers` of `RunShape` from an attention plan: layer type -> its kernel
    choice (a `modeling.attention.Choice` or a row of the attention report: `backend`, `efficient`)."""
    layers = {t: config.layer_types.count(t) for t in plan}
    dense = sum(layers[t] for t, choice in plan.items() if choice.backend == "sdpa" and not choice.efficient)
    return {"flash_attention": all(c.backend != "eager" for c in plan.values()), "dense_mask_layers": dense}


def _cgroup_free() -> int | None:
    for limit, usage in (
        ("memory.max", "memory.current"),
        ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes"),
    ):
        try:
            cap = Path("/sys/fs/cgroup", limit).read_text().strip()
            if cap.isdigit() and int(cap) < 2**60:
                return int(cap) - int(Path("/sys/fs/cgroup", usage).read_text())
        except OSError:
            continue
    return None


def host_free(processes: int = 1) -> tuple[int, str]:
    """Bytes of host memory one of `processes` processes of this node can still take, and where that figure is from."""
    import psutil

    free, where = psutil.virtual_memory().available // processes, "available host memory"
    cgroup = _cgroup_free()
    if cgroup is not None and cgroup // processes < free:
        free, where = cgroup // processes, "the cgroup's memory limit"
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY and soft - psutil.Process().memory_info().vms < free:
        free, where = soft - psutil.Process().memory_info().vms, "the address-space limit (ulimit -v)"
    if processes > 1:
        where += f" / {processes} processes of this node"
    return max(free, 0), where


def free_memory(device, processes: int = 1) -> tuple[int, str]:
    """Bytes free for this process on `device` (a torch device), and where that figure is from."""
    import torch

    device = torch.device(device)
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return free, f"free on {torch.cuda.get_device_name(device)} ({total / GiB:.1f} GiB)"
    return host_free(processes)


def model_bytes(model, device) -> int:
    """What the model's parameters and buffers already take on `device` (counted in the estimate, not free)."""
    import torch

    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors if t.device == torch.device(device))


@dataclass
class MemoryCheck:
    config: object
    shape: RunShape
    need: int
    free: int
    where: str

    @property
    def fits(self) -> bool:
        return self.need <= self.free

    @property
    def tight(self) -> bool:
        return self.need > WARN_FRACTION * self.free

    def fixes(self) -> list[str]:
        """Changes of the run that fit what is free, each priced."""
        out, shape = [], self.shape
        micro = shape.micro_batch // 2
        while micro >= 1 and replace(shape, micro_batch=micro).estimate(self.config).total > self.free:
            micro //= 2
        if micro >= 1:
            need = replace(shape, micro_batch=micro).estimate(self.config).total
            out.append(
                f"--per_device_train_batch_size {micro} ({need / GiB:.1f} GiB; raise accumulation to keep the batch)"
            )
        if not shape.checkpointing:
            need = replace(shape, checkpointing=True).estimate(self.config).total
            if need <= self.free:
                out.append(f"--gradient_checkpointing ({need / GiB:.1f} GiB, about 1/3 more compute)")
        seq = 2 ** (shape.seq_len.bit_length() - 1)
        seq = seq // 2 if seq == shape.seq_len else seq
        for batch in dict.fromkeys((shape.micro_batch, 1)):
            s = seq
            while s >= 64 and (
                s % shape.sp or replace(shape, seq_len=s, micro_batch=batch).estimate(self.config).total > self.free
            ):  # under SP only lengths it divides
                s //= 2
            if s >= 64:
                need = replace(shape, seq_len=s, micro_batch=batch).estimate(self.config).total
                micro_text = "" if batch == shape.micro_batch else f" at micro-batch {batch}"
                out.append(f"sequences of {s} tokens{micro_text} ({need / GiB:.1f} GiB)")
                break
        return out

    def message(self) -> str:
        e = self.shape.estimate(self.config)
        parts = [
            ("weights", e.parameters),
            ("gradients", e.gradients),
            ("optimizer states", e.optimizer_states),
            ("activations", e.activations),
            ("attention masks", e.attention_mask),
            ("loss", e.logits),
        ]
        detail = ", ".join(f"{name} {value / GiB:.2f}" for name, value in parts if value)
        shape = self.shape
        head = (
            f"memory preflight: sequences of {shape.seq_len} tokens"
            f"{f' (1/{shape.sp} per rank, Ulysses SP)' if shape.sp > 1 else ''} x micro-batch {shape.micro_batch} "
            f"{f'(AutoTP {shape.tp}: 1/{shape.tp} of the attention and MLP per rank) ' if shape.tp > 1 else ''}"
            f"({shape.precision}{', activation checkpointing' if shape.checkpointing else ''}) need about "
            f"{self.need / GiB:.1f} GiB per process ({detail} GiB; hf_pretrain.distributed.memory), "
            f"{self.free / GiB:.1f} GiB free ({self.where})"
        )
        if self.fits:
            return f"{head}: {self.need / self.free:.0%} of it, little room for what the estimate leaves out."
        fixes = self.fixes()
        fix = "; ".join(fixes) if fixes else "a larger machine, or a smaller model"
        return f"{head}: it would be killed for want of memory. Fix: {fix}."


def check_memory(config, shape: RunShape, device, held: int = 0) -> MemoryCheck:
    """The estimate of `shape` against the memory free for this process on `device` (+ `held`: what the model
    already takes there); on a CPU the host's memory is shared by this node's processes."""
    import torch

    processes = local_processes() if torch.device(device).type == "cpu" else 1
    free, where = free_memory(device, processes)
    return MemoryCheck(config, shape, shape.estimate(config).total, free + held, where)


def enforce_memory_policy(check: MemoryCheck, policy: str, warn) -> None:
    """`error`: refuse a run that does not fit; `warn`: say so; a tight fit is a warning under both."""
    if policy not in POLICIES:
        raise ValueError(f"memory_preflight={policy!r} is invalid; use one of {list(POLICIES)}.")
    if policy == "ignore" or not check.tight:
        return
    if not check.fits and policy == "error":
        raise MemoryPreflightError(check.message() + " (memory_preflight='warn' starts anyway.)")
    warn(check.message())


def local_processes() -> int:
    """Processes of this run on this node (they share the host's memory)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
