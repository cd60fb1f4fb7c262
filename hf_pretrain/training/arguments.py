"""`PretrainingArguments`: `TrainingArguments` plus the switches of hf_pretrain.

Every `TrainingArguments` field keeps its meaning, so `HfArgumentParser(PretrainingArguments)` takes
the same command line a transformers user already writes. Differences:
- `pretrain_extras` (default True): hf_pretrain's additions to the Trainer. Off, `PretrainTrainer`
  behaves exactly as `transformers.Trainer`.
- `include_num_input_tokens_seen` defaults to `"non_padding"` (with extras): tokens seen count
  real tokens.
- `attn_fallback` (`warn` | `error` | `ignore`): what the attention preflight does when a layer type
  runs on a slower kernel than the hardware allows (see `hf_pretrain.preflight.attention`).
- `memory_preflight` (`error` | `warn` | `ignore`): what happens when the run's estimated memory
  exceeds what its device or host has free (`hf_pretrain.preflight.memory`).
- `peak_tflops` / `measure_peak_tflops`: the denominators of MFU (see `hf_pretrain.telemetry.throughput`).
- `precision` (+ `precision_scaling`, `precision_min_features`, `precision_keep_first_last`): a
  recipe of `hf_pretrain.precision` (fp32, bf16, fp8, te-fp8, te-mxfp8, te-nvfp4); it sets
  `bf16` itself, so accelerate's mixed precision follows.
- `ddp_find_unused_parameters` and `ddp_broadcast_buffers` default to False: every parameter is
  used and the only buffers (RoPE frequencies) are constant, so both would cost a step-time sync.
- `lr_scheduler_type` also takes hf_pretrain's `cosine_restarts` and `wsd` (see `schedules.py`),
  configured through `lr_scheduler_kwargs` like transformers' own.
- Optimizer and schedule defaults follow a common 7B pretraining run (`PRETRAIN_OPTIMIZER_DEFAULTS`):
  peak learning rate 3e-4, warmup 0.8 % of the steps, cosine to 10 % of the peak
  (`cosine_restarts` without restarts), AdamW beta2 0.95, eps 1e-8, weight decay 0.1, gradient
  clipping 1.0. Any of them given explicitly wins; with `pretrain_extras=False` the unset ones take
  transformers' defaults, so that mode is `Trainer` with `TrainingArguments`, field for field.
- `loss_spike_action="rollback"` with `loss_spike_lr_factor` / `loss_spike_max_rollbacks`: see
  `loss_guard.py`.
- `optim` also takes hf_pretrain's `muon` (`optimizers.py`: Muon for the hidden matrices, AdamW for
  embeddings, head, norms, biases and routers), tuned by `muon_lr`, `muon_momentum` and
  `muon_adjust_lr`; it sets `pretrain_optimizer` and leaves `optim` at `adamw_torch` (transformers
  validates `optim` against its own list, as with `lr_scheduler_type`).
- `torch_compile_scope` (`model` | `blocks`): with `--torch_compile`, compile the whole model or each
  decoder layer in place (`compile.py`); the first logs report the compile time (`telemetry/compile.py`).
- `use_cpu` defaults to `None` = auto: True when torch sees no accelerator, so a CPU-only machine
  trains on CPU (gloo for several processes) without a flag.
- `parallelism_config` with `tp_size` or `cp_size` > 1 is refused on a CPU in one line (accelerate and torch
  support them only on GPUs; docs/distributed.md); `sp_size` > 1 (DeepSpeed Ulysses) needs DeepSpeed and a
  multiple of sp_size processes (`sequence_parallel.py`).
- `async_checkpoint` (default True): checkpoints written in the background (`resume/background.py`); the hang
  watchdog (`hang_watchdog`, `hang_timeout_*`) and the restart-loop guard (`restart_same_failure_limit`): see
  `recovery/`. `resume_from_checkpoint` also takes `"auto"` (the newest whole checkpoint, or a fresh start).

A script's data flags beside these (the example's `DataArguments`) are its own; `--mixture`'s checks are shared:
`check_mixture_flags` refuses what contradicts it before any data work, `mixture_tokenizer` names the one tokenizer
of its prepared sources.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import TrainingArguments
from transformers.utils import logging

from ..callback import PretrainCallback
from ..data.mixture import MixtureConfig
from ..data.prepared import tokenizer_path
from ..evaluation.downstream.callback import DownstreamEvalCallback
from ..evaluation.generation_probe import GenerationProbeCallback
from ..precision.convert import MIN_FEATURES
from ..telemetry.hardware import HardwareSensorsCallback
from ..telemetry.straggler import StragglerCallback
from ..telemetry.throughput import ThroughputCallback
from ..telemetry.underclock import UnderclockCallback
from .loss_guard import LossGuardCallback
from .recovery.attempts import restart_rendezvous_warning
from .recovery.room import RecoveryCallback
from .recovery.watchdog import flight_recorder_environment
from .resume.background import ASYNC_CHECKPOINT_DEFAULT
from .sequence_parallel import check_arguments as check_sequence_parallel

logger = logging.get_logger(__name__)


def owned(owner: type[PretrainCallback], name: str, help: str):
    """A field whose default its callback owns (`PretrainCallback.arguments`)."""
    return field(default=owner.arguments[name], metadata={"help": help})


def accelerator_available() -> bool:
    return torch.accelerator.is_available() if hasattr(torch, "accelerator") else torch.cuda.is_available()


# Optimizer and schedule defaults of a common 7B pretraining run (Llama 2 style; eps and clipping: transformers').
PRETRAIN_OPTIMIZER_DEFAULTS = {
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
    memory_preflight: str = field(
        default="error",
        metadata={
            "help": "Before the first step, the run's estimated memory against what the device or host has free: "
            "'error' (refuse a run that does not fit, naming the fixes), 'warn', 'ignore'."
        },
    )
    peak_tflops: float | None = owned(
        ThroughputCallback,
        "peak_tflops",
        "Dense peak TFLOP/s of one device for MFU, when the spec table does not know this chip.",
    )
    measure_peak_tflops: bool = owned(
        ThroughputCallback,
        "measure_peak_tflops",
        "Measure a matmul ceiling at start-up for MFU against the reachable peak.",
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
    precision_min_features: int = field(
        default=MIN_FEATURES, metadata={"help": "Convert only linears at least this wide."}
    )
    precision_keep_first_last: bool = field(
        default=False, metadata={"help": "Keep the first and last decoder blocks in high precision."}
    )
    learning_rate: float | None = field(
        default=None,
        metadata={"help": "Peak learning rate. Default 3e-4 (7B pretraining); transformers' 5e-5 without extras."},
    )
    warmup_steps: float | None = field(
        default=None,
        metadata={
            "help": "Warmup steps (>= 1) or fraction of training (< 1). Default 0.008 (0.8 percent); 0 without extras."
        },
    )
    weight_decay: float | None = field(
        default=None, metadata={"help": "AdamW weight decay. Default 0.1 (7B pretraining); 0 without extras."}
    )
    adam_beta2: float | None = field(
        default=None, metadata={"help": "AdamW beta2. Default 0.95 (7B pretraining); 0.999 without extras."}
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
    loss_guard: bool = owned(
        LossGuardCallback, "loss_guard", "Skip updates with a NaN/inf loss or gradient; watch for loss spikes."
    )
    loss_spike_factor: float = owned(
        LossGuardCallback, "loss_spike_factor", "A spike: loss above this x the running median."
    )
    loss_spike_window: int = owned(LossGuardCallback, "loss_spike_window", "Good steps in the running median.")
    loss_spike_action: str = owned(
        LossGuardCallback,
        "loss_spike_action",
        "On a spike: log, skip (the update), stop, or rollback (to the newest checkpoint, lower LR).",
    )
    loss_spike_lr_factor: float = owned(
        LossGuardCallback, "loss_spike_lr_factor", "rollback: multiply the learning rate by this at each roll-back."
    )
    loss_spike_max_rollbacks: int = owned(
        LossGuardCallback,
        "loss_spike_max_rollbacks",
        "rollback: stop with LossSpikeError after this many roll-backs.",
    )
    telemetry: bool = owned(
        HardwareSensorsCallback,
        "telemetry",
        "Hardware sensors, under-clock and straggler detection, and OUTPUT_DIR/telemetry.jsonl.",
    )
    underclock_threshold: float = owned(
        UnderclockCallback,
        "underclock_threshold",
        "Warn when the SM clock under load is below this fraction of its maximum.",
    )
    straggler_every: int = owned(StragglerCallback, "straggler_every", "Optimizer steps between straggler exchanges.")
    straggler_threshold: float = owned(
        StragglerCallback,
        "straggler_threshold",
        "Flag a rank whose speed score (best compute / its compute) is below this.",
    )
    eval_lm_metrics: bool = field(
        default=True,
        metadata={
            "help": "evaluate() reports eval_perplexity and eval_next_token_accuracy, reduced per batch (no logits "
            "kept), when no compute_metrics is given. Needs prediction_loss_only=False."
        },
    )
    probe_prompts: list[str] | None = owned(
        GenerationProbeCallback,
        "probe_prompts",
        "Generation probe: prompts completed greedily every probe_every steps; 'prompt=>answer' adds an "
        "expected answer scored by exact match (probe_exact_match).",
    )
    probe_every: int = owned(
        GenerationProbeCallback, "probe_every", "Optimizer steps between generation probes (0: only at the last step)."
    )
    probe_max_new_tokens: int = owned(
        GenerationProbeCallback, "probe_max_new_tokens", "Tokens generated per probe prompt."
    )
    probe_at_end: bool = owned(GenerationProbeCallback, "probe_at_end", "Also probe at the last step.")
    downstream_tasks: str | None = owned(
        DownstreamEvalCallback,
        "downstream_tasks",
        "Downstream benchmarks scored during training: comma-separated (hellaswag,arc_easy,piqa,...), 'default' or "
        "'all' (docs/evaluation.md).",
    )
    downstream_every: int = owned(
        DownstreamEvalCallback,
        "downstream_every",
        "Optimizer steps between downstream evaluations (0: only at the end).",
    )
    downstream_examples: int = owned(
        DownstreamEvalCallback, "downstream_examples", "Examples a task: a fixed seeded subset (0: every example)."
    )
    downstream_shots: int = owned(DownstreamEvalCallback, "downstream_shots", "Few-shot examples (fixed, seeded).")
    downstream_at_end: bool = owned(DownstreamEvalCallback, "downstream_at_end", "Also evaluate at the last step.")
    downstream_batch_tokens: int = owned(
        DownstreamEvalCallback, "downstream_batch_tokens", "Tokens per forward of the downstream evaluation."
    )
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
    optim: str = field(
        default=TrainingArguments.default_optim,
        metadata={"help": "transformers' optimizers (OptimizerNames, e.g. adamw_torch), or hf_pretrain's 'muon'."},
    )
    pretrain_optimizer: str | None = field(
        default=None,
        metadata={"help": "Set from optim when it names an hf_pretrain optimizer (muon)."},
    )
    muon_lr: float | None = field(
        default=None,
        metadata={"help": "optim=muon: learning rate of the hidden matrices. Default: learning_rate."},
    )
    muon_momentum: float | None = field(default=None, metadata={"help": "optim=muon: Muon's momentum. Default 0.95."})
    muon_adjust_lr: str | None = field(
        default=None,
        metadata={
            "help": "optim=muon: per-shape lr rule, 'match_rms_adamw' (default: lr x 0.2 sqrt(max(rows, cols)), "
            "AdamW's rate carries over) or 'original' (lr x sqrt(max(1, rows/cols)), lr about 0.02)."
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
    async_checkpoint: bool = field(
        default=ASYNC_CHECKPOINT_DEFAULT,
        metadata={
            "help": "Checkpoints stall the training loop only while the state is copied into host memory (pinned "
            "with CUDA; the weights and optimizer states beside the next step's forward and backward, its update "
            "waiting for the copy); the files are written and renamed into place in the background. Falls back to "
            "synchronous saves (saying why) with push_to_hub, load_best_model_at_end, or too little host memory."
        },
    )
    hang_watchdog: bool | None = owned(
        RecoveryCallback,
        "hang_watchdog",
        "Exit (so a launcher with --max_restarts restarts the run) after dumping every thread's stack when no "
        "optimizer step completes within the timeout. Default: on with several processes or restarts allowed.",
    )
    hang_timeout_factor: float = owned(
        RecoveryCallback,
        "hang_timeout_factor",
        "Hang timeout: this x the median step time (at least hang_timeout_min_s).",
    )
    hang_timeout_min_s: float = owned(RecoveryCallback, "hang_timeout_min_s", "Hang timeout: the least, in seconds.")
    hang_timeout_floor_s: float | None = owned(
        RecoveryCallback,
        "hang_timeout_floor_s",
        "Hang timeout during the first steps (compilation, start-up), saves and evaluations, in seconds. Default: "
        "ddp_timeout less 60 s (NCCL's own watchdog aborts at ddp_timeout, without stacks: ours fires first).",
    )
    restart_same_failure_limit: int = owned(
        RecoveryCallback,
        "restart_same_failure_limit",
        "Stop restarting once this many attempts in a row failed the same way at the same step (0: never stop).",
    )

    def __post_init__(self):
        if self.torch_compile_scope not in ("model", "blocks"):
            raise ValueError(f"torch_compile_scope={self.torch_compile_scope!r} is invalid; use 'model' or 'blocks'.")
        if self.memory_preflight not in ("error", "warn", "ignore"):
            raise ValueError(f"memory_preflight={self.memory_preflight!r} is invalid; use 'error', 'warn' or 'ignore'.")
        if self.attn_fallback not in ("warn", "error", "ignore"):
            raise ValueError(f"attn_fallback={self.attn_fallback!r} is invalid; use 'warn', 'error' or 'ignore'.")
        if self.precision is not None:
            from ..precision.recipes import RECIPES

            recipe = RECIPES.get(self.precision)
            if recipe is None:
                raise ValueError(f"precision={self.precision!r} is invalid; use one of {list(RECIPES)}.")
            if not self.pretrain_extras and recipe.converts_linears:
                raise ValueError(
                    f"precision={self.precision!r} is applied by PretrainTrainer's extras: keep pretrain_extras=True."
                )
            # Autocast around the low-precision linears: bf16 on a GPU; on a CPU fp8 is emulated around fp32.
            self.bf16 = recipe.autocast == "bf16" and (recipe.autocast_on_cpu or accelerator_available())
            self.fp16 = False
        defaults = PRETRAIN_OPTIMIZER_DEFAULTS if self.pretrain_extras else TRANSFORMERS_DEFAULTS
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
        self._resolve_optimizer()
        self._check_values()
        if self.include_num_input_tokens_seen is None:
            self.include_num_input_tokens_seen = "non_padding" if self.pretrain_extras else "no"
        if self.probe_prompts and self.probe_every < 0:
            raise ValueError(
                f"probe_every={self.probe_every} is invalid; use >= 1, or 0 to probe only at the last step."
            )
        if self.downstream_tasks:
            from ..evaluation.downstream.tasks import resolve_tasks

            resolve_tasks(self.downstream_tasks)  # an unknown name is refused now, listing the available ones
        if self.use_cpu is None:  # extras off: transformers' default
            self.use_cpu = not accelerator_available() if self.pretrain_extras else False
        self._check_parallelism()
        if self.pretrain_extras and (warning := restart_rendezvous_warning()) and os.environ.get("RANK", "0") == "0":
            logger.warning(warning)  # before the process group starts: a restarted one fails right there
        if self.pretrain_extras:  # before the process group starts: NCCL reads them then
            os.environ.update(flight_recorder_environment(self.output_dir))
        super().__post_init__()

    def _check_values(self) -> None:
        """Values transformers would refuse only later, deep in a traceback (a sampler, a division, the optimizer,
        the first save): refused here, in one line naming the flag and the fix."""
        for name in ("per_device_train_batch_size", "per_device_eval_batch_size", "gradient_accumulation_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name} {value} is invalid: use a whole number >= 1 (e.g. --{name} 8).")
        if self.learning_rate < 0:
            raise ValueError(
                f"--learning_rate {self.learning_rate:g} is invalid: a learning rate is not negative (e.g. 3e-4; 0 trains nothing)."
            )
        if self.output_dir is not None and os.path.exists(self.output_dir) and not os.path.isdir(self.output_dir):
            raise ValueError(
                f"--output_dir {self.output_dir} is a file, not a folder: pass a folder path (it is created if missing)."
            )

    def _check_parallelism(self) -> None:
        """Tensor and context parallelism on CPU processes fail deep in accelerate or torch: refused here, one line.
        Measured on torch 2.13 CPU, accelerate 1.16 (docs/distributed.md): a TP-sharded model (DTensor over gloo) runs
        forward and backward, but accelerate refuses any ParallelismConfig under DistributedType.MULTI_CPU; torch's context
        parallel has no sharding rule for the CPU SDPA kernel. DeepSpeed Ulysses (`sp_size`) runs on gloo."""
        check_sequence_parallel(self)  # sequence_parallel.py: SP without DeepSpeed, or not dividing the processes
        config = self.parallelism_config
        if config is None and os.environ.get("ACCELERATE_USE_PARALLELISM_CONFIG", "false").lower() == "true":
            from accelerate import ParallelismConfig

            config = ParallelismConfig()  # what accelerate builds from the launch config's parallelism_config_*
        if config is None or not self.use_cpu:
            return
        why = {
            "tp_size": "accelerate refuses a ParallelismConfig on CPU processes (DistributedType.MULTI_CPU)",
            "cp_size": "torch's context parallel shards only the GPU SDPA kernels "
            "(aten._scaled_dot_product_flash_attention_for_cpu has no sharding strategy)",
        }
        for name, reason in why.items():
            if getattr(config, name) > 1:
                raise ValueError(
                    f"parallelism_config.{name}={getattr(config, name)} needs GPUs: {reason}; "
                    f"set {name}=1 on a CPU (docs/distributed.md)."
                )

    def _resolve_optimizer(self) -> None:
        """`optim="muon"` -> `pretrain_optimizer`; an unknown name refused here, in one line."""
        from transformers.training_args import OptimizerNames

        from .optimizers import MUON_OPTIMIZERS, MuonConfig

        name = self.optim.value if isinstance(self.optim, OptimizerNames) else self.optim
        if name in MUON_OPTIMIZERS:
            self.pretrain_optimizer, self.optim = name, "adamw_torch"  # the AdamW side is torch's AdamW
        elif name not in {o.value for o in OptimizerNames}:
            raise ValueError(
                f"optim={name!r} is invalid; use 'muon' (hf_pretrain) or one of transformers' OptimizerNames, "
                "e.g. 'adamw_torch'."
            )
        if self.pretrain_optimizer is None:
            return
        if self.pretrain_optimizer not in MUON_OPTIMIZERS:
            raise ValueError(
                f"pretrain_optimizer={self.pretrain_optimizer!r} is invalid; use one of {list(MUON_OPTIMIZERS)}."
            )
        if not self.pretrain_extras:
            raise ValueError(
                f"optim={self.pretrain_optimizer!r} is built by PretrainTrainer's extras: keep pretrain_extras=True."
            )
        MuonConfig.from_arguments(self)  # its settings checked now, not at train()


def check_mixture_flags(mixture: str, dataset_path: str | None = None) -> None:
    """--mixture reads sources already prepared: a missing file, a bad config or --dataset_path beside it is one
    error line, before any data work."""
    if not Path(mixture).is_file():
        raise FileNotFoundError(f"--mixture {mixture!r} is not a file; give a mixture JSON file.")
    if dataset_path:
        raise ValueError("--mixture and --dataset_path exclude each other: add the dataset as a source of the mixture.")
    MixtureConfig.from_file(mixture)


def mixture_tokenizer(config: MixtureConfig, tokenizer_name_or_path: str | None = None) -> str:
    """The one tokenizer the mixture's prepared sources were tokenized with (or --tokenizer_name_or_path when no
    source is a `prepare` folder); sources tokenized differently are refused, since their ids would not agree."""
    found = {}
    for name, source in config.sources.items():
        try:  # a prepare output folder, local or at a URL (its tokenizer downloaded once)
            folder = tokenizer_path(source["path"])
        except FileNotFoundError:
            continue  # a save_to_disk source: no tokenizer of its own
        found[name] = (folder, (folder / "tokenizer.json").read_bytes())
    if len({vocab for _, vocab in found.values()}) > 1:
        raise ValueError(
            f"--mixture: the sources {sorted(found)} were tokenized by different tokenizers; prepare every source with "
            "one tokenizer (`tokenizer: {path: ...}` in each prepare config) so their ids agree."
        )
    if tokenizer_name_or_path:
        return tokenizer_name_or_path
    if not found:
        raise ValueError(
            "--mixture: no source is a prepare output folder holding its tokenizer; give --tokenizer_name_or_path."
        )
    return str(next(iter(found.values()))[0])
