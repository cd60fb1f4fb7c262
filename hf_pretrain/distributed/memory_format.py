"""`format_estimate`: a `MemoryEstimate` (`memory.py`) as one screen of text, each line naming its formula."""

from __future__ import annotations

from .memory import BYTES_PER_PARAMETER, GiB, MemoryEstimate


def _checkpointing_label(checkpointing: bool | int) -> str:
    if checkpointing is True or checkpointing == 1:
        return "full activation checkpointing"
    return f"activation checkpointing every {checkpointing} layers" if checkpointing else "no activation checkpointing"


def format_estimate(estimate: MemoryEstimate) -> str:
    """One screen: each component per GPU in GiB and GB (10^9 bytes) with its formula, the total and the verdict."""
    est = estimate
    weight, grad, optim, e = BYTES_PER_PARAMETER[est.precision]
    unit_bytes = weight + grad  # a gathered unit, in the compute dtype
    if est.fsdp2:  # fp32 shards: the master weights, their gradients, Adam's m and v
        weight, grad, optim = 4, 4, 8
    n, dp = est.gpus, est.gpus // est.tp  # ZeRO partitions over the data-parallel ranks (all of them without TP)
    split = {k: f" / {n}" if est.zero >= stage and n > 1 else "" for k, stage in (("p", 3), ("g", 2), ("o", 1))}
    psi = "Psi"
    if est.tp > 1:  # AutoTP: a rank's share of the parameters, ZeRO over gpus / tp
        psi = f"Psi_tp {est.parameters // weight:,}" if weight else "Psi_tp"
        split = {k: f" / {dp}" if est.zero >= stage and dp > 1 else "" for k, stage in (("g", 2), ("o", 1))}
        split["p"] = ""
    optim_what = "fp32 master, Adam m, v" if optim == 12 else "Adam m, v"
    if est.fsdp2:
        optim_what += "; the fp32 shards are the master"
    tokens = f"{est.seq_len} x {est.micro_batch}" if est.sp == 1 else f"{est.seq_len}/{est.sp} x {est.micro_batch}"
    if est.checkpointing is True:
        activations = f"L x {tokens} x {e} B x h (layer inputs) + one layer"
    elif est.checkpointing:
        activations = f"checkpointed layers' inputs ({tokens} x {e} B x h each) + one layer + the other layers"
    else:
        kernel = "flash" if est.flash_attention else "softmax kept"
        activations = f"{est.num_layers} x {tokens} x {est.layer_bytes_per_token:,} B/token ({kernel}) + final norm"
    rows = [
        ("parameters", est.parameters, f"{weight} B x {psi}{split['p']}" + (" -> CPU" if not est.parameters else "")),
        ("gradients", est.gradients, f"{grad} B x {'Psi_tp' if est.tp > 1 else 'Psi'}{split['g']}"),
    ]
    if est.gradient_partition_fp32:
        rows.append(
            (
                "fp32 grad partition",
                est.gradient_partition_fp32,
                f"4 B x {'Psi_tp' if est.tp > 1 else 'Psi'} / {dp}, in the step only: total takes max(it, activations + loss + gathered)",
            )
        )
    rows += [
        (
            "optimizer states",
            est.optimizer_states,
            f"{optim} B x {'Psi_tp' if est.tp > 1 else 'Psi'}{split['o']} ({optim_what})"
            + (" -> CPU" if est.offload else ""),
        ),
        ("activations", est.activations, activations),
        (
            "logits / loss",
            est.logits,
            "chunked: one chunk of fp32 logits + the head's weight grad (no full logits)"
            if est.chunked_loss
            else f"12 B x {tokens} x V (fp32 log-probs, their grad, logits' grad)",
        ),
    ]
    if est.attention_mask:
        rows.append(("attention masks", est.attention_mask, f"{est.micro_batch} x s^2 x (1 B + {e} B per SDPA layer)"))
    if est.zero3_gathered:
        name = "FSDP2 gathered" if est.fsdp2 else "ZeRO-3 gathered"
        rows.append((name, est.zero3_gathered, f"{unit_bytes} B x largest layer or vocab matrix"))
    head = (
        f"{est.model}: {est.num_parameters / 1e9:.3f} B parameters (Psi), {est.precision}, "
        f"{'FSDP2' if est.fsdp2 else f'ZeRO-{est.zero}'} over {n} GPU"
        f"{'s' if n > 1 else ''}{', CPU offload' if est.offload else ''}"
        f"{f', Ulysses SP {est.sp} (1/{est.sp} of each sequence per GPU)' if est.sp > 1 else ''}"
        f"{f', AutoTP {est.tp} (ZeRO over {dp} data-parallel GPUs)' if est.tp > 1 else ''}\n"
        f"sequence {est.seq_len} x micro-batch {est.micro_batch}, "
        f"{'flash attention' if est.flash_attention else 'no flash attention'}, "
        f"{_checkpointing_label(est.checkpointing)}\n"
    )
    width = 96

    def line(name: str, value: int, text: str = "") -> str:
        return f"{name:<20}{value / GiB:>8.2f}{value / 1e9:>8.2f}   {text}".rstrip()

    lines = [head, f"{'per GPU':<20}{'GiB':>8}{'GB':>8}   formula", "-" * width]
    lines += [line(name, value, formula) for name, value, formula in rows]
    lines += ["-" * width, line("total", est.total)]
    if est.device_bytes is not None:
        lines.append(line("device", est.device_bytes, est.device))
        lines.append(line("free", est.free_bytes, est.verdict))
    if est.offload:
        lines.append(line("CPU per rank", est.cpu_bytes, "host memory for each GPU's rank (x ranks per node)"))
    lines += [f"note: {note}" for note in est.notes]
    lines.append(
        "not counted: CUDA context (~0.5-1 GiB), fragmentation, NCCL/DeepSpeed buckets, kernel workspaces "
        "(docs/memory.md)"
    )
    return "\n".join(lines)
