"""`make_plan(PlanRequest) -> Plan`: a budget and the hardware in, a run that fits out (or a refusal that says why).

The order of decisions, each from its one home in the package:
1. The chip: peak, memory and MFU, each with its source (`hardware.py`).
2. The model: `--params`, else `--tokens` / tokens-per-parameter, else the compute-optimal shape for the
   FLOPs the budget buys (`scaling.py`).
3. The memory, per `distributed.memory.estimate_memory` within the device minus a margin (15 % by default,
   for what the estimator leaves out: the CUDA context, allocator fragmentation, collective buckets). The
   candidates, cheapest communication first: DDP, DeepSpeed ZeRO-2, then ZeRO-3 (or FSDP2 with
   `--sharding fsdp2`, priced as ZeRO-3: both shard weights, gradients and optimizer states and gather one
   layer at a time). The first that holds a micro-batch of `WANTED_MICRO_TOKENS` tokens (or what the batch
   needs per GPU, if fewer) wins, else the first that holds one; activation checkpointing only when nothing
   fits without it (it recomputes the forward: 4/3 of the step's FLOPs). An hours budget then pays for the
   recompute, so the model is sized again for the compute left to the model (budget / (4/3)): the largest
   shape that fits without checkpointing if it is at least that size, else the compute-optimal one for that
   compute, with checkpointing. CPU offload is not planned: its speed is the host's, which nothing here
   predicts; a model that does not fit is refused with the largest one that does.
3b. Sequence parallelism (DeepSpeed Ulysses, `sp_size`), always under ZeRO-3 (the only stage SP is checked with;
   `training/sequence_parallel.py`). When the sequence fits no strategy above even with checkpointing: per SP degree
   the setting that fits (without checkpointing first), the cheapest step where the all-to-all is priced (else the
   smallest degree). When data sharding holds it only with checkpointing: SP without checkpointing instead, where
   its priced all-to-all costs less than the recompute's 1/3 of the FLOPs (`weigh_sp`; on one node only: ZeRO-3
   gathers each layer's weights per micro-step, and SP's smaller micro-steps would expose that over the network).
   The degree divides the GPUs per node, so that each attention's four all-to-alls (q, k, v out; the output back)
   stay on the node's NVLink rather than the slower network between nodes; it divides the heads and the sequence,
   and the key/value heads are a multiple or a divisor of it (DeepSpeed's rules). What SP refuses is refused here,
   with its reason: `--sharding fsdp2` (Ulysses runs inside DeepSpeed). The launch runs SDPA attention
   (FlashAttention is not checked under SP), whose windows and document boundaries need a dense s x s mask that SP
   does not divide: each windowed layer's mask is priced in the memory, and documents are packed GPT-style
   (`--separate_documents false`: 16 GiB a row at 128K would buy nothing the planner can weigh). SP shares each
   sequence over `sp` ranks, so a step trains (GPUs / sp) x micro-batch rows.
3c. Tensor parallelism (DeepSpeed AutoTP, `"tensor_parallel": {"autotp_size": tp}`, under ZeRO-1: the stage its
   tests run; `training/tensor_parallel.py`), only where data sharding and SP hold nothing (`fit_past_data_sharding`):
   SP divides every activation and keeps ZeRO-3's sharded states, AutoTP only the attention's and MLP's activations
   and weights (ZeRO-1 shards the optimizer states alone): 8B at 128K with checkpointing needs 25 GiB per GPU
   under ZeRO-3 + SP 8, 79 under AutoTP 8. AutoTP is for where SP cannot run (a windowed model's dense SDPA masks under SP, heads no SP degree splits). The degree divides the GPUs
   per node (the all-reduces stay on NVLink); DeepSpeed splits any head count, and degrees that split the heads and
   KV heads evenly come first; then the cheapest step. Its price: per layer and pass two all-reduces of the hidden
   states (the row-wise o/down projections' outputs forward, the column-wise layers' input gradients backward), a
   ring sending 2 (tp - 1) / tp of each per GPU over the node's link, not overlapped; and the untied LM head that
   every TP rank computes whole. Context parallelism (torch's ring attention, GPU-only) is not planned. A step
   trains (GPUs / tp) x micro-batch rows.
3d. Across nodes, with `--network-gbps` (GB/s each way per GPU; `network.py` prices the data-parallel traffic):
   the plan so far against AutoTP (ZeRO-1) and Ulysses SP (ZeRO-3) inside a node, each degree without
   checkpointing if it fits, else with (`weigh_across_nodes`): the highest tokens/s wins, and the `network` row
   lists them all. ZeRO-3 gathers every weight across the nodes per micro-step; AutoTP's data-parallel groups send
   a 1/tp share once per optimizer step (its all-reduces stay on NVLink); SP keeps ZeRO-3's traffic and divides a
   micro-step's compute that hides it. Without the figure nothing across nodes is priced or weighed, and the plan
   says so (unavailable, not zero); on one node the figure changes nothing.
4. The tokens: what the budget pays for at that shape (hours x GPUs x peak x MFU, or FLOPs / FLOPs per token).
5. The batch and learning rate from DeepSeek LLM's fits in compute; micro-batch x accumulation x GPUs rounded to
   the fit; the schedule positioned in tokens (`training/schedules.py` reads `total_tokens`, `warmup_tokens`;
   warmup 0.8 % of the tokens, at least one optimizer step).
6. The prediction: tokens/s = GPUs x peak x MFU / (FLOPs per token x cost), cost = 4/3 with checkpointing plus
   SP's all-to-all (or AutoTP's all-reduce) time over the compute time (`step_cost`): the bytes each GPU sends over
   the chip table's link (each way) x `LINK_EFFICIENCY`, not overlapped (the all-to-alls sit between the
   projections and attention, the all-reduces between a layer and the next), plus AutoTP's replicated LM head.
   A chip without a link figure (or `--link-gbps`) gets its collective unpriced, said so, with its volume. Across
   nodes with `--network-gbps`, plus the data-parallel traffic the compute does not hide (`network.py`). Then step
   time, wall-clock, GPU-hours.
7. The checkpoint interval: Young's rule from one save's stall and the job's time between failures
   (`resilience.py`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..distributed.memory import BYTES_PER_PARAMETER, GiB, MemoryEstimate, estimate_memory, ulysses_kv_width
from ..modeling.accounting import SLIDING, attention_widths, count_parameters, flops_per_token
from ..modeling.configuration import PretrainConfig
from ..precision.recipes import LOW_PRECISION
from . import scaling
from .hardware import LINK_EFFICIENCY, NETWORK_EXAMPLE, PLANNED_RECIPES, Hardware, PlanRefused, resolve_hardware
from .network import Traffic, data_parallel_traffic
from .resilience import CheckpointPlan, checkpoint_plan, run_resilience

DEFAULT_MARGIN = 0.15
MIN_VOCAB_SIZE = 259  # byte-level BPE: 256 byte tokens + the special tokens (data/tokenizer.py: check_vocab_size)
MAX_MICRO_BATCH = 64
# A micro-batch of ~8K tokens keeps the matmuls large and the accumulation loop short: worth a sharded
# strategy's extra communication when DDP holds fewer.
WANTED_MICRO_TOKENS = 8192
CHECKPOINTING_COST = 4 / 3  # full activation checkpointing runs the forward twice: (1 + 1 + 2) / 3


@dataclass(frozen=True)
class Strategy:
    name: str  # single | ddp | zero2 | zero3 | fsdp2
    label: str
    zero: int  # the memory estimator's stage
    template: str  # the accelerate config in examples/accelerate_configs/ it starts from
    deepspeed_config: str | None = None  # the shipped DeepSpeed preset, relative to the repository root


STRATEGIES = {
    "single": Strategy("single", "one GPU", 0, "one_gpu.yaml"),
    "ddp": Strategy("ddp", "DDP", 0, "ddp_8gpu.yaml"),
    "zero2": Strategy("zero2", "DeepSpeed ZeRO-2", 2, "deepspeed_zero3_8gpu.yaml", "ds_configs/zero2.json"),
    "zero3": Strategy("zero3", "DeepSpeed ZeRO-3", 3, "deepspeed_zero3_8gpu.yaml", "ds_configs/zero3.json"),
    "fsdp2": Strategy("fsdp2", "FSDP2", 3, "fsdp2_8gpu.yaml"),
    # AutoTP's launch: the plan writes its own copy of the preset with its degree (output.py)
    "zero1_tp": Strategy(
        "zero1_tp", "DeepSpeed ZeRO-1", 1, "deepspeed_zero3_8gpu.yaml", "ds_configs/zero1_autotp.json"
    ),
}


@dataclass
class PlanRequest:
    device: str
    gpus: int = 1  # per node
    nodes: int = 1
    hours: float | None = None
    tokens: float | None = None
    flops: float | None = None
    data_tokens: float | None = None
    params: float | None = None
    seq_len: int = 2048
    tokens_per_param: float = scaling.CHINCHILLA_TOKENS_PER_PARAM
    mfu: float | None = None
    trial: str | None = None
    precision: str | None = None  # default: the trial's recommendation, else bf16
    vocab_size: int = 65536
    window_pattern: str = "L"
    sliding_window: int | None = None
    sharding: str = "deepspeed"  # or fsdp2
    schedule: str = "cosine_restarts"  # or wsd
    margin: float = DEFAULT_MARGIN
    peak_tflops: float | None = None
    device_memory_gb: float | None = None
    link_gbps: float | None = None  # GB/s each way, one GPU to the rest of its node (default: the chip table)
    network_gbps: float | None = None  # GB/s each way, one GPU's share of the network between nodes (default: unknown)
    checkpoint_seconds: float | None = None  # one save's stall of the training loop (default: estimated)
    mtbf_hours: float | None = None  # the job's mean time between failures (default: Llama 3's rate per GPU)
    goodput_from: str | None = None  # a run whose goodput gives both (the flags above win)

    def __post_init__(self):
        budgets = [name for name in ("hours", "tokens", "flops") if getattr(self, name) is not None]
        if len(budgets) != 1:
            raise ValueError(f"give exactly one budget: --hours, --tokens or --flops (got {budgets or 'none'}).")
        for name in ("gpus", "nodes", "seq_len", "vocab_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')}={getattr(self, name)!r} must be a positive integer.")
        if self.vocab_size < MIN_VOCAB_SIZE:
            raise ValueError(
                f"--vocab-size={self.vocab_size} is too small for the byte-level BPE the launch trains "
                f"(examples/pretrain.py): use at least {MIN_VOCAB_SIZE} (256 bytes + special tokens), e.g. 32768."
            )
        for name in ("hours", "tokens", "flops", "data_tokens", "params", "tokens_per_param", "peak_tflops",
                     "link_gbps", "network_gbps", "checkpoint_seconds", "mtbf_hours"):  # fmt: skip
            value = getattr(self, name)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ValueError(f"--{name.replace('_', '-')}={value!r} must be positive and finite.")
        if self.mfu is not None and not 0 < self.mfu <= 1:
            raise ValueError(f"--mfu={self.mfu!r} must be a fraction in (0, 1], e.g. 0.4.")
        if not 0 <= self.margin < 1:
            raise ValueError(f"--margin={self.margin!r} must be a fraction in [0, 1), e.g. 0.15.")
        if self.precision is not None and self.precision not in PLANNED_RECIPES:
            raise ValueError(f"--precision={self.precision!r} is not planned; use one of {list(PLANNED_RECIPES)}.")
        if self.sharding not in ("deepspeed", "fsdp2"):
            raise ValueError(f"--sharding={self.sharding!r} is invalid; use deepspeed or fsdp2.")
        if "S" in self.window_pattern and self.sliding_window is None:
            raise ValueError(f"--window-pattern {self.window_pattern} needs --sliding-window (tokens, e.g. 1024).")
        if self.schedule not in ("cosine_restarts", "wsd"):
            raise ValueError(f"--schedule={self.schedule!r} is invalid; use cosine_restarts or wsd.")


@dataclass
class Plan:
    hardware: Hardware
    config: PretrainConfig
    seq_len: int
    tokens_per_param_target: float
    strategy: Strategy
    checkpointing: bool
    micro_batch: int
    grad_accum: int
    steps: int
    memory: MemoryEstimate
    usable_bytes: int
    batch_opt_tokens: float
    peak_lr: float
    schedule: str
    schedule_kwargs: dict
    data_tokens: float | None
    budget: dict
    checkpoints: CheckpointPlan | None = None
    warnings: list[str] = field(default_factory=list)
    sp: int = 1  # Ulysses sequence-parallel degree
    sp_reason: str | None = None  # why SP was chosen, or why not where checkpointing is on, for the plan's text
    tp: int = 1  # DeepSpeed AutoTP degree
    tp_reason: str | None = None  # why AutoTP was chosen
    network_reason: str | None = None  # across nodes with --network-gbps: the weighing of ZeRO-3, AutoTP and SP

    @property
    def data_parallel(self) -> int:
        """Groups that train different rows: the GPUs over the SP (or TP) degree."""
        return self.hardware.world // (self.sp * self.tp)

    @property
    def collective(self) -> str | None:
        """The collective on the step's critical path: SP's all-to-all, AutoTP's all-reduce, or None."""
        return "all-to-all" if self.sp > 1 else "all-reduce" if self.tp > 1 else None

    @property
    def collective_bytes(self) -> float:
        """Bytes one GPU sends in SP's all-to-alls or AutoTP's all-reduces per optimizer step (0 without either)."""
        share = self.micro_batch * self.grad_accum * self.seq_len // (self.sp * self.tp)  # the batch's tokens / GPUs
        precision = self.hardware.precision
        return collective_per_token(self.config, self.sp, self.tp, precision, self.checkpointing) * share

    @property
    def collective_seconds(self) -> float | None:
        """That collective's time per optimizer step at the link's achievable rate; None when the link is unknown."""
        if self.collective is None:
            return 0.0
        rate = link_rate(self.hardware)
        return None if rate is None else self.collective_bytes / rate

    @property
    def network_traffic(self) -> Traffic | None:
        """The data-parallel traffic each GPU sends across nodes (`network.py`); None on one node."""
        hw = self.hardware
        return None if hw.nodes == 1 else data_parallel_traffic(self.config, self.strategy.name, hw.precision,
                                                                 hw.world, self.tp)  # fmt: skip

    @property
    def network_share(self) -> float | None:
        """That traffic's time the compute does not hide, over the model FLOPs' time (0 on one node, None where the
        network is unknown)."""
        return network_share(self.config, self.seq_len, self.hardware, self.fit, self.sp, self.tp,
                             self.micro_batch, self.grad_accum)  # fmt: skip

    @property
    def network_seconds(self) -> float | None:
        """Seconds per optimizer step the network adds (0 on one node, None where it is unknown)."""
        share = self.network_share
        if share is None:
            return None
        return share * self.global_batch_tokens * self.flops_per_token / self.hardware.sustained_flops

    @property
    def fit(self) -> tuple:
        return self.strategy, self.checkpointing, self.micro_batch

    @property
    def cost(self) -> float:
        """Seconds per token over the model FLOPs' seconds at the MFU: the recompute, the priced collective, under
        AutoTP the LM head every TP rank computes whole, and the network time across nodes the compute does not
        hide (where priced)."""
        base = step_cost(self.config, self.seq_len, self.hardware, self.sp, self.checkpointing, self.tp)
        return base + (self.network_share or 0.0)

    @property
    def parameters(self) -> int:
        return count_parameters(self.config)

    @property
    def flops_per_token(self) -> float:
        return flops_per_token(self.config, self.seq_len)

    @property
    def global_batch_tokens(self) -> int:
        return self.data_parallel * self.micro_batch * self.grad_accum * self.seq_len

    @property
    def tokens(self) -> int:
        return self.steps * self.global_batch_tokens

    @property
    def model_flops(self) -> float:
        return self.flops_per_token * self.tokens

    @property
    def deepseek_compute(self) -> float:
        return scaling.non_embedding_flops_per_token(self.config, self.seq_len) * self.tokens

    @property
    def tokens_per_second(self) -> float:
        return self.hardware.sustained_flops / (self.flops_per_token * self.cost)

    @property
    def step_seconds(self) -> float:
        return self.global_batch_tokens / self.tokens_per_second

    @property
    def hours(self) -> float:
        return self.tokens / self.tokens_per_second / 3600

    @property
    def gpu_hours(self) -> float:
        return self.hours * self.hardware.world

    @property
    def epochs(self) -> float | None:
        return None if self.data_tokens is None else self.tokens / self.data_tokens


