"""The LM head's cross-entropy without the logits: `causal_lm_loss` takes the final hidden states.

The unfused path (`lm_head`, then transformers' `ForCausalLMLoss`) holds the [tokens, V] logits, the fp32
log-probabilities and their gradients at the start of backward (12 B x tokens x V, docs/memory.md): more than the
rest of a small model's step. Here each chunk of tokens computes its logits, adds its loss and, in the same
forward, its gradients (the loss is a scalar at the end of the graph, so d logits = softmax - one_hot), then drops
the chunk; backward only scales the stored d hidden and d weight. So the head costs the unfused path's 3 matmuls,
at most one chunk of logits is alive, and `lm_head.weight` is read in the forward only (DeepSpeed ZeRO-3 gathers
it there as an external parameter). The price: no double backward, and d hidden and d weight live until backward.

No hand-written kernel or autograd (`implementation`: the one test the model and the memory estimator read):
Liger-Kernel's `LigerFusedLinearCrossEntropyLoss` on CUDA when installed (the head's weight gradient summed over its
chunks in fp32: Liger >= 0.6.2), else torch's `F.linear_cross_entropy` (torch >= 2.13; older: the full logits, with
a warning), whose chunks' weight gradients are summed in the input dtype (in bf16, within the recursive-summation
bound that tests/modeling/test_chunked_loss.py checks). Chunks (`chunk_rows`): `CHUNK_LOGITS` logits, but at least
512 tokens in whole 128-row GEMM tiles, so that a chunk is compute-bound although it re-reads the head. The math is
`ForCausalLMLoss`'s (labels shifted with `ignore_index`, fp32 softmax, divided by `num_items_in_batch` or the count
of targets); only the summation order differs. The alternatives and the chunk size: docs/model.md.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

CHUNK_LOGITS = 2**24  # logits per chunk: 64 MiB in fp32
MIN_CHUNK_ROWS = 512  # tokens, a multiple of GEMM_ROWS: each chunk re-reads the head (module docstring)
GEMM_ROWS = 128  # chunks are whole tiles of the tensor cores' GEMM kernels


def chunk_rows(vocab_size: int, tokens: int) -> int:
    """Tokens per chunk: `CHUNK_LOGITS` logits, at least `MIN_CHUNK_ROWS`, in multiples of `GEMM_ROWS`; at most
    all of the tokens."""
    rows = max(MIN_CHUNK_ROWS, CHUNK_LOGITS // vocab_size // GEMM_ROWS * GEMM_ROWS)
    return max(1, min(tokens, rows))


def chunked_loss_bytes(vocab_size: int, hidden_size: int, tokens: int) -> int:
    """Bytes of the chunked loss of `tokens` tokens in fp32, what a memory estimate should price instead of the
    logits: torch's one reused chunk of logits, plus d hidden [tokens, H] and d weight [V, H] held to the backward."""
    return 4 * (chunk_rows(vocab_size, tokens) * vocab_size + tokens * hidden_size + vocab_size * hidden_size)


def torch_has_chunked_cross_entropy() -> bool:
    """Whether the installed torch has the chunked `linear_cross_entropy` (torch >= 2.13)."""
    return hasattr(F, "linear_cross_entropy") and hasattr(nn, "LinearCrossEntropyOptions")


@functools.cache
def liger_loss_class() -> type | None:
    """Liger-Kernel's fused linear cross-entropy loss module, or None when it is not installed."""
    try:
        from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss
    except (ImportError, RuntimeError):  # not installed, or no Triton/driver to import it with
        return None
    return LigerFusedLinearCrossEntropyLoss


def implementation(device: torch.device | str) -> str:
    """Which fused implementation runs on `device`: "liger", "torch" or "none" (full logits)."""
    if torch.device(device).type == "cuda" and liger_loss_class() is not None:
        return "liger"
    return "torch" if torch_has_chunked_cross_entropy() else "none"


def unavailable_reason(device: torch.device | str) -> str | None:
    """Why the loss without logits cannot run on `device` with this torch (and Liger), or None when it can."""
    if implementation(device) != "none":
        return None
    liger = " and Liger-Kernel is not installed" if torch.device(device).type == "cuda" else ""
    return f"torch {torch.__version__} has no chunked linear_cross_entropy (torch >= 2.13){liger}"


def causal_targets(labels: torch.Tensor | None, shift_labels: torch.Tensor | None, ignore_index: int) -> torch.Tensor:
    """The next-token target of every position, flattened: labels shifted left, `ignore_index` last."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return shift_labels.reshape(-1)


def summed_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int):
    """Sum over non-ignored rows of cross_entropy(hidden @ weight.T, targets), chunked; hidden [N, H], targets [N]."""
    if implementation(hidden.device) == "liger":
        loss = liger_loss_class()(ignore_index=ignore_index, reduction="sum", accum_dtype=torch.float32)
        return loss(weight, hidden, targets)
    rows = chunk_rows(weight.shape[0], hidden.shape[0])
    options = nn.LinearCrossEntropyOptions(
        batch_chunk_size=rows,
        chunking_method=None,
        allow_retain_graph=torch.compiler.is_compiling(),  # torch forces it under compile (and warns)
    )
    return F.linear_cross_entropy(hidden, weight, targets, reduction="sum", ignore_index=ignore_index, options=options)


def causal_lm_loss(
    hidden_states: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor | None,
    num_items_in_batch: torch.Tensor | int | None = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor:
    """`ForCausalLMLoss(F.linear(hidden_states, weight), labels, ...)` without the logits.

    `hidden_states` [..., H] (the final norm's output), `weight` [V, H] (the bias-free LM head),
    `labels` [...] unshifted, or `shift_labels` already shifted; the other keyword arguments are
    those transformers passes to its loss and are ignored as it ignores them.
    """
    targets = causal_targets(labels, shift_labels, ignore_index).to(hidden_states.device)
    hidden = hidden_states.reshape(-1, hidden_states.shape[-1])
    if hidden.shape[0] != targets.shape[0]:
        raise ValueError(
            f"causal_lm_loss: {hidden.shape[0]} positions of hidden states but {targets.shape[0]} labels; "
            "labels must have the shape of input_ids (or shift_labels of the shifted labels)."
        )
    device = hidden.device.type
    if torch.is_autocast_enabled(device):  # what nn.Linear would compute under autocast
        dtype = torch.get_autocast_dtype(device)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    total = summed_cross_entropy(hidden, weight, targets, ignore_index).float()
    if num_items_in_batch is None:
        return total / (targets != ignore_index).sum()
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(total.device)
    return total / num_items_in_batch
