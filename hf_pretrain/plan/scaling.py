"""Compute-optimal sizing: the published fits the planner uses, and the family of shapes it builds models from.

The fits, each with its source (the numbers below are the papers', not ours):

- **Tokens per parameter** (Hoffmann et al. 2022, "Training Compute-Optimal Large Language Models",
  arXiv 2203.15556): a compute-optimal run trains about 20 tokens per parameter. Parameters are counted in
  total, embeddings included, as Chinchilla counted them (Pearce & Song 2024, "Reconciling Kaplan and
  Chinchilla Scaling Laws", arXiv 2406.12907). The ratio is a flag (`--tokens-per-param`): DeepSeek LLM found
  the optimum moves towards larger models on cleaner data, and small models meant for cheap inference are
  often trained far past 20.
- **Batch size and peak learning rate in compute** (DeepSeek-AI 2024, "DeepSeek LLM: Scaling Open-Source
  Language Models with Longtermism", arXiv 2401.02954, section 3.1, equation 1), fitted on grid searches at
  small budgets and checked at 7B and 67B:

      B_opt = 0.2920 * C ** 0.3271   (tokens per optimizer step)
      eta_opt = 0.3118 * C ** -0.1250

  C is the paper's compute budget M x D: M the *non-embedding* FLOPs per token (6 x the non-embedding matmul
  weights + attention over the causal half of the context), D the training tokens. Here M is
  `modeling.accounting.flops_per_token` without the LM head (6 x d x V): the same definition. The fits reproduce
  the paper's own choices (7B: 2304 x 4096 tokens, 4.2e-4; 67B: 4608 x 4096 tokens, 3.2e-4) within 10 %
  (tests/test_plan.py). They were fitted with a multi-step schedule; the paper reports a wide band of
  near-optimal values around them, so rounding the batch to what the GPUs give costs little.
- **Repeated data** (Muennighoff et al. 2023, "Scaling Data-Constrained Language Models", arXiv 2305.16264):
  up to about 4 epochs, repeated tokens are worth almost as much as unique ones; beyond, their value fades
  (the planner warns past `MAX_USEFUL_EPOCHS`). Their fit (equation 5) counts U unique tokens seen for E
  epochs as worth U (1 + R* (1 - exp(-(E - 1) / R*))) unique ones, R* = 15.4: at 60 epochs 98 % of what the
  data can ever be worth is reached, so a plan past `MAX_PLANNED_EPOCHS` spends its compute on data worth
  nothing more, and is refused.

The shape family: Llama-style `PretrainConfig`s on a grid of (depth, width), thinned to one shape per 5 % of
parameters (`family`). Widths are whole attention heads: head_dim 128 (64 below width 1024), and the width steps by
the most heads (1, 2, 4 or 8) that keep a step within a quarter of the width, so the head count is a multiple of 8
from width 4096 up (4096: 32 heads, 5120: 40, 8192: 64 - Llama 2/3, OLMo 2, Qwen 2.5/3), of 4 from 2048 (3072: 24,
Llama 3.2 3B; 3584: 28, Qwen 2.5 7B), even from 512 (768: 12 heads of 64, GPT-2 small). Key/value heads: the
largest power of two up to 8 that divides the heads and leaves at least 2 query heads on each (8 from 16 heads
on, as Llama 3 / Qwen 3 at 8B and 70B; 28 heads -> 4, as Qwen 2.5 7B; plain multi-head below 8 heads), so every
sequence-parallel (and tensor-parallel) degree of 2, 4 or 8 that divides the heads splits the key/value heads or
repeats them evenly. SwiGLU width 8/3 of the hidden size rounded up to a multiple of 256, untied embeddings: the
recipe of the presets in `presets.py`.
The grid keeps the aspect (width / depth) within 64-128 (nanochat's 64 to Llama 2 7B's 128; Kaplan et al. 2020,
arXiv 2001.08361, figure 5: the loss moves only a few percent over a wide range of width / depth); in each 5 %
band of parameters the shape whose aspect is nearest `DEFAULT_ASPECT` (96) represents it. A single width per
depth would leave gaps of up to 1.8x in parameters where the width steps by whole heads (3072 -> 4096 wide);
the grid fills them with a deeper or shallower neighbour. A size is matched by the family member whose measure
comes closest (in log) to the target: 7B -> 37 x 4096 (32 heads, 8 KV), 8B -> 42 x 4096, 70B -> 100 x 8192
(64 heads, 8 KV) at a 65536 vocabulary.
"""