def all_to_all_per_token(config, sp: int, precision: str, checkpointing: bool) -> float:
    """Bytes one GPU sends in SP's all-to-alls per token of its shard: per layer and pass (forward, backward, the
    recompute) q, k, v and the attention's output, (sp - 1) / sp of them leaving it (0 without SP)."""
    if sp == 1:
        return 0.0
    q, k = attention_widths(config)[0], ulysses_kv_width(config, sp)
    element = BYTES_PER_PARAMETER[precision][3]
    passes = 3 if checkpointing else 2
    return element * (2 * q + 2 * k) * (sp - 1) / sp * passes * config.num_hidden_layers


def all_reduce_per_token(config, tp: int, precision: str, checkpointing: bool) -> float:
    """Bytes one GPU sends in AutoTP's all-reduces per token of its micro-batch (which the TP group shares): per layer
    and pass (forward, backward, the recompute) two all-reduces of the hidden states (forward: after o_proj and
    down_proj, the row-wise layers; backward: the gradients of the column-wise q/k/v's and gate/up's inputs), a ring
    sending 2 (tp - 1) / tp of each (0 without TP)."""
    if tp == 1:
        return 0.0
    element = BYTES_PER_PARAMETER[precision][3]
    passes = 3 if checkpointing else 2
    return element * config.hidden_size * 2 * passes * config.num_hidden_layers * 2 * (tp - 1) / tp


