"""`PretrainingArguments`: `TrainingArguments` plus the switches of hf_pretrain.

Every `TrainingArguments` field keeps its meaning, so `HfArgumentParser(PretrainingArguments)` takes
the same command line a transformers user already writes. Differences:
- `pretrain_extras` (default True): hf_pretrain's additions to the Trainer. Off, `PretrainTrainer`
  behaves exactly as `transformers.Trainer`.
- `include_num_input_tokens_seen` defaults to `"non_padding"` (with extras): tokens seen count
  real tokens.
- `attn_fallback` (`warn` | `error` | `ignore`): what the attention preflight does when a layer type
  runs on a slower kernel than the hardware allows (see `hf_pretrain.preflight.attention`).
- `peak_tflops` / `measure_peak_tflops`: the denominators of MFU (see `hf_pretrain.telemetry`).
- `precision` (+ `precision_scaling`, `precision_min_features`, `precision_keep_first_last`): a
  recipe of `hf_pretrain.precision` (fp32, bf16, fp8, te-fp8, te-mxfp8, te-nvfp4); it sets
  `bf16` itself, so accelerate's mixed precision follows.
- `ddp_find_unused_parameters` and `ddp_broadcast_buffers` default to False: every parameter is
  used and the only buffers (RoPE frequencies) are constant, so both would cost a step-time sync.
- `lr_scheduler_type` also takes hf_pretrain's `cosine_restarts` and `wsd` (see `schedules.py`),
  configured through `lr_scheduler_kwargs` like transformers' own.
- Optimizer and schedule defaults follow a common 7B pretraining recipe (`RECIPE_DEFAULTS`):
  peak learning rate 3e-4, warmup 0.8 % of the steps, cosine to 10 % of the peak
  (`cosine_restarts` without restarts), AdamW beta2 0.95, eps 1e-8, weight decay 0.1, gradient
  clipping 1.0. Any of them given explicitly wins; with `pretrain_extras=False` the unset ones take
  transformers' defaults, so that mode is `Trainer` with `TrainingArguments`, field for field.
- `loss_spike_action="rollback"` with `loss_spike_lr_factor` / `loss_spike_max_rollbacks`: see
  `loss_guard.py`.
- `torch_compile_scope` (`model` | `blocks`): with `--torch_compile`, compile the whole model or each
  decoder layer in place (`compile.py`); the first logs report the compile time (`preflight/compile.py`).
- `use_cpu` defaults to `None` = auto: True when torch sees no accelerator, so a CPU-only machine
  trains on CPU (gloo for several processes) without a flag.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from transformers import TrainingArguments


def accelerator_available() -> bool:
    return torch.accelerator.is_available() if hasattr(torch, "accelerator") else torch.cuda.is_available()


# A common 7B recipe (Llama 2 style; eps and clipping equal transformers' defaults).
RECIPE_DEFAULTS = {
    "learning_rate": 3e-4,
    "warmup_steps": 0.008,
    "lr_scheduler_type": "cosine_restarts",
    "adam_beta2": 0.95,
    "weight_decay": 0.1,
}
TRANSFORMERS_DEFAULTS = {
    "learning_rate": 5e-5,
    "warmup_steps": 0,
    "lr_scheduler_type": "linear",
    "adam_beta2": 0.999,
    "weight_decay": 0.0,
}


@dataclass
class PretrainingArguments(TrainingArguments):
    pretrain_extras: bool = field(
        default=True,
        metadata={
            "help": "hf_pretrain's additions (throughput logging, run checks). False: plain transformers.Trainer behaviour."
        },
    )
    include_num_input_tokens_seen: str | None = field(
        default=None,
        metadata={
            "help": "Count tokens seen: 'non_padding' (real tokens), 'all', or 'no'. Default: 'non_padding' "
            "with pretrain_extras, else transformers' 'no'."
        },
    )
    attn_fallback: str = field(
        default="warn",
        metadata={
            "help": "When a layer type runs on a slower attention kernel than this hardware allows: 'warn' (print, log "
            "and write preflight.json), 'error' (refuse to start), 'ignore'."
        },
    )
    peak_tflops: float | None = field(
        default=None,
        metadata={"help": "Dense peak TFLOP/s of one device for MFU, when the spec table does not know this chip."},
    )
    measure_peak_tflops: bool = field(
        default=True, metadata={"help": "Measure a matmul ceiling at start-up for MFU against the reachable peak."}
    )
    precision: str | None = field(
        default=None,
        metadata={
            "help": "Precision recipe: fp32, bf16, fp8 (torchao), te-fp8, te-mxfp8, te-nvfp4. Default: the "
            "bf16/fp16 flags as given."
        },
    )
    precision_scaling: str | None = field(
        default=None, metadata={"help": "fp8: tensorwise (default) or rowwise; te-fp8: current (default) or delayed."}
    )
    precision_min_features: int = field(default=64, metadata={"help": "Convert only linears at least this wide."})
    precision_keep_first_last: bool = field(
        default=False, metadata={"help": "Keep the first and last decoder blocks in high precision."}
    )
    learning_rate: float | None = field(
        default=None,
        metadata={"help": "Peak learning rate. Default 3e-4 (7B recipe); transformers' 5e-5 without extras."},
    )
    warmup_steps: float | None = field(
        default=None,
        metadata={
            "help": "Warmup steps (>= 1) or fraction of training (< 1). Default 0.008 (0.8 percent); 0 without extras."
        },
    )
    weight_decay: float | None = field(
        default=None, metadata={"help": "AdamW weight decay. Default 0.1 (7B recipe); 0 without extras."}
    )
    adam_beta2: float | None = field(
        default=None, metadata={"help": "AdamW beta2. Default 0.95 (7B recipe); 0.999 without extras."}
    )
    lr_scheduler_type: str | None = field(
        default=None,
        metadata={
            "help": "transformers' schedules, or hf_pretrain's 'cosine_restarts' / 'wsd' (options in lr_scheduler_kwargs). "
            "Default: cosine_restarts (warmup, cosine to 10 percent of the peak); transformers' 'linear' without extras."
        },
    )
    pretrain_schedule: str | None = field(
        default=None,
        metadata={"help": "Set from lr_scheduler_type when it names an hf_pretrain schedule (cosine_restarts, wsd)."},
    )
    loss_guard: bool = field(
        default=True, metadata={"help": "Skip updates with a NaN/inf loss or gradient; watch for loss spikes."}
    )
    loss_spike_factor: float = field(default=3.0, metadata={"help": "A spike: loss above this x the running median."})
    loss_spike_window: int = field(default=20, metadata={"help": "Good steps in the running median."})
    loss_spike_action: str = field(
        default="log",
        metadata={
            "help": "On a spike: log, skip (the update), stop, or rollback (to the newest checkpoint, lower LR)."
        },
    )
    loss_spike_lr_factor: float = field(
        default=0.5, metadata={"help": "rollback: multiply the learning rate by this at each roll-back."}
    )
    loss_spike_max_rollbacks: int = field(
        default=3, metadata={"help": "rollback: stop with LossSpikeError after this many roll-backs."}
    )
    telemetry: bool = field(
        default=True,
        metadata={"help": "Hardware sensors, under-clock and straggler detection, and OUTPUT_DIR/telemetry.jsonl."},
    )
    underclock_threshold: float = field(
        default=0.6, metadata={"help": "Warn when the SM clock under load is below this fraction of its maximum."}
    )
    straggler_every: int = field(default=20, metadata={"help": "Optimizer steps between straggler exchanges."})
    straggler_threshold: float = field(
        default=0.75, metadata={"help": "Flag a rank whose speed score (best compute / its compute) is below this."}
    )
    eval_lm_metrics: bool = field(
        default=True,
        metadata={
            "help": "evaluate() reports eval_perplexity and eval_next_token_accuracy, reduced per batch (no logits "
            "kept), when no compute_metrics is given. Needs prediction_loss_only=False."
        },
    )
    probe_prompts: list[str] | None = field(
        default=None,
        metadata={
            "help": "Generation probe: prompts completed greedily every probe_every steps; 'prompt=>answer' adds an "
            "expected answer scored by exact match (probe_exact_match)."
        },
    )
    probe_every: int = field(
        default=0, metadata={"help": "Optimizer steps between generation probes (0: only at the last step)."}
    )
    probe_max_new_tokens: int = field(default=16, metadata={"help": "Tokens generated per probe prompt."})
    probe_at_end: bool = field(default=True, metadata={"help": "Also probe at the last step."})
    ddp_find_unused_parameters: bool | None = field(
        default=False,
        metadata={"help": "DDP: search for unused parameters every step (needed only when some go unused)."},
    )
    ddp_broadcast_buffers: bool | None = field(
        default=False,
        metadata={
            "help": "DDP: broadcast buffers at every forward. The model's buffers (RoPE) are constant; the "
            "broadcast would also hide a straggler's delay inside the other ranks' forward."
        },
    )
    torch_compile_scope: str = field(
        default="model",
        metadata={
            "help": "With torch_compile: 'model' (the whole model, transformers' way) or 'blocks' (each decoder layer "
            "compiled in place: compile time flat with depth). See hf_pretrain/training/compile.py."
        },
    )
    use_cpu: bool | None = field(
        default=None,
        metadata={"help": "Train on CPU. Default: auto, True when no GPU/accelerator is visible."},
    )

    def __post_init__(self):
        if self.torch_compile_scope not in ("model", "blocks"):
            raise ValueError(f"torch_compile_scope={self.torch_compile_scope!r} is invalid; use 'model' or 'blocks'.")
        if self.attn_fallback not in ("warn", "error", "ignore"):
            raise ValueError(f"attn_fallback={self.attn_fallback!r} is invalid; use 'warn', 'error' or 'ignore'.")
        if self.precision is not None:
            from ..precision import RECIPES

            if self.precision not in RECIPES:
                raise ValueError(f"precision={self.precision!r} is invalid; use one of {list(RECIPES)}.")
            if not self.pretrain_extras and self.precision not in ("fp32", "bf16"):
                raise ValueError(
                    f"precision={self.precision!r} is applied by PretrainTrainer's extras: keep pretrain_extras=True."
                )
            # Autocast around the low-precision linears: bf16 on a GPU; on a CPU fp8 is emulated around fp32.
            self.bf16 = self.precision == "bf16" or (self.precision != "fp32" and accelerator_available())
            self.fp16 = False
        defaults = RECIPE_DEFAULTS if self.pretrain_extras else TRANSFORMERS_DEFAULTS
        for name, value in defaults.items():
            if getattr(self, name) is None:
                setattr(self, name, value)
        from .schedules import SCHEDULES

        if self.lr_scheduler_type in SCHEDULES:
            self.pretrain_schedule = self.lr_scheduler_type
        if self.pretrain_schedule is not None and self.pretrain_schedule not in SCHEDULES:
            raise ValueError(f"pretrain_schedule={self.pretrain_schedule!r} is invalid; use one of {list(SCHEDULES)}.")
        if self.pretrain_schedule:  # transformers validates the name against its own list: PretrainTrainer builds ours
            self.lr_scheduler_type = "constant"
        if self.include_num_input_tokens_seen is None:
            self.include_num_input_tokens_seen = "non_padding" if self.pretrain_extras else "no"
        if self.probe_prompts and self.probe_every < 0:
            raise ValueError(
                f"probe_every={self.probe_every} is invalid; use >= 1, or 0 to probe only at the last step."
            )
        if self.use_cpu is None:  # extras off: transformers' default
            self.use_cpu = not accelerator_available() if self.pretrain_extras else False
        super().__post_init__()