from __future__ import annotations

import bisect
import functools
import math
from types import SimpleNamespace

from ..modeling.accounting import count_parameters, flops_per_token
from ..modeling.configuration import PretrainConfig

CHINCHILLA_TOKENS_PER_PARAM = 20.0
MAX_USEFUL_EPOCHS = 4.0
MAX_PLANNED_EPOCHS = 60.0  # Muennighoff et al.'s R* = 15.4: 1 - exp(-59 / 15.4) = 98 % of the data's worth
DEFAULT_ASPECT = 96
ASPECTS = (64, 128)  # the width / depth band of the grid
LAYERS = range(2, 161)  # 2 layers (a few M parameters) to 160 (hundreds of B)
FAMILY_STEP = 1.05  # one shape per 5 % of parameters


def deepseek_batch_tokens(compute: float) -> float:
    """DeepSeek LLM's near-optimal global batch in tokens for a non-embedding compute budget C (FLOPs)."""
    return 0.2920 * compute**0.3271


def deepseek_peak_lr(compute: float) -> float:
    """DeepSeek LLM's near-optimal peak learning rate for a non-embedding compute budget C (FLOPs)."""
    return 0.3118 * compute**-0.1250


def non_embedding_flops_per_token(config, seq_len: int) -> float:
    """DeepSeek's M: training FLOPs per token without the LM head (the package's formula minus 6 x d x V)."""
    return flops_per_token(config, seq_len) - 6 * config.hidden_size * config.vocab_size


