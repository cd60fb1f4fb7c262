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

The shape family. `shape(layers, ...)` builds a Llama-style `PretrainConfig`: width about `aspect` x layers
(default 96, between nanochat's 64 and Llama 2 7B's 128: Kaplan et al. 2020, arXiv 2001.08361, figure 5,
found the loss moves only a few percent over a wide range of width / depth), rounded so heads are even;
head_dim 128 (64 below width 1024), grouped-query attention with 4 query heads per KV head where the head
count allows (2 otherwise; plain multi-head below 8 heads), SwiGLU width 8/3 of the hidden size rounded up to
a multiple of 256, untied embeddings - the recipe of the presets in `presets.py`. A size is matched by the
depth whose shape comes closest (in log) to the target.
"""

from __future__ import annotations

import math

from ..modeling.accounting import count_parameters, flops_per_token
from ..modeling.configuration import PretrainConfig

CHINCHILLA_TOKENS_PER_PARAM = 20.0
MAX_USEFUL_EPOCHS = 4.0
MAX_PLANNED_EPOCHS = 60.0  # Muennighoff et al.'s R* = 15.4: 1 - exp(-59 / 15.4) = 98 % of the data's worth
DEFAULT_ASPECT = 96
LAYERS = range(2, 161)  # 2 layers (a few M parameters) to 160 (hundreds of B at the default aspect)


def deepseek_batch_tokens(compute: float) -> float:
    """DeepSeek LLM's near-optimal global batch in tokens for a non-embedding compute budget C (FLOPs)."""
    return 0.2920 * compute**0.3271


def deepseek_peak_lr(compute: float) -> float:
    """DeepSeek LLM's near-optimal peak learning rate for a non-embedding compute budget C (FLOPs)."""
    return 0.3118 * compute**-0.1250


def non_embedding_flops_per_token(config, seq_len: int) -> float:
    """DeepSeek's M: training FLOPs per token without the LM head (the package's formula minus 6 x d x V)."""
    return flops_per_token(config, seq_len) - 6 * config.hidden_size * config.vocab_size


def shape(
    layers: int,
    vocab_size: int,
    seq_len: int,
    aspect: int = DEFAULT_ASPECT,
    window_pattern: str = "L",
    sliding_window: int | None = None,
) -> PretrainConfig:
    """The family's `PretrainConfig` with `layers` decoder layers (see the module docstring)."""
    step = 256 if aspect * layers >= 1024 else 128
    width = max(step, step * round(aspect * layers / step))
    head_dim = 128 if width >= 1024 else 64
    heads = width // head_dim
    kv_heads = heads if heads < 8 else heads // 4 if heads % 4 == 0 else heads // 2
    return PretrainConfig(
        vocab_size=vocab_size,
        hidden_size=width,
        intermediate_size=256 * math.ceil(8 * width / 3 / 256),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=seq_len,
        window_pattern=window_pattern,
        sliding_window=sliding_window if "S" in window_pattern else None,
    )


def closest_shape(target: float, measure, **shape_args) -> PretrainConfig:
    """The shape whose `measure(config)` is closest to `target` in log; ValueError when the family cannot reach it
    (the message says what the nearest end of the family measures)."""
    smallest, largest = (shape(layers, **shape_args) for layers in (LAYERS[0], LAYERS[-1]))
    if target < measure(smallest) / 1.5 or target > measure(largest) * 1.5:
        end, which = (smallest, "smallest") if target < measure(smallest) else (largest, "largest")
        raise ShapeOutOfRange(end, which)
    best = min(LAYERS, key=lambda n: abs(math.log(measure(shape(n, **shape_args)) / target)))
    return shape(best, **shape_args)


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