def collective_per_token(config, sp: int, tp: int, precision: str, checkpointing: bool) -> float:
    """Bytes one GPU sends per token of its share of the batch (the batch's tokens over the GPUs): SP's all-to-all
    per token of its shard; AutoTP's all-reduce per token of the micro-batch, whose tokens are tp GPUs' share."""
    return all_to_all_per_token(config, sp, precision, checkpointing) + tp * all_reduce_per_token(
        config, tp, precision, checkpointing
    )


def link_rate(hw: Hardware) -> float | None:
    """Bytes per second a collective sends from one GPU: the link each way x `LINK_EFFICIENCY`; None unknown."""
    return None if hw.link_gbps is None else hw.link_gbps * 1e9 * LINK_EFFICIENCY


def collective_share(config, seq_len: int, hw: Hardware, sp: int, checkpointing: bool, tp: int = 1) -> float | None:
    """SP's all-to-all (or AutoTP's all-reduce) time per token over the model FLOPs' time per token at the MFU (0
    without either; None when the link is unknown). Both sit on the critical path, not overlapped with compute:
    the all-to-alls between the projections and attention, the all-reduces between a layer's row-wise matmul and
    the next layer's input."""
    if sp == 1 and tp == 1:
        return 0.0
    rate = link_rate(hw)
    if rate is None:
        return None
    compute = flops_per_token(config, seq_len) / (hw.peak_tflops * 1e12 * hw.mfu)
    return collective_per_token(config, sp, tp, hw.precision, checkpointing) / rate / compute


def replicated_head_share(config, seq_len: int, tp: int) -> float:
    """The model FLOPs AutoTP adds per token over the model's: an untied LM head stays whole on each of the tp
    ranks (`training/tensor_parallel.py`), so (tp - 1) of them compute its 6 x d x V again; the rest splits."""
    if tp == 1 or config.tie_word_embeddings:
        return 0.0
    return (tp - 1) * 6 * config.hidden_size * config.vocab_size / flops_per_token(config, seq_len)


def step_cost(config, seq_len: int, hw: Hardware, sp: int, checkpointing: bool, tp: int = 1) -> float:
    """Seconds per token over the model FLOPs' seconds at the MFU: 4/3 with the recompute, plus the collective's
    share where priced (an unpriced one adds nothing: the plan says so), plus AutoTP's replicated LM head."""
    share = collective_share(config, seq_len, hw, sp, checkpointing, tp)
    return (CHECKPOINTING_COST if checkpointing else 1.0) + (share or 0.0) + replicated_head_share(config, seq_len, tp)


def network_rate(hw: Hardware) -> float | None:
    """Bytes per second one GPU sends across nodes: `--network-gbps` x `LINK_EFFICIENCY`; None unknown."""
    return None if hw.network_gbps is None else hw.network_gbps * 1e9 * LINK_EFFICIENCY


def flop_seconds(config, seq_len: int, hw: Hardware) -> float:
    """One GPU's seconds for a token's model FLOPs at the MFU."""
    return flops_per_token(config, seq_len) / (hw.peak_tflops * 1e12 * hw.mfu)


def micro_compute_seconds(config, seq_len: int, hw: Hardware, fit, sp: int, tp: int) -> float:
    """A micro-step's compute on one GPU (its FLOPs at the MFU, the recompute and AutoTP's whole LM head included):
    what the network traffic of that micro-step can hide behind."""
    _, checkpointing, micro = fit
    flops = (CHECKPOINTING_COST if checkpointing else 1.0) + replicated_head_share(config, seq_len, tp)
    return micro * seq_len / (sp * tp) * flop_seconds(config, seq_len, hw) * flops


def network_share(config, seq_len: int, hw: Hardware, fit, sp: int, tp: int, micro: int, accum: int) -> float | None:
    """The data-parallel traffic's time across nodes that the compute does not hide (`network.py`), over the model
    FLOPs' time, at micro-batch `micro` x `accum`: 0 on one node, None where the network is unknown."""
    if hw.nodes == 1:
        return 0.0
    rate = network_rate(hw)
    if rate is None:
        return None
    strategy, checkpointing, _ = fit
    traffic = data_parallel_traffic(config, strategy.name, hw.precision, hw.world, tp)
    compute = micro_compute_seconds(config, seq_len, hw, (strategy, checkpointing, micro), sp, tp)
    exposed = traffic.exposed_seconds(rate, compute, accum)
    return exposed / (micro * accum * seq_len / (sp * tp) * flop_seconds(config, seq_len, hw))


def network_words(config, seq_len: int, hw: Hardware, fit, sp: int, tp: int, accum: int) -> str:
    """What one GPU sends across nodes per micro-step and per optimizer step, and what of it the compute hides."""
    strategy = fit[0]
    traffic = data_parallel_traffic(config, strategy.name, hw.precision, hw.world, tp)
    rate, compute = network_rate(hw), micro_compute_seconds(config, seq_len, hw, fit, sp, tp)
    parts = []
    if traffic.micro_step:
        seconds = traffic.micro_step / rate
        hidden = "hidden" if seconds <= compute else f"{seconds - compute:.2f} s exposed, x {accum} micro-steps"
        parts.append(f"{traffic.micro_step / GiB:,.1f} GiB a micro-step, {seconds:.2f} s against {compute:.2f} s of "
                     f"compute: {hidden}")  # fmt: skip
    if traffic.step:
        parts.append(f"{traffic.step / GiB:,.1f} GiB a step after the backward, {traffic.step / rate:.2f} s")
    return f"per GPU over {traffic.ranks} ranks {' + '.join(parts) or 'nothing'}"