def widths(largest: int) -> list[int]:
    """The family's widths up to `largest`: whole heads, stepping by the most heads (1, 2, 4, 8) within a quarter
    of the width (module docstring)."""
    out, width = [], 64
    while width <= largest:
        out.append(width)
        head = 128 if width >= 1024 else 64
        width += max(n * head for n in (1, 2, 4, 8) if n * head <= max(head, width // 4))
    return out


def heads(width: int) -> tuple[int, int, int]:
    """(heads, key/value heads, head_dim) of a family width."""
    head_dim = 128 if width >= 1024 else 64
    n = width // head_dim
    kv = n if n < 8 else max(k for k in (1, 2, 4, 8) if not n % k and n // k >= 2)
    return n, kv, head_dim


def _dimensions(layers: int, width: int, vocab_size: int) -> dict:
    n, kv, head_dim = heads(width)
    return dict(
        vocab_size=vocab_size,
        hidden_size=width,
        intermediate_size=256 * math.ceil(8 * width / 3 / 256),
        num_hidden_layers=layers,
        num_attention_heads=n,
        num_key_value_heads=kv,
        head_dim=head_dim,
        tie_word_embeddings=False,
    )


def shape(
    layers: int,
    vocab_size: int,
    seq_len: int,
    aspect: int = DEFAULT_ASPECT,
    window_pattern: str = "L",
    sliding_window: int | None = None,
    width: int | None = None,
) -> PretrainConfig:
    """The `PretrainConfig` of `layers` decoder layers at `width` (default: the family width nearest `aspect` x
    layers); see the module docstring."""
    if width is None:
        target = aspect * layers
        width = min(widths(2 * target), key=lambda w: abs(math.log(w / target)))
    if width not in widths(width):
        raise ValueError(f"width {width} is not a family width (whole heads; see plan/scaling.py)")
    return PretrainConfig(
        **_dimensions(layers, width, vocab_size),
        max_position_embeddings=seq_len,
        window_pattern=window_pattern,
        sliding_window=sliding_window if "S" in window_pattern else None,
    )


@functools.lru_cache(maxsize=16)
def family_grid(vocab_size: int) -> tuple[tuple[int, int], ...]:
    """(layers, width) of the family, smallest first: per 5 % band of parameters, the grid point (aspect within
    `ASPECTS`) whose aspect is nearest `DEFAULT_ASPECT`. Parameters depend on the vocabulary only (not on the
    sequence or windows), so the grid is the same for every `shape_args` of one vocabulary."""
    low, high = ASPECTS
    best: dict[int, tuple[float, int, int, int]] = {}
    for width in widths(high * LAYERS[-1]):
        for layers in range(max(LAYERS[0], math.ceil(width / high)), min(LAYERS[-1], width // low) + 1):
            n = count_parameters(SimpleNamespace(**_dimensions(layers, width, vocab_size)))
            band = math.floor(math.log(n) / math.log(FAMILY_STEP))
            point = (abs(math.log(width / layers / DEFAULT_ASPECT)), n, layers, width)
            best[band] = min(best.get(band, point), point)
    return tuple((layers, width) for _, _, layers, width in sorted(best.values(), key=lambda p: p[1]))


def family(vocab_size: int, seq_len: int, window_pattern: str = "L", sliding_window: int | None = None):
    """The family's `PretrainConfig`s, smallest first (`family_grid`)."""
    shape_args = dict(
        vocab_size=vocab_size, seq_len=seq_len, window_pattern=window_pattern, sliding_window=sliding_window
    )
    return [_member(point, shape_args) for point in family_grid(vocab_size)]


def closest_shape(target: float, measure, **shape_args) -> PretrainConfig:
    """The family member whose `measure(config)` is closest to `target` in log, then the whole depth at its width
    that comes closest; ValueError when the family cannot reach it (the message says what the nearest end of the
    family measures). The measure grows along the family (parameters, FLOPs): bisected, then the neighbours."""
    grid = family_grid(shape_args["vocab_size"])
    member = functools.cache(lambda i: _member(grid[i], shape_args))
    smallest, largest = member(0), member(len(grid) - 1)
    if target < measure(smallest) / 1.5 or target > measure(largest) * 1.5:
        end, which = (smallest, "smallest") if target < measure(smallest) else (largest, "largest")
        raise ShapeOutOfRange(end, which)
    index = bisect.bisect_left(range(len(grid)), target, key=lambda i: measure(member(i)))
    near = range(max(0, index - 3), min(len(grid), index + 3))
    nearest = min((member(i) for i in near), key=lambda c: abs(math.log(measure(c) / target)))
    width, low, high = nearest.hidden_size, *ASPECTS  # whole depths at that width: finer than the 5 % bands
    depths = range(max(LAYERS[0], math.ceil(width / high)), min(LAYERS[-1], width // low) + 1)
    return min(
        (_member((n, width), shape_args) for n in depths if abs(n - nearest.num_hidden_layers) <= 3),
        key=lambda c: abs(math.log(measure(c) / target)),
    )


def _member(point: tuple[int, int], shape_args: dict) -> PretrainConfig:
    layers, width = point
    return shape(layers, **shape_args, width=width)


class ShapeOutOfRange(ValueError):
    """The target lies beyond the family's smallest or largest shape; `config` is that end of the family."""

    def __init__(self, config: PretrainConfig, which: str):
        super().__init__(which)
        self.config, self.which = config, which


def shape_for_parameters(parameters: float, **shape_args) -> PretrainConfig:
    """The shape with about `parameters` weights in total (embeddings included)."""
    return closest_shape(parameters, count_parameters, **shape_args)


def compute_optimal_shape(compute: float, tokens_per_param: float, seq_len: int, **shape_args) -> PretrainConfig:
    """The shape whose run of `tokens_per_param` x its parameters costs `compute` training FLOPs (the package's
    FLOPs per token, attention and windows included)."""

    def cost(config) -> float:
        return flops_per_token(config, seq_len) * tokens_per_param * count_parameters(config)

    return closest_shape(compute, cost, seq_len=seq_len, **shape_args)
