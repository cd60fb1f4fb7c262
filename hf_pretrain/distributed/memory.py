"""Per-GPU training memory of a `PretrainConfig` under DDP, ZeRO 1-3 and FSDP2: model states, activations, loss.

`estimate_memory(config, zero, gpus, precision, seq_len, micro_batch, ...)` returns a `MemoryEstimate` in
bytes per GPU; `format_estimate` (`memory_format.py`) prints it as one screen; `hf-pretrain estimate-memory`
(`hf_pretrain/estimate_memory.py`, an application) is its command line. Every number is a formula of the
config (no model is built), so it prices a 7B on a laptop:
- model states: each recipe's `bytes_per_parameter` (precision/recipes.py) times the parameters
  (`modeling/accounting.py`), divided over the GPUs as ZeRO or FSDP2 shard them (Rajbhandari et al. 2020),
  plus DeepSpeed's fp32 gradient partition inside the step and the one unit ZeRO-3 / FSDP2 gather in full;
- activations: what this model's autograd graph saves per token and layer (Korthikanti et al. 2022 count a
  GPT layer; this one has RMSNorm, RoPE, GQA, SwiGLU), with full or every-k-th-layer checkpointing;
- the loss: the fp32 logits, log-probabilities and their gradients, or one chunk of them (the chunked loss);
- sequence parallelism (DeepSpeed Ulysses, `sp`): each rank holds the activations and the loss of its 1/sp of the
  sequence; the attention's all-to-all hands it the whole sequence for 1/sp of the heads, the same bytes (more
  where `sp` exceeds the key/value heads, which Ulysses then repeats). While one layer's exchange runs its shard's
  q, k, v are alive beside the exchanged ones: not priced, as that layer's MLP has saved nothing yet (forward) or
  already freed what it saved (backward), more than those buffers (measured: benchmarks/sequence_parallel.py).
  Weights and optimizer states do not change (ZeRO-3 shards them over all the ranks, `gpus`).
- tensor parallelism (DeepSpeed AutoTP, `tp`; training/tensor_parallel.py says what it splits): a rank holds
  1/tp of q/k/v/o and of a dense layer's gate/up/down (and of a tied embedding, vocabulary-parallel), and the rest
  whole: norms, an untied embedding and head, the MoE router and experts (`tp_parameters`). ZeRO-1/2 then partition
  that share over the data-parallel group, `gpus / tp` ranks (DeepSpeed's `seq_data_parallel_group`, built by
  `groups._init_tp_mesh_device` as (gpus / tp) x tp); ZeRO-3 is refused under AutoTP, as the trainer does. In the
  activations the attention's q, k, v, scores and output and a dense MLP's intermediates are 1/tp (a rank's heads and
  columns, rounded up: the largest rank); the residual stream, the norms, a layer's checkpointed input, RoPE, the
  dense masks and an untied head's loss are whole (every rank holds the whole sequence). A tied head's loss is
  DeepSpeed's vocabulary-parallel one on full logits (the chunked loss steps aside): 1/tp of them
  (measured: benchmarks/tensor_parallel.py).
`total` adds the larger of (activations + loss + gathered unit) and the step's fp32 gradient partition (never
alive together). The formulas, their derivation, the real runs that checked them, what is left out: docs/memory.md.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from ..chips import device_memory_bytes, known_chips
from ..modeling.accounting import attention_widths, count_parameters, head_dim, layer_parameters, mlp_kinds
from ..precision.recipes import FP16, RECIPES, Recipe

GiB = 1024**3

# precision -> (weight bytes, gradient bytes, optimizer-state bytes per parameter, activation element bytes): each
# recipe's own `bytes_per_parameter` (precision/recipes.py), and transformers' `fp16=True`
PRICED: dict[str, Recipe] = {**RECIPES, FP16.name: FP16}
BYTES_PER_PARAMETER: dict[str, tuple[int, int, int, int]] = {name: r.bytes_per_parameter for name, r in PRICED.items()}
PRECISIONS = tuple(BYTES_PER_PARAMETER)


@dataclass
class MemoryEstimate:
    """Bytes per GPU (and per rank on the host) of one training step; the formulas are in docs/memory.md."""

    model: str
    num_parameters: int
    zero: int
    gpus: int
    precision: str
    seq_len: int
    micro_batch: int
    offload: bool
    checkpointing: bool | int  # True: every layer; k: every k-th layer
    flash_attention: bool
    parameters: int
    gradients: int
    optimizer_states: int
    activations: int
    logits: int
    zero3_gathered: int
    cpu_bytes: int
    gradient_partition_fp32: int = 0  # DeepSpeed ZeRO >= 1, mixed precision: 4 B x Psi / N (docs/memory.md)
    num_layers: int = 0
    layer_bytes_per_token: int = 0  # what one decoder layer saves per token (the activations' unit)
    device: str | None = None
    device_bytes: int | None = None
    notes: list[str] = field(default_factory=list)
    chunked_loss: bool = True  # the loss from the hidden states in chunks (modeling/loss.py), no full logits
    fsdp2: bool = False  # FSDP2 (fully_shard) rather than DeepSpeed ZeRO-3 (docs/memory.md)
    attention_mask: int = 0  # dense s x s masks of SDPA layers (`attention_mask_bytes`)
    sp: int = 1  # sequence-parallel (Ulysses) degree: each rank holds 1/sp of every sequence's activations
    tp: int = 1  # tensor-parallel (AutoTP) degree: each rank holds 1/tp of the split linears and their activations

    @property
    def model_states(self) -> int:
        return self.parameters + self.gradients + self.gradient_partition_fp32 + self.optimizer_states

    @property
    def total(self) -> int:
        """The step's peak: persistent states + the larger of backward's working set and the step's fp32 gradients."""
        persistent = self.parameters + self.gradients + self.optimizer_states
        working = self.activations + self.attention_mask + self.logits + self.zero3_gathered
        return persistent + max(working, self.gradient_partition_fp32)

    @property
    def free_bytes(self) -> int | None:
        return None if self.device_bytes is None else self.device_bytes - self.total

    @property
    def fits(self) -> bool | None:
        return None if self.device_bytes is None else self.free_bytes >= 0

    @property
    def verdict(self) -> str:
        if self.device_bytes is None:
            return "no device given"
        margin = self.free_bytes / self.device_bytes
        word = "fits" if self.fits else "does not fit"
        return f"{word}: {self.free_bytes / GiB:+.2f} GiB ({margin:+.1%} of the device)"

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out.update(
            model_states=self.model_states,
            total=self.total,
            free_bytes=self.free_bytes,
            fits=self.fits,
            verdict=self.verdict,
        )
        return out