def _estimate(
    config, strategy: Strategy, hw: Hardware, seq_len: int, micro: int, checkpointing: bool, sp: int = 1, tp: int = 1
):
    """Under SP attention runs on SDPA (FlashAttention is not checked there): each windowed layer reads and
    saves a dense s x s mask, which `sp` does not divide (`training/sequence_parallel.FullSequenceSdpa`)."""
    return estimate_memory(
        config,
        strategy.zero,
        hw.world,
        hw.precision,
        seq_len,
        micro,
        checkpointing=checkpointing,
        device_memory_gb=hw.memory_bytes / GiB,
        model="plan",
        sp=sp,
        tp=tp,
        dense_mask_layers=(config.layer_types or []).count(SLIDING) if sp > 1 else 0,
    )


def candidate_strategies(hw: Hardware, sharding: str) -> list[Strategy]:
    if hw.world == 1:
        return [STRATEGIES["single"]]
    sharded = ["zero2", "zero3"] if sharding == "deepspeed" else ["fsdp2"]
    return [STRATEGIES[name] for name in ("ddp", *sharded)]


def largest_micro_batch(
    config, strategy: Strategy, hw: Hardware, seq_len: int, usable: float, ckpt: bool, sp: int = 1, tp: int = 1
) -> int:
    """The largest power-of-two micro-batch (up to MAX_MICRO_BATCH) within `usable` bytes, 0 when none fits."""
    micro = 0
    for candidate in (2**i for i in range(int(math.log2(MAX_MICRO_BATCH)) + 1)):
        if _estimate(config, strategy, hw, seq_len, candidate, ckpt, sp, tp).total > usable:
            break
        micro = candidate
    return micro


def first_fit(config, strategy: Strategy, hw: Hardware, seq_len: int, usable: float, sp: int = 1, tp: int = 1):
    """(strategy, checkpointing, micro-batch) without activation checkpointing if a micro-batch fits, else with;
    None when neither holds one."""
    for checkpointing in (False, True):
        micro = largest_micro_batch(config, strategy, hw, seq_len, usable, checkpointing, sp, tp)
        if micro:
            return strategy, checkpointing, micro
    return None


def fit_memory(
    config, hw: Hardware, seq_len: int, usable: float, strategies: list[Strategy], wanted: int, options=(False, True)
):
    """(strategy, checkpointing, largest micro-batch): without checkpointing if anything fits, the first strategy
    whose micro-batch reaches `wanted` sequences, else the first that fits one; None when nothing fits.
    `options`: the checkpointing settings tried, in order."""
    for checkpointing in options:
        micros = [largest_micro_batch(config, s, hw, seq_len, usable, checkpointing) for s in strategies]
        pick = next((i for i, m in enumerate(micros) if m >= wanted), None)
        pick = pick if pick is not None else next((i for i, m in enumerate(micros) if m), None)
        if pick is not None:
            return strategies[pick], checkpointing, micros[pick]
    return None


def _refuse_memory(config, hw: Hardware, request: PlanRequest, usable: float, strategies: list[Strategy], sp: int = 1):
    """PlanRefused: what the last strategy needs, and the largest model it fits. Over one GPU the advice says that
    splitting the matmuls needs more GPUs; over several, `fit_past_data_sharding` adds what AutoTP needed."""
    last = strategies[-1]
    need, masks = _estimate(config, last, hw, request.seq_len, 1, True).total, None
    shape_args = dict(
        vocab_size=request.vocab_size,
        seq_len=request.seq_len,
        window_pattern=request.window_pattern,
        sliding_window=request.sliding_window,
    )
    fitting = next(
        (
            c
            for c in reversed(scaling.family(**shape_args))
            if _estimate(c, last, hw, request.seq_len, 1, True).total <= usable
        ),
        None,
    )
    how = f"{last.label} over {hw.world} GPUs" if hw.world > 1 else "one GPU (nothing to shard)"
    how += ", micro-batch 1, full activation checkpointing"
    if sp > 1:
        estimate = _estimate(config, last, hw, request.seq_len, 1, True, sp)
        need = estimate.total
        how += f", Ulysses SP {sp} (the largest degree the GPUs per node, the heads and the sequence allow)"
        if estimate.attention_mask:  # windows under SP: SDPA's s x s masks, which SP does not divide
            masks = f"{estimate.attention_mask / GiB:,.1f} of them the windowed layers' dense masks on SDPA"
    where = (
        f"{hw.device} ({hw.memory_bytes / GiB:.0f} GiB, {usable / GiB:.1f} GiB usable at a {request.margin:.0%} margin)"
    )
    if fitting is None:
        advice = "even the smallest shape of the planner does not fit: use a larger device (--device)"
    else:
        n = count_parameters(fitting)
        advice = (
            f"the largest model that fits one step is {n / 1e9:.2f}B parameters ({fitting.num_hidden_layers} x "
            f"{fitting.hidden_size}): pass --params {n:.3g}, add GPUs (--gpus / --nodes), or offload to the CPU "
            "(ds_configs/zero3_offload.json; the planner does not predict its speed)"
        )
        if hw.world == 1:
            advice += "; splitting each layer's matmuls (DeepSpeed AutoTP, which the planner tries) needs several GPUs"
    raise PlanRefused(
        f"a {count_parameters(config) / 1e9:.2f}B-parameter model does not fit one training step on {where}: "
        f"with {how} it needs {need / GiB:.1f} GiB per GPU{f' ({masks})' if masks else ''}; {advice}."
    )


def sp_blocker(config, sharding: str) -> str | None:
    """Why this run cannot take Ulysses SP (what `training/sequence_parallel.py` refuses), or None."""
    if sharding != "deepspeed":
        return "Ulysses SP runs inside DeepSpeed ZeRO-3: use --sharding deepspeed"
    return None


def sp_degrees(config, hw: Hardware, seq_len: int) -> list[int]:
    """The SP degrees > 1 a run may take, smallest first: divisors of the GPUs per node (the all-to-all stays
    within a node), of the heads and of the sequence, with the key/value heads a multiple or a divisor."""
    heads, kv = config.num_attention_heads, config.num_key_value_heads or config.num_attention_heads
    return [
        sp
        for sp in range(2, hw.gpus_per_node + 1)
        if not hw.gpus_per_node % sp and not heads % sp and not seq_len % sp and not (kv % sp and sp % kv)
    ]


def fit_sequence_parallel(config, request: PlanRequest, hw: Hardware, usable: float):
    """(ZeRO-3, checkpointing, micro-batch, sp) for a sequence no data sharding holds: per SP degree, without
    checkpointing if it fits, else with; of those, the cheapest step where the all-to-all is priced, else the
    smallest degree. PlanRefused when SP cannot run this model or nothing fits."""
    blocker = sp_blocker(config, request.sharding)
    seq = request.seq_len
    what = f"a sequence of {seq} tokens does not fit with data sharding and activation checkpointing alone"
    if blocker:
        raise PlanRefused(f"{what}, and sequence parallelism cannot take this model: {blocker}.")
    degrees = sp_degrees(config, hw, seq)
    if not degrees:
        kv = config.num_key_value_heads or config.num_attention_heads
        raise PlanRefused(
            f"{what}, and no sequence-parallel degree fits the model: it must divide the {hw.gpus_per_node} GPUs per "
            f"node, the {config.num_attention_heads} heads and the sequence, and the {kv} key/value heads must be a "
            f"multiple or a divisor of it; pass --params for a shape whose heads allow it, or a shorter --seq-len."
        )
    zero3, fits = STRATEGIES["zero3"], []
    for sp in degrees:
        if fit := first_fit(config, zero3, hw, seq, usable, sp):
            fits.append((*fit, sp))
        if fits and link_rate(hw) is None:
            break
    if not fits:
        _refuse_memory(config, hw, request, usable, [zero3], degrees[-1])
    return min(fits, key=lambda f: step_cost(config, seq, hw, f[3], f[1]))


