"""The LM head's cross-entropy without the logits: `causal_lm_loss` takes the final hidden states.

Why. The unfused path (`lm_head` then transformers' `ForCausalLMLoss`) materialises the logits
[tokens, V] and, through `cross_entropy`, the fp32 log-probabilities it saves for backward; backward
adds their gradient and the logits' gradient. At V = 32,768 and 4 x 1024 tokens each of these is
512 MiB in fp32, about 2 GiB alive at the start of backward: more than the whole rest of a small
model's step (docs/memory.md prices it as 12 B x tokens x V). Only one number per token is needed
(the target's log-probability) and only one gradient shape per chunk of tokens.

How. Three well-known ways to never hold the whole [tokens, V]:

1. per-chunk activation checkpointing (torchtune's chunked-output cross-entropy splits the head
   over token chunks; with a checkpoint per chunk nothing of a chunk survives its forward): each
   chunk's logits are computed in forward for the loss and again in backward for the gradients,
   so the head costs 4 matmuls instead of 3, and the head weight is needed again in backward;
2. a custom `autograd.Function` that saves only the inputs and recomputes each chunk's logits in
   backward: the same 4 matmuls and the same need for the weight in backward;
3. the gradient in the forward (Liger-Kernel's fused linear cross-entropy, after mgmalek's
   efficient_cross_entropy): the summed loss is a scalar at the end of the graph, so the gradient
   of a chunk's logits, softmax - one_hot(target) on the non-ignored rows, is known as soon as the
   chunk's softmax is. The forward computes each chunk's logits, adds its loss, computes
   d hidden (chunk) and accumulates d weight, then drops the chunk; backward only multiplies the two
   stored gradients by the incoming scalar.

hf_pretrain uses (3): 3 matmuls as in the unfused path (no recompute, so a step is not slower; on this
CPU it is faster, see docs/benchmarks.md), at most one chunk of logits alive, and the weight is read
in the forward only, which is what lets DeepSpeed ZeRO-3 work: the head module is not called, so its
gather hooks do not fire, but reading `lm_head.weight` inside the model's forward makes DeepSpeed
gather it as an "external parameter" of the running module (released after that forward), and
nothing in backward needs it (with (1) or (2) it would have to be gathered again there).
The costs of (3): d hidden [tokens, H] and d weight [V, H] are held from the forward to the
backward (one chunk of logits is bigger than d hidden, and d weight is the gradient the step
allocates anyway); gradients are computed in a forward that needs them (grad mode on and the
inputs requiring grad; not in evaluation); no double backward and no second `backward()` of the
same graph. Any function of the loss (scaling for accumulation, the MoE aux losses added, loss
scaling) is fine: backward scales by whatever gradient reaches the loss.

Which implementation (no hand-written kernel, no hand-written autograd):
- CUDA with Liger-Kernel installed (`pip install hf_pretrain[liger]`):
  `liger_kernel.transformers.LigerFusedLinearCrossEntropyLoss`, Triton kernels doing (3) in place.
- everywhere else: PyTorch's own `torch.nn.functional.linear_cross_entropy` with
  `LinearCrossEntropyOptions` (torch >= 2.13), which is (3) as a `torch.library` custom op (opaque
  to torch.compile, so no graph break). On an older torch the full logits are computed, with a
  warning naming the version.
Chunk size: `CHUNK_LOGITS` logits (2**24 = 64 MiB in fp32) per chunk, i.e. 512 tokens at V = 32,768,
whatever the batch. The peak of the head then stays flat as batch x sequence grows; smaller
chunks would mean more, thinner matmuls (torch's "aspect_ratio:2" heuristic picks 16 rows at
V = 32,768, H = 256, 2.7 x slower on this CPU than 512 rows; Liger sizes chunks to about the hidden
states' size).

Exactness: the math of `ForCausalLMLoss` — labels shifted by padding with `ignore_index` (or
`shift_labels` as given), logits upcast to fp32 for the softmax, sum over non-ignored tokens
divided by `num_items_in_batch` when the Trainer passes it (gradient accumulation, token-
normalised), else by the count of non-ignored tokens. Only the summation order differs (chunks),
~1e-7 relative in fp32. Under autocast the hidden states and weight are cast to the autocast dtype
first, as `nn.Linear` under autocast would (the logits in bf16, the softmax in fp32).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

CHUNK_LOGITS = 2**24  # logits per chunk: 64 MiB in fp32


def chunk_rows(vocab_size: int, tokens: int) -> int:
    """Tokens per chunk: `CHUNK_LOGITS` logits, at least 1 token, at most all of them."""
    return max(1, min(tokens, CHUNK_LOGITS // vocab_size))


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


def implementation(device: torch.device) -> str:
    """Which fused implementation runs on `device`: "liger", "torch" or "none" (full logits)."""
    if device.type == "cuda" and liger_loss_class() is not None:
        return "liger"
    return "torch" if torch_has_chunked_cross_entropy() else "none"


def causal_targets(labels: torch.Tensor | None, shift_labels: torch.Tensor | None, ignore_index: int) -> torch.Tensor:
    """The next-token target of every position, flattened: labels shifted left, `ignore_index` last."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    return shift_labels.reshape(-1)


def summed_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int):
    """Sum over non-ignored rows of cross_entropy(hidden @ weight.T, targets), chunked; hidden [N, H], targets [N]."""
    if implementation(hidden.device) == "liger":
        loss = liger_loss_class()(ignore_index=ignore_index, reduction="sum")
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