def _norm_bytes_per_token(h: int, e: int) -> int:
    """One RMSNorm: its input upcast to fp32, the normalised tensor, the output, the fp32 inverse RMS."""
    return 4 * h + 2 * e * h + 4


def layer_activation_bytes_per_token(
    config,
    seq_len: int,
    precision: str = "bf16",
    flash_attention: bool = True,
    kind: str = "dense",
    sp: int = 1,
    tp: int = 1,
):
    """Bytes one decoder layer saves for backward, per token (docs/memory.md, "Activations"). An MoE layer saves
    the SwiGLU intermediates of its k experts per token plus the fp32 router logits (dispatch indices and
    gathered copies of the tokens are left out: approximate). Under sequence parallelism `sp` (per token of a
    rank's shard; `seq_len` is the whole sequence) the attention keeps the whole sequence of 1/sp of the heads:
    the same bytes per token, except keys and values where `sp` exceeds their heads (`ulysses_kv_width`). Under
    tensor parallelism `tp` the attention and a dense MLP hold this rank's heads and columns (`tp_shard`); the
    norms and an MoE layer's experts (whole on every rank) do not change."""
    e = BYTES_PER_PARAMETER[precision][3]
    h, inter, d = config.hidden_size, tp_shard(config.intermediate_size, tp), head_dim(config)
    heads = tp_shard(config.num_attention_heads, tp)
    q, k = heads * d, ulysses_kv_width(config, sp)
    if tp > 1:
        k = tp_shard(k // d, tp) * d
    norms = 2 * _norm_bytes_per_token(h, e)
    if flash_attention:
        attention = e * (2 * q + 2 * k) + 4 * heads  # q, k, v, output; fp32 log-sum-exp per head
    else:
        scores = heads * seq_len * (4 + (e if e != 4 else 0))  # fp32 softmax (+ its cast to e)
        attention = e * 4 * q + scores  # q, repeated k and v, output
    if kind == "sparse":
        width = config.moe_intermediate_size or config.intermediate_size
        return norms + attention + config.num_experts_per_tok * 4 * e * width + 4 * config.num_experts
    return norms + attention + 4 * e * inter


def tp_shard(size: int, tp: int) -> int:
    """A rank's share of `size` heads or MLP columns split over `tp` ranks: the largest one's (rounded up)."""
    return -(-size // tp)


def tp_parameters(config, tp: int = 1) -> int:
    """Parameters one rank holds under AutoTP of `tp` (module docstring): 1/tp of q/k/v/o, of a dense layer's
    gate/up/down and of a tied embedding (vocabulary-parallel, rounded up), the rest whole."""
    psi = count_parameters(config)
    if tp == 1:
        return psi
    h, q, k = config.hidden_size, *attention_widths(config)
    bias = getattr(config, "attention_bias", False)
    attention = h * q + 2 * h * k + q * h + (q + 2 * k if bias else 0)  # o_proj's bias is whole
    mlp = 3 * h * config.intermediate_size + (2 * config.intermediate_size if getattr(config, "mlp_bias", False) else 0)
    split = sum(attention + (mlp if kind == "dense" else 0) for kind in mlp_kinds(config))
    if config.tie_word_embeddings:
        split += config.vocab_size * h
    return psi - split + tp_shard(split, tp)


def ulysses_kv_width(config, sp: int = 1) -> int:
    """The key (or value) width one token of a rank's shard costs in attention under Ulysses SP: the model's,
    unless `sp` exceeds the key/value heads; then DeepSpeed repeats them so that each rank receives one head
    (`kv_replication_factor`), `sp x head_dim` per token of the shard."""
    k = attention_widths(config)[1]
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return k if sp <= kv_heads else sp * head_dim(config)


def activation_bytes(
    config,
    seq_len: int,
    micro_batch: int,
    precision: str = "bf16",
    checkpointing: bool | int = False,
    flash_attention: bool = True,
    sp: int = 1,
    tp: int = 1,
) -> int:
    """Peak saved-for-backward bytes of the decoder stack (embedding output to the final norm), one micro-batch,
    per rank: under sequence parallelism `sp` each rank holds `seq_len / sp` tokens of each row; under tensor
    parallelism `tp` its share of each layer's heads and MLP columns (`layer_activation_bytes_per_token`).

    `checkpointing`: False, True (every layer) or k (every k-th layer, layers 0, k, 2k, ...: transformers'
    `every_n_layers`). A checkpointed layer keeps only its input (e*h per token) from forward to backward and
    rebuilds its working set in backward, one layer at a time; the other layers keep theirs. Checked against the
    tensors autograd saves (tests/training/test_activation_checkpointing.py: within 1 % in fp32 at no, full,
    every-2 and every-3 checkpointing).
    """
    e = BYTES_PER_PARAMETER[precision][3]
    tokens = seq_len * micro_batch // sp
    layers = [
        layer_activation_bytes_per_token(config, seq_len, precision, flash_attention, kind, sp, tp) * tokens
        for kind in mlp_kinds(config)
    ]
    every = int(checkpointing)  # True -> 1 (every layer), False -> 0 (none)
    if every < 0:
        raise ValueError(f"checkpointing={checkpointing!r} is invalid; use False, True or every k-th layer (k >= 1).")
    recomputed = [b for i, b in enumerate(layers) if every and i % every == 0]
    kept = [b for i, b in enumerate(layers) if not (every and i % every == 0)]
    inputs = len(recomputed) * e * config.hidden_size * tokens
    stack = sum(kept) + inputs + max(recomputed, default=0)
    final_norm = _norm_bytes_per_token(config.hidden_size, e) * tokens
    rope = 2 * seq_len // sp * head_dim(config) * e  # cos and sin of this rank's positions
    return stack + final_norm + rope


def attention_mask_bytes(seq_len: int, micro_batch: int, precision: str, dense_mask_layers: int) -> int:
    """The dense s x s masks of layers whose kernel takes one (SDPA on windows or packed documents): the boolean
    mask the model builds (1 byte an element), and the copy in the activation dtype each such layer's SDPA makes
    and saves for backward. Measured on a CPU (torch 2.13, tiny preset, 8K tokens packed, 4 layers): 17.4 bytes
    per element of s x s against 1 + 4 x 4 = 17 priced."""
    if not dense_mask_layers:
        return 0
    return micro_batch * seq_len**2 * (1 + BYTES_PER_PARAMETER[precision][3] * dense_mask_layers)


def logits_bytes(config, seq_len: int, micro_batch: int, chunked: bool | None = None) -> int:
    """What the loss holds beyond the activations.

    Unfused (`config.chunked_loss=False`): the fp32 log-probs saved by the cross-entropy, their gradient and
    the logits' gradient, 12 x s x b x V. Chunked (the default, `modeling/loss.py`): one chunk of fp32 logits
    and the head's weight gradient held from forward to backward; the hidden states' gradient held with it
    takes the place of the head's saved input, which the activations already count."""
    tokens = seq_len * micro_batch
    if getattr(config, "chunked_loss", True) if chunked is None else chunked:
        from ..modeling.loss import chunked_loss_bytes  # (torch-free import of this module kept for the CLI)

        return chunked_loss_bytes(config.vocab_size, config.hidden_size, tokens) - 4 * tokens * config.hidden_size
    return 12 * tokens * config.vocab_size


def check_tp(tp: int, gpus: int, zero: int, fsdp2: bool = False, sp: int = 1) -> None:
    """The one-line refusal of a `tp` the estimator (and the trainer, training/tensor_parallel.py) cannot price."""
    if not isinstance(tp, int) or tp < 1 or gpus % tp:
        raise ValueError(f"tp={tp!r} is invalid: it must be a positive divisor of gpus={gpus}.")
    if tp > 1 and (zero == 3 or fsdp2):
        raise ValueError(
            f"tp={tp} with {'FSDP2' if fsdp2 else 'ZeRO-3'}: AutoTP runs under ZeRO 0, 1 or 2 only (the trainer "
            "refuses ZeRO-3 under it); pass zero=1 (ds_configs/zero1_autotp.json)."
        )
    if tp > 1 and sp > 1:
        raise ValueError(f"tp={tp} with sp={sp}: AutoTP and Ulysses SP are not run together; use one of the two.")


def estimate_memory(
    config,
    zero: int,
    gpus: int,
    precision: str = "bf16",
    seq_len: int | None = None,
    micro_batch: int = 1,
    offload: bool = False,
    checkpointing: bool | int = False,
    flash_attention: bool = True,
    *,
    device: str | None = None,
    device_memory_gb: float | None = None,
    model: str | None = None,
    fsdp2: bool = False,
    dense_mask_layers: int = 0,
    sp: int = 1,
    tp: int = 1,
) -> MemoryEstimate:
    """Per-GPU bytes of training `config` with ZeRO stage `zero` over `gpus` GPUs (formulas: docs/memory.md).

    `seq_len` defaults to the config's `max_position_embeddings`. `device` names a GPU of the chip table
    (`hf_pretrain/chips.py`: e.g. "H100", "A100-40GB", or `torch.cuda.get_device_name()`); `device_memory_gb`
    (GiB, the unit card names use) overrides it. `fsdp2=True` (with `zero=3`) prices FSDP2's layout instead
    of DeepSpeed's. `dense_mask_layers`: layers whose kernel reads a dense s x s mask (`attention_mask_bytes`).
    `sp`: the Ulysses sequence-parallel degree (a divisor of `gpus` and of `seq_len`): activations and the loss
    per rank of 1/sp of each sequence; `gpus` stays every rank (ZeRO-3 shards over them all). `tp`: the AutoTP
    degree (a divisor of `gpus`; ZeRO 0-2, no FSDP2, no SP): each rank's share of the split weights, partitioned by
    ZeRO over the `gpus / tp` data-parallel ranks, and of the attention's and MLP's activations.
    """
    if zero not in (0, 1, 2, 3):
        raise ValueError(f"zero={zero!r} is invalid: use a ZeRO stage 0, 1, 2 or 3.")
    if not isinstance(gpus, int) or gpus < 1:
        raise ValueError(f"gpus={gpus!r} is invalid: it must be a positive integer.")
    if precision not in BYTES_PER_PARAMETER:
        raise ValueError(f"precision={precision!r} is unknown; use one of {list(PRECISIONS)}.")
    if offload and zero == 0:
        raise ValueError("offload=True needs ZeRO >= 1 (DeepSpeed offloads the partitioned optimizer states).")
    if fsdp2 and (zero != 3 or offload):
        raise ValueError(
            f"fsdp2=True with zero={zero}, offload={offload}: FSDP2 shards weights, gradients and optimizer states "
            "(pass zero=3) and its CPU offload is not modelled (pass offload=False)."
        )
    seq_len = seq_len or config.max_position_embeddings
    if seq_len < 1 or micro_batch < 1:
        raise ValueError(f"seq_len={seq_len} and micro_batch={micro_batch} must be positive.")
    if not isinstance(sp, int) or sp < 1 or gpus % sp or seq_len % sp:
        raise ValueError(f"sp={sp!r} is invalid: it must divide gpus={gpus} and seq_len={seq_len}.")
    check_tp(tp, gpus, zero, fsdp2, sp)

    weight, grad, optim, _ = BYTES_PER_PARAMETER[precision]
    psi, share, dp = count_parameters(config), tp_parameters(config, tp), gpus // tp  # ZeRO partitions over dp
    parameters = weight * share // (gpus if zero >= 3 else 1)
    gradients = grad * share // (dp if zero >= 2 else 1)
    optimizer_states = optim * share // (dp if zero >= 1 else 1)
    largest_unit = max(
        *(layer_parameters(config, kind) for kind in mlp_kinds(config)), config.vocab_size * config.hidden_size
    )
    zero3_gathered = (weight + grad) * largest_unit if zero == 3 and gpus > 1 else 0
    mixed = weight < 4  # 16-bit weights with fp32 master states
    gradient_partition_fp32 = 4 * share // dp if zero >= 1 and mixed and not offload else 0
    chunked_loss, no_chunked_loss = getattr(config, "chunked_loss", True), None
    if chunked_loss:  # priced as the model will run it: only where the op (or Liger) is there (modeling/loss.py)
        from ..modeling.loss import unavailable_reason  # (torch-free import of this module kept for the CLI)

        no_chunked_loss = unavailable_reason("cuda")
        chunked_loss = no_chunked_loss is None
    vocab_parallel = tp > 1 and config.tie_word_embeddings  # DeepSpeed's vocabulary-parallel head and loss
    if vocab_parallel:
        chunked_loss, no_chunked_loss = False, None
    if fsdp2:  # the sharded fp32 parameter is the master; gradients in its dtype; only the unit computes in 16-bit
        parameters, gradients, optimizer_states = 4 * psi // gpus, 4 * psi // gpus, 8 * psi // gpus
        gradient_partition_fp32, chunked_loss = 0, False
    cpu_bytes = 0
    notes = []
    if offload:
        cpu_bytes = optimizer_states + 4 * share // dp  # states + the fp32 gradient partition CPU Adam reads
        optimizer_states = 0
        if zero == 3:
            cpu_bytes += parameters
            parameters = 0
    library = PRICED[precision].library
    if library is not None:  # low-precision linears: 16-bit weights, cast per matmul
        low = PRICED[precision].spec_key
        notes.append(
            f"{precision} ({library.label}): weights, gradients and activations priced as bf16; {low} copies are transient"
        )
    if not flash_attention:
        notes.append("no flash attention: the s x s softmax of every layer is kept for backward")
    if tp > 1:
        notes.append(
            f"AutoTP {tp}: {share:,} of the {psi:,} parameters per rank (attention and dense MLP linears split), "
            f"ZeRO over {dp} data-parallel rank{'s' if dp > 1 else ''}; activations of the heads and MLP columns 1/{tp}"
        )
    if vocab_parallel:
        notes.append(f"tied head under AutoTP: vocabulary-parallel, the loss on 1/{tp} of the full logits")
    if no_chunked_loss:
        notes.append(f"the full logits are priced: {no_chunked_loss}, so the model computes them")
    if fsdp2:
        notes.append(
            "FSDP2: fp32 shards are the master weights (16 B x Psi / N in every precision); the LM head is an "
            "FSDP unit, so the loss computes the full logits"
        )
    elif zero == 3 and gpus > 1:
        notes.append("ZeRO-3 gathered: one largest unit (layer or vocabulary matrix) in full, weights + gradient")

    device_bytes = None
    if device_memory_gb is not None:
        device_bytes = int(device_memory_gb * GiB)
    elif device is not None:
        device_bytes = device_memory_bytes(device)
        if device_bytes is None:
            known = known_chips("memory")
            raise ValueError(f"device={device!r} is not in the table {known}; pass device_memory_gb instead.")
    return MemoryEstimate(
        model=model or getattr(config, "name_or_path", "") or "config",
        num_parameters=psi,
        zero=zero,
        gpus=gpus,
        precision=precision,
        seq_len=seq_len,
        micro_batch=micro_batch,
        offload=offload,
        checkpointing=checkpointing,
        flash_attention=flash_attention,
        parameters=parameters,
        gradients=gradients,
        optimizer_states=optimizer_states,
        activations=activation_bytes(config, seq_len, micro_batch, precision, checkpointing, flash_attention, sp, tp),
        logits=logits_bytes(config, seq_len // sp, micro_batch, chunked_loss) // (tp if vocab_parallel else 1),
        chunked_loss=chunked_loss,
        fsdp2=fsdp2,
        attention_mask=attention_mask_bytes(seq_len, micro_batch, precision, dense_mask_layers),
        sp=sp,
        tp=tp,
        zero3_gathered=zero3_gathered,
        cpu_bytes=cpu_bytes,
        gradient_partition_fp32=gradient_partition_fp32,
        num_layers=config.num_hidden_layers,
        layer_bytes_per_token=layer_activation_bytes_per_token(
            config, seq_len, precision, flash_attention, sp=sp, tp=tp
        ),
        device=device if device_memory_gb is None else f"{device or 'device'} ({device_memory_gb:g} GiB)",
        device_bytes=device_bytes,
        notes=notes,
    )