def tp_blocker(request: PlanRequest, hw: Hardware) -> str | None:
    """Why this run cannot take DeepSpeed AutoTP (what `training/tensor_parallel.py` refuses, and one GPU per node),
    or None."""
    if request.sharding != "deepspeed":
        return "AutoTP runs inside DeepSpeed: use --sharding deepspeed"
    if hw.precision in LOW_PRECISION:
        return f"AutoTP replaces the linears --precision {hw.precision} converts: use --precision bf16"
    if hw.gpus_per_node == 1:
        return "one GPU per node, and AutoTP's all-reduces stay within a node"
    return None


def splits_heads(config, tp: int) -> bool:
    """Whether AutoTP of `tp` gives every rank the same share of the heads and of the key/value heads (DeepSpeed runs
    any split; an uneven one leaves some ranks more attention, or none of the KV heads)."""
    kv = config.num_key_value_heads or config.num_attention_heads
    return not config.num_attention_heads % tp and not kv % tp


def tp_degrees(config, hw: Hardware) -> list[int]:
    """The AutoTP degrees > 1 a run may take: divisors of the GPUs per node (the all-reduces stay within a node),
    those splitting the heads and key/value heads evenly first, smallest first."""
    degrees = [tp for tp in range(2, hw.gpus_per_node + 1) if not hw.gpus_per_node % tp]
    return sorted(degrees, key=lambda tp: (not splits_heads(config, tp), tp))


def fit_tensor_parallel(config, request: PlanRequest, hw: Hardware, usable: float) -> tuple[tuple | None, str]:
    """((ZeRO-1, checkpointing, micro-batch, tp), why) where AutoTP holds the model: per degree without checkpointing
    if it fits, else with; of those, even head splits first, then the cheapest step where the all-reduce is priced
    (else the first that fits). (None, why not) otherwise."""
    blocker = tp_blocker(request, hw)
    if blocker:
        return None, f"DeepSpeed AutoTP cannot take it: {blocker}"
    seq, zero1, fits = request.seq_len, STRATEGIES["zero1_tp"], []
    degrees = tp_degrees(config, hw)
    for tp in degrees:
        if fit := first_fit(config, zero1, hw, seq, usable, tp=tp):
            fits.append((*fit, tp))
        if fits and link_rate(hw) is None:
            break
    if not fits:
        need = min(_estimate(config, zero1, hw, seq, 1, True, tp=tp).total for tp in degrees)
        return None, (
            f"nor does DeepSpeed AutoTP with ZeRO-1 (tensor parallelism {' / '.join(map(str, degrees))} over a "
            f"node's GPUs): at best {need / GiB:.1f} GiB per GPU, micro-batch 1, full activation checkpointing"
        )
    fit = min(fits, key=lambda f: (not splits_heads(config, f[3]), step_cost(config, seq, hw, 1, f[1], f[3])))
    return fit, tp_reason(config, hw, seq, fit[3], fit[1])


def sp_shortfall(config, request: PlanRequest, hw: Hardware) -> str:
    """Why Ulysses SP holds no step, in a phrase (`fit_sequence_parallel` refuses with the whole of it)."""
    blocker = sp_blocker(config, request.sharding)
    degrees = sp_degrees(config, hw, request.seq_len)
    if blocker or not degrees:
        return f"Ulysses SP cannot run: {blocker or 'no degree divides the GPUs per node, the heads and the sequence'}"
    need = _estimate(config, STRATEGIES["zero3"], hw, request.seq_len, 1, True, degrees[-1])
    masks = f" ({need.attention_mask / GiB:,.1f} of them the windowed layers' dense masks on SDPA)"
    return f"Ulysses SP {degrees[-1]} needs {need.total / GiB:.1f} GiB per GPU{masks if need.attention_mask else ''}"


def tp_reason(config, hw: Hardware, seq_len: int, tp: int, checkpointing: bool) -> str:
    """Why the plan splits each layer's matmuls: this degree, its heads, and its all-reduce's price."""
    which = "the cheapest degree" if link_rate(hw) else "the smallest degree"
    heads = f"the {config.num_attention_heads} heads ({config.num_key_value_heads} KV)"
    split = f"and {heads}" if splits_heads(config, tp) else f"(not {heads}: DeepSpeed splits them unevenly)"
    share = collective_share(config, seq_len, hw, 1, checkpointing, tp)
    price = (
        f"its all-reduce is not priced ({hw.link_source}; pass --link-gbps)"
        if share is None
        else f"its all-reduce costs {share:.1%} of the compute time ({hw.link_gbps:g} GB/s each way, {hw.link_source}, "
        f"x {LINK_EFFICIENCY:g} reached by NCCL)"
    )
    head = replicated_head_share(config, seq_len, tp)
    return (
        f"DeepSpeed AutoTP {tp} with ZeRO-1 over the {hw.world // tp} data-parallel groups: {tp} is {which} that fits "
        f"and divides the {hw.gpus_per_node} GPUs per node {split}; each GPU runs 1/{tp} of every attention and "
        f"MLP linear; {price}; the LM head stays whole on each TP rank: +{head:.1%} FLOPs"
    )


def fit_past_data_sharding(config, request: PlanRequest, hw: Hardware, usable: float):
    """(fit, sp, tp, why) for a run no data sharding holds even with checkpointing: Ulysses SP first (it divides
    every activation, the loss's included, and ZeRO-3 keeps the model states sharded over all GPUs), then AutoTP
    where SP cannot take it or holds nothing (AutoTP splits only the attention's and MLP's activations and weights,
    and ZeRO-1 shards only the optimizer states). PlanRefused with both reasons when neither holds it."""
    try:
        *fit, sp = fit_sequence_parallel(config, request, hw, usable)
        return fit, sp, 1, sp_reason(config, hw, request.seq_len, usable, sp, fit[1])
    except PlanRefused as refused:
        sp_refusal = str(refused).rstrip(".")
    fit, why = fit_tensor_parallel(config, request, hw, usable)
    if fit is None:
        raise PlanRefused(f"{sp_refusal}; {why}.")
    *fit, tp = fit
    zero3 = _estimate(config, STRATEGIES["zero3"], hw, request.seq_len, 1, True).total
    because = (
        f"{request.seq_len} tokens need {zero3 / GiB:.1f} GiB per GPU with ZeRO-3 and checkpointing alone (of "
        f"{usable / GiB:.1f} usable), and {sp_shortfall(config, request, hw)} at micro-batch 1 with checkpointing"
    )
    return fit, 1, tp, f"{because}; {why}"


def all_to_all_words(config, seq_len: int, hw: Hardware, sp: int, checkpointing: bool) -> str:
    """What SP's all-to-all costs, in words: its share of the compute at the link's rate, or why it is not priced."""
    share = collective_share(config, seq_len, hw, sp, checkpointing)
    if share is None:
        return f"its all-to-all is not priced ({hw.link_source}; pass --link-gbps)"
    return (
        f"its all-to-all costs {share:.1%} of the compute time ({hw.link_gbps:g} GB/s each way, {hw.link_source}, "
        f"x {LINK_EFFICIENCY:g} reached by NCCL)"
    )


