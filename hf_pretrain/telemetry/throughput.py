"""`ThroughputCallback`: step time, tokens/s, model TFLOP/s and MFU against two peaks, and ETA.

Logged at every logging step (merged into the Trainer's logs by `PretrainTrainer`, so they reach
the console, `report_to` and the JSONL stream alike):

- `step_time_s`: mean time of the optimizer steps since the previous log, from step begin to step
  end, forward, backward and the optimizer included: CUDA events on a GPU (the device's own time,
  read a step or more later so that nothing waits for them: `telemetry/timing.py`), the host
  clock on a CPU. Never the time the host took to enqueue the kernels.
- `tokens_per_second`: real tokens of all ranks per second over that interval
- `tokens_per_second_per_rank`: the same divided by the world size
- `model_tflops_per_second_per_rank`: `flops_per_token` x tokens/s per rank
- `mfu_spec`: against the chip's spec peak for the run's GEMM precision (`chips.py`);
  left out, with one message asking for `peak_tflops`, when the chip or precision is unknown
- `mfu_measured`: against a large-matmul ceiling measured on this device at start-up in the same
  GEMM precision (fp8 recipes: fp8 `torch._scaled_mm`); left out, with one message, where the
  device has no native GEMM in that precision (fp8 emulated on a CPU or a pre-Ada GPU, fp4)
- `eta_seconds`: remaining optimizer steps x the interval's wall time per step (logging, evaluation
  and saving included)
- `mfu_spec_warning`, `mfu_measured_warning`: once, instead of an MFU above 1 (a peak below what the
  run reaches: a ceiling measured while the machine was busier, a wrong `peak_tflops`): such a
  figure is never logged

and once, at the first log: `peak_tflops_spec` (when known) and `peak_tflops_measured`.
Tokens come from `tokens_seen(state)` (PretrainTrainer passes its count of real tokens, which
needs no `include_num_input_tokens_seen`); when the batches carry no tokens (no `input_ids`) there is
no throughput and no MFU: they are left out rather than logged as 0. Without a sequence length (rows
without `input_ids`, a config without `max_position_embeddings`) there are no FLOPs, so no MFU.

One basis for both MFUs: numerator = model FLOPs (`modeling/accounting.py`: 6 x matmul parameters +
attention over the keys each query really sees, windows honoured per layer; recomputation under
activation checkpointing is not counted) x tokens per second per rank; denominator = one device's
dense peak in the precision the run's GEMMs really run in (`precision_of`: the recipe's for fp8/fp4
recipes, else the autocast dtype, else the dtype of the model's linear weights: a model cast to bf16
without `bf16=True` runs bf16 GEMMs): the spec sheet's for `mfu_spec`, the measured ceiling's for
`mfu_measured`.
With an fp8 recipe the attention and the LM head still run in bf16, so both MFUs read lower than
the same run would against a bf16 peak: compare recipes by tokens/s, and MFUs within one recipe.
With packed documents the real context is shorter than the block, so MFU is a slight
overestimate there.

Under Ulysses sequence parallelism (`training/sequence_parallel.py`) each rank trains its 1/sp shard of every row:
the token counts sum the shards over ranks, so each token counts once (the one process's count, checked in
tests/distributed/test_sequence_parallel.py), and the FLOPs per token are the whole row's (`sequence_length` reads
the dataset, not the shard: a rank's attention spans the whole sequence of its 1/sp of the heads). A rank does
1/sp of its rows' work, so tokens/s per rank (over every rank) x FLOPs per token is still each rank's share.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn
from transformers import TrainerState
from transformers.utils import logging

from ..callback import PretrainCallback
from ..chips import spec_tflops
from ..modeling.accounting import flops_per_token
from ..precision.recipes import TORCHAO, get_recipe
from .peaks import ceiling_dtype, device_name, matmul_ceiling
from .timing import DeviceClock, PendingIntervals

logger = logging.get_logger(__name__)


WEIGHT_PRECISIONS = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def precision_of(args, model=None) -> str:
    """The chip-table precision column of the run's matmuls: a low-precision recipe's `spec_key`, else the
    autocast dtype (the recipe's, `bf16`, `fp16`), else the dtype of `model`'s linear weights (fp32 without one)."""
    recipe = get_recipe(args.precision) if getattr(args, "precision", None) is not None else None
    if recipe is not None and recipe.converts_linears:
        return recipe.spec_key
    autocast = recipe.autocast if recipe is not None else "bf16" if args.bf16 else "fp16" if args.fp16 else None
    if autocast is not None:
        return autocast
    linears = (m for m in model.modules() if isinstance(m, nn.Linear)) if isinstance(model, nn.Module) else ()
    return WEIGHT_PRECISIONS.get(next((m.weight.dtype for m in linears), None), "fp32")


def torchao_scaling(args) -> str | None:
    """The torchao float8 recipe the run converts with (`precision_scaling`, `tensorwise` by default as in
    `apply_precision`), None when the run has no torchao float8 linears: what the fp8 ceiling accumulates like."""
    recipe = get_recipe(args.precision) if getattr(args, "precision", None) is not None else None
    if recipe is None or recipe.library is not TORCHAO:
        return None
    return getattr(args, "precision_scaling", None) or "tensorwise"


def sequence_length(trainer) -> int | None:
    """Tokens per row of the training data (the first row), else the model's maximum context, else None."""
    try:
        row = trainer.train_dataset[0]
        return len(row[getattr(trainer.model, "main_input_name", "input_ids")])
    except Exception:  # iterable or unusual datasets, rows without input ids: fall back to the config
        return getattr(getattr(trainer.model, "config", None), "max_position_embeddings", None)


class ThroughputCallback(PretrainCallback):
    keep_in_history = False  # read off clocks and sensors: differs between identical runs
    arguments = {"peak_tflops": None, "measure_peak_tflops": True}

    @classmethod
    def from_arguments(cls, trainer, built=()) -> ThroughputCallback:
        settings = cls.settings(trainer.args)
        tokens_seen = getattr(trainer, "tokens_seen", None)  # PretrainTrainer's own count: the arguments untouched
        return cls(sequence_length(trainer), settings["peak_tflops"], settings["measure_peak_tflops"], tokens_seen)

    def __init__(
        self,
        seq_len: int | None,
        peak_tflops: float | None = None,
        measure_ceiling: bool = True,
        tokens_seen: Callable[[TrainerState], int] | None = None,
    ):
        self.seq_len = seq_len  # None: the run's sequence length is unknown, so no FLOPs and no MFU
        self.peak_tflops = peak_tflops
        self.measure_ceiling = measure_ceiling
        self.tokens_seen = tokens_seen or (lambda state: state.num_input_tokens_seen)
        self.flops_per_token: float | None = None
        self.spec: float | None = None
        self.measured: float | None = None
        self._once: dict[str, float] = {}
        self._over_peak: set[str] = set()  # MFUs withheld for a peak below the run (said once)

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self.world_size = args.world_size
        config = getattr(model, "config", None)
        self.flops_per_token = None  # unknown: no MFU, never a made-up 0
        if self.seq_len is None:
            logger.info("MFU unavailable: the rows have no input_ids and the model config no max_position_embeddings.")
        else:
            try:
                self.flops_per_token = flops_per_token(config, self.seq_len)
            except (AttributeError, TypeError):  # not a Llama-like config
                logger.info(f"MFU unavailable: no FLOPs-per-token formula for {type(config).__name__}.")
        precision = precision_of(args, model)
        name = device_name(args.device)
        self.spec = self.peak_tflops or spec_tflops(name, precision)
        if self.spec is None:
            logger.warning(
                f"MFU against spec is unavailable: no {precision} peak known for {name!r}. "
                "Pass peak_tflops=<dense TFLOP/s of one device> (PretrainingArguments.peak_tflops)."
            )
        if self.measure_ceiling and self.flops_per_token is not None:  # no FLOPs, no MFU: nothing to measure for
            dtype = ceiling_dtype(precision, args.device)
            if dtype is None:
                logger.warning(
                    f"mfu_measured is unavailable: {name!r} has no native {precision} matmul to measure a ceiling "
                    f"with (the {precision} recipe runs emulated here); mfu_spec, tokens/s and step time stand."
                )
            else:
                scaling = torchao_scaling(args)  # the fp8 ceiling accumulates as the recipe's forward GEMM does
                self.measured = (
                    matmul_ceiling(args.device, dtype, scaling) if scaling else matmul_ceiling(args.device, dtype)
                )
        self._once = {
            k: round(v, 2) for k, v in (("peak_tflops_spec", self.spec), ("peak_tflops_measured", self.measured)) if v
        }
        self._interval = (time.perf_counter(), self.tokens_seen(state), state.global_step)
        self.clock = DeviceClock(args.device)
        self._pending = PendingIntervals(self.clock)
        self._step_times: list[float] = []
        self._step_start = None

    def on_step_begin(self, args, state, control, **kwargs):
        self._step_start = self.clock.mark()

    def on_step_end(self, args, state, control, **kwargs):
        if self._step_start is not None:
            self._pending.push({"step": (self._step_start, self.clock.mark())})
        self._step_start = None
        self._step_times += [r["step"] for r in self._pending.pop_done()]

    def metrics_for_log(self, state) -> dict[str, float]:
        """Metrics over the interval since the previous call (PretrainTrainer merges them into each training log)."""
        now = time.perf_counter()
        start, tokens0, step0 = self._interval
        self._interval = (now, self.tokens_seen(state), state.global_step)
        metrics: dict[str, float] = {}
        self._step_times += [r["step"] for r in self._pending.pop_done()]  # a step not done yet goes to the next log
        if self._step_times:
            metrics["step_time_s"] = sum(self._step_times) / len(self._step_times)
            self._step_times = []
        if state.global_step > step0:  # wall time per step: logging, evaluation and saving included
            metrics["eta_seconds"] = (
                max(state.max_steps - state.global_step, 0) * (now - start) / (state.global_step - step0)
            )
        tokens = self._interval[1] - tokens0
        if tokens > 0:  # with token counting off there is no throughput and no MFU, rather than a 0
            rate = tokens / max(now - start, 1e-9)
            per_rank = rate / self.world_size
            metrics.update(tokens_per_second=rate, tokens_per_second_per_rank=per_rank)
            if self.flops_per_token:
                achieved = self.flops_per_token * per_rank / 1e12
                metrics["model_tflops_per_second_per_rank"] = achieved
                peaks = (("mfu_spec", self.spec), ("mfu_measured", self.measured))
                for key, peak in peaks:
                    if peak:
                        metrics.update(self._mfu_or_warning(key, achieved, peak))
        once, self._once = self._once, {}
        return {**metrics, **once}

    def _mfu_or_warning(self, key: str, achieved: float, peak: float) -> dict:
        """`key`: achieved / peak, a fraction; above 1 the peak is wrong, not the run: the figure is withheld and
        the measurement problem said once (`mfu_spec_warning`, `mfu_measured_warning`)."""
        if achieved <= peak:
            return {key: achieved / peak}
        if key in self._over_peak:
            return {}
        self._over_peak.add(key)
        source = (
            "the matmul ceiling measured at start-up (the machine was busier then, or the step is timed differently)"
            if key == "mfu_measured"
            else "the spec peak (peak_tflops or chips.py): pass this device's dense peak as peak_tflops"
        )
        warning = (
            f"{key} withheld: the run reaches {achieved:.4g} TFLOP/s per device, {achieved / peak:.2f}x {source} "
            f"of {peak:.4g} TFLOP/s; an MFU above 1 is a measurement problem. Tokens/s and step time stand."
        )
        logger.warning(warning)
        return {f"{key}_warning": warning}