def sp_reason(config, hw: Hardware, seq_len: int, usable: float, sp: int, checkpointing: bool) -> str:
    """Why the plan splits each sequence: what one GPU would need without SP, why this degree."""
    alone = _estimate(config, STRATEGIES["zero3"], hw, seq_len, 1, True).total
    which = "the cheapest degree" if link_rate(hw) else "the smallest degree"
    return (
        f"Ulysses SP {sp}: {seq_len} tokens need {alone / GiB:.1f} GiB per GPU with ZeRO-3 and checkpointing alone "
        f"(of {usable / GiB:.1f} usable); {sp} is {which} that fits and divides the {hw.gpus_per_node} GPUs per "
        f"node (its all-to-all stays on the node's links), the {config.num_attention_heads} heads "
        f"({config.num_key_value_heads} KV) and the sequence: each GPU holds {seq_len // sp} tokens of every row; "
        + all_to_all_words(config, seq_len, hw, sp, checkpointing)
    )


def weigh_sp(config, request: PlanRequest, hw: Hardware, usable: float, fit) -> tuple[tuple | None, str | None]:
    """Ulysses SP without checkpointing against data sharding with it (`fit`): (SP's fit, why) when its priced
    all-to-all costs less than the recompute (1/3 of the FLOPs), else (None, why not; None where SP cannot run this
    model at all). Weighed within one node only: ZeRO-3 gathers every layer's weights once per micro-step, and SP
    shrinks a micro-step's tokens per GPU by its degree; over NVLink that stays hidden behind the compute, over the
    network between nodes (whose bandwidth the planner does not know) it may not."""
    seq = request.seq_len
    recompute = f"{fit[0].label} holds {seq} tokens only with activation checkpointing (the recompute: +1/3 FLOPs)"
    degrees = sp_degrees(config, hw, seq) if hw.world > 1 and not sp_blocker(config, request.sharding) else []
    if not degrees:
        return None, None
    if SLIDING in (config.layer_types or []):
        return None, (
            f"{recompute}; Ulysses SP without it is not weighed for windows: under SP they run on SDPA with a "
            "dense mask, which computes the whole s x s where FlashAttention skips outside the window"
        )
    if hw.nodes > 1:
        if network_rate(hw) is not None:
            return None, None  # weighed with the network priced (`weigh_across_nodes`)
        return None, (
            f"{recompute}; Ulysses SP without it is not weighed over {hw.nodes} nodes: ZeRO-3's weight gathers, with "
            "SP's fewer tokens per GPU and micro-step, would cross the network between nodes, whose bandwidth is "
            "not given; nor is DeepSpeed AutoTP with ZeRO-1 weighed against ZeRO-3 (its all-reduces within a node "
            "against ZeRO-3's gathers across nodes): it is planned only where nothing else fits; pass "
            f"--network-gbps to weigh them ({NETWORK_EXAMPLE})"
        )
    zero3 = STRATEGIES["zero3"]
    fits = [(sp, m) for sp in degrees if (m := largest_micro_batch(config, zero3, hw, seq, usable, False, sp))]
    if not fits:
        return None, f"{recompute}; no Ulysses SP degree of {hw.gpus_per_node} GPUs holds it without checkpointing"
    sp, micro = min(fits, key=lambda f: step_cost(config, seq, hw, f[0], False))
    share = collective_share(config, seq, hw, sp, False)
    words = all_to_all_words(config, seq, hw, sp, False)
    if share is None or 1 + share >= CHECKPOINTING_COST:
        return None, f"{recompute}; Ulysses SP {sp} (ZeRO-3) would hold it without, but {words}"
    return (zero3, False, micro, sp), (
        f"Ulysses SP {sp} (ZeRO-3) without activation checkpointing: {recompute}; with SP {sp} each GPU holds "
        f"{seq // sp} tokens of every row and {words}, less than the recompute's 33 %"
    )


def choose_model(request: PlanRequest, hw: Hardware, cost: float = 1.0) -> tuple[PretrainConfig, dict]:
    """The shape, and the budget as asked (kind, value, compute it buys before checkpointing). `cost`: FLOPs run
    per model FLOP (checkpointing's recompute): an hours budget then buys that much less model compute."""
    shape_args = dict(
        vocab_size=request.vocab_size, window_pattern=request.window_pattern, sliding_window=request.sliding_window
    )
    if request.hours is not None:
        budget = {"kind": "hours", "value": request.hours, "flops": request.hours * 3600 * hw.sustained_flops}
    elif request.flops is not None:
        budget = {"kind": "flops", "value": request.flops, "flops": request.flops}
    else:
        budget = {"kind": "tokens", "value": request.tokens, "flops": None}
    try:
        if request.params is not None:
            target = f"--params {request.params:.3g}"
            config = scaling.shape_for_parameters(request.params, seq_len=request.seq_len, **shape_args)
        elif budget["kind"] == "tokens":
            target = f"--tokens {request.tokens:.3g} / {request.tokens_per_param:g} tokens per parameter"
            config = scaling.shape_for_parameters(
                request.tokens / request.tokens_per_param, seq_len=request.seq_len, **shape_args
            )
        else:
            target = f"{budget['flops']:.3g} FLOPs at {request.tokens_per_param:g} tokens per parameter"
            model_flops = budget["flops"] / (cost if budget["kind"] == "hours" else 1.0)
            config = scaling.compute_optimal_shape(model_flops, request.tokens_per_param, request.seq_len, **shape_args)
    except scaling.ShapeOutOfRange as out:
        n = count_parameters(out.config)
        fix = (
            "raise the budget, lower --vocab-size, or pass --params"
            if out.which == "smallest"
            else "lower the budget or --params, or raise --tokens-per-param"
        )
        raise PlanRefused(
            f"{target} asks for a model beyond the planner's {out.which} shape ({n / 1e6:,.1f}M parameters: "
            f"{out.config.num_hidden_layers} x {out.config.hidden_size}, vocabulary {request.vocab_size}); {fix}."
        ) from None
    return config, budget


def budget_tokens(budget: dict, fpt: float, cost: float = 1.0) -> float:
    """Tokens the budget trains: `cost` (seconds per token over the model FLOPs', `step_cost`: the recompute, SP's
    all-to-all) spends hours, not model FLOPs."""
    if budget["kind"] == "hours":
        return budget["flops"] / (fpt * cost)
    return budget["flops"] / fpt if budget["kind"] == "flops" else budget["value"]


def sequences_per_gpu(config, tokens: float, seq_len: int, world: int) -> tuple[float, float, int]:
    """(DeepSeek's C, B_opt in tokens, sequences per GPU per optimizer step that B_opt asks for)."""
    compute = scaling.non_embedding_flops_per_token(config, seq_len) * tokens
    batch_opt = scaling.deepseek_batch_tokens(compute)
    return compute, batch_opt, max(1, round(batch_opt / (seq_len * world)))


def _fit(config, request: PlanRequest, hw: Hardware, budget: dict, usable: float, options=(False, True)):
    seq = request.seq_len
    strategies = candidate_strategies(hw, request.sharding)
    *_, wanted = sequences_per_gpu(config, budget_tokens(budget, flops_per_token(config, seq)), seq, hw.world)
    wanted = max(1, min(wanted, WANTED_MICRO_TOKENS // seq))
    return fit_memory(config, hw, seq, usable, strategies, wanted, options)


def resize_for_recompute(request: PlanRequest, hw: Hardware, config, budget: dict, usable: float):
    """The model for an hours budget when `config` fits only with activation checkpointing: the compute-optimal
    shape for the model FLOPs left after the recompute, or, if a larger shape than that fits without
    checkpointing, the largest such (full speed beats the recompute). Returns (config, fit, warning)."""
    optimal, _ = choose_model(request, hw, CHECKPOINTING_COST)
    shape_args = dict(
        vocab_size=request.vocab_size,
        seq_len=request.seq_len,
        window_pattern=request.window_pattern,
        sliding_window=request.sliding_window,
    )
    low, high = count_parameters(optimal), count_parameters(config)
    for candidate in reversed(scaling.family(**shape_args)):
        if not low <= count_parameters(candidate) < high:
            continue
        fit = _fit(candidate, request, hw, budget, usable, options=(False,))
        if fit is not None:
            warning = (
                f"the compute-optimal {count_parameters(config) / 1e9:.3g}B model needs activation checkpointing; "
                f"{count_parameters(candidate) / 1e9:.3g}B is the largest shape without it (no recompute, more "
                "tokens per parameter than the target)"
            )
            return candidate, fit, warning
    return optimal, _fit(optimal, request, hw, budget, usable), None


def micro_and_accumulation(max_micro: int, per_gpu: int) -> tuple[int, int]:
    """The micro-batch (the largest power of two within memory and the rows wanted) and the accumulation steps that
    make up the rows each data-parallel group wants per optimizer step."""
    micro = 2 ** int(math.log2(min(max_micro, per_gpu)))
    return micro, max(1, round(per_gpu / micro))


def size_batch(config, budget: dict, hw: Hardware, seq_len: int, fit, sp: int, tp: int):
    """(tokens, DeepSeek's C, B_opt, micro-batch, accumulation) of a fit. The network's exposed time depends on the
    micro-batch, so an hours budget is spent again with it once the batch is known (the batch kept: B_opt moves by
    C^0.33, far less than a step)."""
    _, checkpointing, max_micro = fit
    fpt, groups = flops_per_token(config, seq_len), hw.world // (sp * tp)
    base = step_cost(config, seq_len, hw, sp, checkpointing, tp)
    tokens = budget_tokens(budget, fpt, base)
    compute, batch_opt, per_gpu = sequences_per_gpu(config, tokens, seq_len, groups)
    micro, accum = micro_and_accumulation(max_micro, per_gpu)
    exposed = network_share(config, seq_len, hw, fit, sp, tp, micro, accum)
    if exposed and budget["kind"] == "hours":
        tokens = budget_tokens(budget, fpt, base + exposed)
        compute, batch_opt, _ = sequences_per_gpu(config, tokens, seq_len, groups)
    return tokens, compute, batch_opt, micro, accum


def across_node_options(config, request: PlanRequest, hw: Hardware, usable: float, current) -> list[tuple]:
    """(fit, sp, tp) to weigh across nodes: the plan so far; per Ulysses SP degree ZeRO-3 + SP (without
    checkpointing if it fits, else with), unless SP cannot run it or the model has windows (SDPA's dense masks, not
    priced in time); per AutoTP degree ZeRO-1 + TP likewise, even head splits only where any fits. None of them
    where the node's link is unknown: their all-to-all / all-reduce would weigh nothing."""
    seq, options = request.seq_len, [current]
    if link_rate(hw) is None:
        return options

    def option(strategy: Strategy, sp: int, tp: int):
        fit = first_fit(config, strategy, hw, seq, usable, sp, tp)
        return fit and (fit, sp, tp)

    if not sp_blocker(config, request.sharding) and SLIDING not in (config.layer_types or []):
        options += [option(STRATEGIES["zero3"], sp, 1) for sp in sp_degrees(config, hw, seq)]
    if not tp_blocker(request, hw):
        tps = [option(STRATEGIES["zero1_tp"], 1, tp) for tp in tp_degrees(config, hw)]
        even = [o for o in tps if o and splits_heads(config, o[2])]
        options += even or tps
    unique = []
    for option in options:
        if option and option not in unique:
            unique.append(option)
    return unique


def option_label(option) -> str:
    (strategy, checkpointing, _), sp, tp = option
    name = f"Ulysses SP {sp} ({strategy.label})" if sp > 1 else f"AutoTP {tp} ({strategy.label})" if tp > 1 else None
    return f"{name or strategy.label}, checkpointing {'on' if checkpointing else 'off'}"


def weigh_across_nodes(config, request: PlanRequest, hw: Hardware, usable: float, budget: dict, current):
    """((fit, sp, tp), why, changed): of the plan so far and the AutoTP / Ulysses SP options inside a node
    (`across_node_options`), the highest tokens/s with the data-parallel traffic across nodes priced
    (`network.py`; the NVLink collectives and AutoTP's whole LM head as elsewhere)."""
    seq, rate = request.seq_len, network_rate(hw)
    scored = []
    for option in across_node_options(config, request, hw, usable, current):
        fit, sp, tp = option
        *_, micro, accum = size_batch(config, budget, hw, seq, fit, sp, tp)
        cost = step_cost(config, seq, hw, sp, fit[1], tp) + network_share(config, seq, hw, fit, sp, tp, micro, accum)
        tokens_per_s = hw.sustained_flops / (flops_per_token(config, seq) * cost)
        fitted = (fit[0], fit[1], micro)
        words = network_words(config, seq, hw, fitted, sp, tp, accum)
        scored.append((tokens_per_s, option, f"{option_label(option)}: {tokens_per_s / 1e3:,.1f}k tokens/s ({words})"))
    best = max(scored, key=lambda s: s[0])
    others = "; ".join(text for _, option, text in scored if option != best[1])
    head = (
        f"across {hw.nodes} nodes at {hw.network_gbps:g} GB/s each way per GPU ({hw.network_source}, x "
        f"{LINK_EFFICIENCY:g} = {rate / 1e9:g} GB/s; a micro-step's data-parallel traffic hides behind its compute)"
    )
    why = f"weighed {head}: {best[2]}, the highest; against {others}" if others else f"priced {head}: {best[2]}"
    if hw.gpus_per_node > 1 and link_rate(hw) is None:
        why += f"; AutoTP and Ulysses SP inside a node not weighed: their collectives are not priced ({hw.link_source})"
    return best[1], why, best[1] != current


def chosen_reasons(config, hw: Hardware, seq_len: int, fit, sp: int, tp: int) -> tuple[str | None, str | None]:
    """(sp_reason, tp_reason) of an option the weighing across nodes chose over the plan so far."""
    if tp > 1:
        return None, tp_reason(config, hw, seq_len, tp, fit[1])
    if sp > 1:
        return (
            f"Ulysses SP {sp} (ZeRO-3), checkpointing {'on' if fit[1] else 'off'}, chosen across nodes (the network "
            f"row): each GPU holds {seq_len // sp} tokens of every row and "
            + all_to_all_words(config, seq_len, hw, sp, fit[1])
        ), None
    return None, None


def make_plan(request: PlanRequest) -> Plan:
    hw = resolve_hardware(request)
    config, budget = choose_model(request, hw)
    seq = request.seq_len
    usable = int(hw.memory_bytes * (1 - request.margin))
    fit, sp, tp, resized, why, tp_why = _fit(config, request, hw, budget, usable), 1, 1, None, None, None
    if fit is None and hw.world > 1:  # the sequence shared over GPUs of a node, else each layer's matmuls
        fit, sp, tp, why = fit_past_data_sharding(config, request, hw, usable)
        why, tp_why = (why, None) if tp == 1 else (None, why)
    elif fit is None:
        _refuse_memory(config, hw, request, usable, candidate_strategies(hw, request.sharding))
    elif fit[1]:  # checkpointing, or SP without it where its all-to-all costs less
        chosen, why = weigh_sp(config, request, hw, usable, fit)
        if chosen is None and budget["kind"] == "hours" and request.params is None:  # the recompute: from the hours
            config, fit, resized = resize_for_recompute(request, hw, config, budget, usable)
            chosen, why = weigh_sp(config, request, hw, usable, fit) if fit[1] else (None, None)
        if chosen is not None:
            *fit, sp = chosen
    net_why = None
    if hw.nodes > 1 and network_rate(hw) is not None:  # ZeRO-3 across nodes against AutoTP / SP inside a node
        (fit, sp, tp), net_why, changed = weigh_across_nodes(config, request, hw, usable, budget, (tuple(fit), sp, tp))
        if changed:
            why, tp_why = chosen_reasons(config, hw, seq, fit, sp, tp)
    strategy, checkpointing, _ = fit
    tokens, compute, batch_opt, micro, accum = size_batch(config, budget, hw, seq, fit, sp, tp)
    groups = hw.world // (sp * tp)  # data-parallel groups: each trains its own rows
    global_tokens = groups * micro * accum * seq
    steps = round(tokens / global_tokens)
    if steps < 1:
        raise PlanRefused(
            f"the budget buys {tokens:,.0f} tokens, less than one optimizer step of {global_tokens:,} tokens "
            f"({groups} data-parallel group(s) x micro-batch {micro} x {seq}); raise the budget."
        )
    trained = steps * global_tokens
    peak_lr = scaling.deepseek_peak_lr(compute)
    schedule_kwargs = {"total_tokens": trained, "warmup_tokens": max(round(0.008 * trained), global_tokens)}
    if request.schedule == "wsd":
        schedule_kwargs.update(decay_fraction=0.2, floor=0.0, shape="1-sqrt")
    else:
        schedule_kwargs["floor"] = 0.1
    plan = Plan(
        hardware=hw,
        config=config,
        seq_len=seq,
        tokens_per_param_target=request.tokens_per_param,
        strategy=strategy,
        checkpointing=checkpointing,
        micro_batch=micro,
        grad_accum=accum,
        steps=steps,
        memory=_estimate(config, strategy, hw, seq, micro, checkpointing, sp, tp),
        usable_bytes=usable,
        batch_opt_tokens=batch_opt,
        peak_lr=peak_lr,
        schedule=request.schedule,
        schedule_kwargs=schedule_kwargs,
        data_tokens=request.data_tokens,
        budget=budget,
        sp=sp,
        sp_reason=why,
        tp=tp,
        tp_reason=tp_why,
        network_reason=net_why,
    )
    state = plan.memory.parameters + plan.memory.optimizer_states  # what one rank's checkpoint stages
    measured = run_resilience(request.goodput_from) if request.goodput_from else None
    refuse_excess_epochs(plan)
    plan.checkpoints = checkpoint_plan(state, hw.world, request.checkpoint_seconds, request.mtbf_hours, measured)
    plan.warnings = warnings_for(plan) + ([resized] if resized else [])
    return plan


def data_advice(plan: Plan) -> str:
    """What to do when the data is too small for the plan: the model 4 epochs of it suit, or more data."""
    useful = scaling.MAX_USEFUL_EPOCHS * plan.data_tokens
    suited = useful / plan.tokens_per_param_target
    layers, width = scaling.family_grid(plan.config.vocab_size)[0]
    smallest = count_parameters(
        scaling.shape(layers, plan.config.vocab_size, plan.seq_len, **_windows(plan.config), width=width)
    )
    if suited >= smallest:
        return (
            f"{useful:.3g} tokens ({scaling.MAX_USEFUL_EPOCHS:g} epochs) suit a model of ~{suited:.3g} parameters "
            f"(--tokens {useful:.3g}), or find more data"
        )
    wanted = smallest * plan.tokens_per_param_target
    return (
        f"even the planner's smallest shape ({smallest:.3g} parameters) wants {wanted:.3g} tokens: find more data "
        f"(at least {wanted / scaling.MAX_USEFUL_EPOCHS:.3g} unique tokens for {scaling.MAX_USEFUL_EPOCHS:g} epochs)"
    )


def refuse_excess_epochs(plan: Plan) -> None:
    """A plan past `MAX_PLANNED_EPOCHS` of its data trains on data worth nothing more: refused, with the fix."""
    epochs = plan.epochs
    if epochs is not None and epochs > scaling.MAX_PLANNED_EPOCHS:
        raise PlanRefused(
            f"--data-tokens {plan.data_tokens:.3g}: the plan trains {plan.tokens:.3g} tokens, {epochs:,.0f} epochs "
            f"of that data, and past {scaling.MAX_PLANNED_EPOCHS:g} epochs repeats add nothing (Muennighoff et al. "
            f"2023); {data_advice(plan)}."
        )


def warnings_for(plan: Plan) -> list[str]:
    out = []
    epochs = plan.epochs
    if epochs is None:
        out.append("no --data-tokens: epochs over the unique data unknown")
    elif epochs > scaling.MAX_USEFUL_EPOCHS:
        out.append(
            f"{epochs:.1f} epochs over {plan.data_tokens:.3g} unique tokens: past ~{scaling.MAX_USEFUL_EPOCHS:g} "
            f"repeats the value of repeated data fades (Muennighoff et al. 2023); {data_advice(plan)}"
        )
    if plan.global_batch_tokens > 2 * plan.batch_opt_tokens:
        out.append(
            f"global batch {plan.global_batch_tokens:,} tokens is {plan.global_batch_tokens / plan.batch_opt_tokens:.1f}"
            f"x DeepSeek's B_opt ({plan.batch_opt_tokens:,.0f}): the smallest the GPUs give at micro-batch 1"
        )
    if plan.checkpointing:
        out.append("activation checkpointing is on: each step recomputes the forward (4/3 of the FLOPs)")
    if plan.tp > 1 and plan.collective_seconds is None:
        out.append(
            f"AutoTP's all-reduce ({plan.collective_bytes / GiB:,.1f} GiB sent per GPU per step) is not in the "
            f"predicted tokens/s: {plan.hardware.link_source} (pass --link-gbps)"
        )
    if plan.sp > 1:
        if plan.collective_seconds is None:
            out.append(
                f"SP's all-to-all ({plan.collective_bytes / GiB:,.1f} GiB sent per GPU per step) is not in the "
                f"predicted tokens/s: {plan.hardware.link_source} (pass --link-gbps)"
            )
        out.append(
            "SP: SDPA attention (--attention_backend sdpa; FlashAttention is not checked under SP) and documents packed "
            f"GPT-style (--separate_documents false): SDPA's document mask is a dense s x s, "
            f"{plan.seq_len**2 / GiB:,.1f} GiB a row at this length, that SP does not divide"
        )
    warmup_steps = plan.schedule_kwargs["warmup_tokens"] / plan.global_batch_tokens
    if warmup_steps < 10:
        out.append(
            f"warmup is {warmup_steps:.1f} optimizer step(s) of {plan.steps} (0.8 % of the tokens, at least one "
            "step): a very short run"
        )
    if plan.hardware.nodes > 1 and plan.network_share is None:
        out.append(
            f"multi-node communication is not weighed: the network between the {plan.hardware.nodes} nodes is "
            "unavailable (not zero), so the data-parallel traffic across nodes is not in the predicted tokens/s and "
            "AutoTP / Ulysses SP inside a node are not weighed against ZeRO-3 across nodes; pass --network-gbps "
            f"({NETWORK_EXAMPLE})"
        )
    if plan.hardware.nodes > 1:
        out.append("multi-node: set main_process_ip in accelerate_config.yaml and run launch.sh on every node")
    return out


def _windows(config) -> dict:
    return {"window_pattern": config.window_pattern, "sliding_window": config.sliding_window}
