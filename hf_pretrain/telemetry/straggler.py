"""`StragglerCallback`: per-rank compute, wait and data wait on the device's own clock; names the slow rank.

What each rank times, per optimizer step, with `telemetry/timing.py` (CUDA events on a GPU, read a
step or more later so that nothing stalls; the host clock on a CPU):
- `step_s`: from step begin to step end, the optimizer included;
- `compute_s`: its forward/backward, summed over the micro-batches of the step
  (`PretrainTrainer.training_step` reports each through `before_micro_batch` /
  `record_micro_batch`). Under DDP a communication hook marks when the last gradient bucket of
  the synchronising micro-batch is ready, and the micro-batch's compute ends there: what follows
  is the all-reduce, i.e. waiting for the other ranks. It is read on the clock of the rank's own
  work (`DeviceClock.work_mark`): device time on a GPU, this thread's CPU time on a CPU, so that a
  CPU rank that other processes preempt on a shared machine is not taken for a straggler;
- `wait_s` = `step_s` - the wall time of those compute windows: blocked in collectives, the
  optimizer, the token-count gathers (on a GPU `compute_s + wait_s = step_s`; on a CPU the time it
  was preempted inside its compute is in neither);
- `local_s`: the forward time of its linear layers whose forward holds no collective (`_is_linear`),
  each timed on its own (a pre- and a post-forward hook per linear), summed, on the last
  `LOCAL_SAMPLES` (3) steps of each exchange window only: the hooks are registered for those steps
  and removed after them, so the other steps pay nothing for them
  (benchmarks/telemetry_overhead.py measures what all callbacks cost); with it `local_work`, the
  multiply-adds those forwards did (rows x in x out, read off the shapes). Which layers:
  `nn.Linear` and torchao's and Transformer Engine's low-precision ones: DeepSpeed ZeRO-3 and FSDP
  gather a module's weights in hooks that run before ours, DDP and ZeRO-1/2 communicate in
  backward or the optimizer. DeepSpeed AutoTP puts its own layers in place of the model's linears
  (deepspeed/module_inject/layers.py, none an `nn.Linear`): the column-parallel `LinearLayer`
  (q/k/v, gate, up) has no collective in its forward (its all-reduce is the input gradient's, in
  backward) and is timed; the row-parallel `LinearAllreduce` (o, down) all-reduces its partial sums
  *inside* its forward, so its time holds the wait for the slowest rank of the TP group, and is
  not; nor a `LinearLayer` with `gather_output` (an all-gather in forward). So `local_s` is this
  rank's own matmul work under every engine, never a wait (under AutoTP that of 5 of the 7 linears
  of a layer);
- `data_wait_s`: from the end of the previous step to the start of this one (the data loader, the
  previous step's logging, evaluation or saving), on the device clock: time the device idled.

The rule that names the slow rank, and why it reads two compute measures: `straggler_rule.py`.
The rule compares every rank with every other, which holds under Ulysses sequence parallelism and AutoTP too, both
DeepSpeed engines (so judged on `local_s`). The ranks of an SP group train equal shards of the same rows (the same
matmuls, the attention of equally many heads over the whole sequence) and wait for each other in every attention's
all-to-all; the ranks of a TP group train the same batch on their shard of each linear (equal where heads and MLP
columns divide by the TP size) and wait for each other in every row-parallel all-reduce, in forward and backward.
So both do equal work, as data-parallel ranks do, and a slow one shows in its own `local_s` while the others' wait
sits inside their collectives. Where AutoTP splits unevenly (heads or widths that do not divide, KV heads fewer
than the TP size: ranks past them hold no attention shard) the rule compares seconds per multiply-add instead.
Tested on 2 gloo ranks (tests/telemetry/test_straggler.py): AutoTP=2 and SP=2 name the rank slowed inside its
linears and stay quiet with none slowed, an uneven AutoTP split included.

Logs at the next logging step after an exchange (rank 0's logs carry every rank):
`compute_s`, `local_s`, `wait_s`, `data_wait_s`, `step_s` (this rank's medians),
`straggler_score_min`, `rank{r}_compute_s`, `rank{r}_local_s`, `rank{r}_wait_s`, `rank{r}_data_wait_s`, `rank{r}_score`,
`rank{r}_sm_clock_mhz`, `rank{r}_power_w`, `rank{r}_memory_gib` (the last three where the device
exposes them), and when something fires: `straggler_warning` (text, the first since the previous
log), `straggler_warnings` (how many exchanges flagged one since then), `straggler_slowest_rank`,
and `underclock_warning` / `underclock_rank` for another rank's under-clock.

A slow rank is injected by the tests and gpu_check (`benchmarks/gpu/faults.py`, `slow_linears`), not by a
switch here.
"""

from __future__ import annotations

import socket
import statistics
import sys

import torch
import torch.distributed as dist
from transformers.utils import logging

from ..callback import PretrainCallback
from .hardware import HardwareSensorsCallback
from .straggler_rule import FIELDS, TIMES, reading_of, reasons_mask, straggler_report
from .timing import DeviceClock, PendingIntervals
from .underclock import UnderclockCallback, underclock_warning

logger = logging.get_logger(__name__)
LOCAL_SAMPLES = 3  # steps per exchange window (its last ones) whose linears are timed


def _hook_ddp(model) -> bool:
    """Install one timing comm hook per DDP model; it marks bucket readiness on `model._hf_pretrain_timer`."""
    if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
        return False
    if getattr(model, "_hf_pretrain_hooked", False):
        return True
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    def timing_hook(process_group, bucket):
        timer = getattr(model, "_hf_pretrain_timer", None)
        if timer is not None:
            timer._ready = timer._marks()  # on the compute stream: when the bucket's last gradient is done
        return default_hooks.allreduce_hook(process_group, bucket)

    try:
        model.register_comm_hook(model.process_group, timing_hook)
    except RuntimeError as err:  # another comm hook is already registered (e.g. compression)
        logger.warning(f"straggler detection without bucket timing: {err}")
        return False
    model._hf_pretrain_hooked = True
    return True


def _is_linear(module) -> bool:
    """A linear layer whose forward holds no collective: `nn.Linear` and its subclasses (torchao's Float8Linear),
    Transformer Engine's `Linear`, and DeepSpeed AutoTP's column-parallel layers (module docstring)."""
    kind = type(module)
    if isinstance(module, torch.nn.Linear) or (
        kind.__name__ == "Linear" and kind.__module__.startswith("transformer_engine")
    ):
        return True
    autotp = sys.modules.get("deepspeed.module_inject.layers")  # loaded wherever DeepSpeed built AutoTP's layers
    if autotp is None:
        return False
    column = tuple(getattr(autotp, name) for name in ("LinearLayer", "SubParamLinearLayer") if hasattr(autotp, name))
    return isinstance(module, column) and not getattr(module, "gather_output", False)


def timed_linears(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The layers whose forward `local_s` times (and `benchmarks/gpu/faults.py` slows): every `_is_linear` but the
    LM head, whose hook would turn off the chunked loss (modeling/loss.py), which never calls it."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return [module for module in model.modules() if _is_linear(module) and module is not head]


def _compiled(trainer, model) -> bool:
    return bool(getattr(getattr(trainer, "args", None), "torch_compile", False)) or hasattr(model, "_orig_mod")


class StragglerCallback(PretrainCallback):
    keep_in_history = False  # read off clocks and sensors: differs between identical runs
    arguments = {"straggler_every": 20, "straggler_threshold": 0.75}
    times_micro_batches = True

    @classmethod
    def from_arguments(cls, trainer, built=()) -> StragglerCallback | None:
        sensors = next((c for c in built if isinstance(c, HardwareSensorsCallback)), None)
        if sensors is None:  # telemetry off
            return None
        settings = {**cls.settings(trainer.args), **UnderclockCallback.settings(trainer.args)}
        straggler = cls(
            settings["straggler_every"], settings["straggler_threshold"], sensors, settings["underclock_threshold"]
        )
        straggler.trainer = trainer
        return straggler

    def __init__(
        self,
        every: int = arguments["straggler_every"],
        threshold: float = arguments["straggler_threshold"],
        sensors=None,
        underclock_threshold: float = UnderclockCallback.arguments["underclock_threshold"],
    ):
        self.every = max(1, every)
        self.threshold = threshold
        self.underclock_threshold = underclock_threshold
        self.sensors = sensors  # a HardwareSensorsCallback: clock, power, memory for the exchange
        self.trainer = None  # set by PretrainTrainer: the DDP model is found through it
        self.warnings: list[tuple[int, str]] = []
        self._pending: dict = {}
        self._handles: list = []
        self._linears: list = []

    def on_train_begin(self, args, state, control, **kwargs):
        self.rank, self.world = args.process_index, args.world_size
        self.device = args.device
        self.clock = DeviceClock(args.device)
        self.steps = PendingIntervals(self.clock)
        self.host = socket.gethostname()
        self.window: dict[str, list[float]] = {k: [] for k in TIMES}
        self.work: list[int] = []  # multiply-adds of the timed linears, per sampled step
        self._last_end = self._begin = None
        self._ready = None
        self._sampled = False
        wrapped = getattr(self.trainer, "model_wrapped", None)
        self.hooked = _hook_ddp(wrapped)
        if self.hooked:
            wrapped._hf_pretrain_timer = self
        self.wait_free = self.hooked or self.world == 1
        self._remove_hooks()
        self._linears = self._timed_linears(getattr(self.trainer, "model", None) or kwargs.get("model"), wrapped)
        self.hosts = self._gather_hosts() if self.world > 1 else [self.host]

    def _timed_linears(self, model, wrapped) -> list:
        """The linears whose forward `local_s` times: none under torch.compile (hooks would break its graph)."""
        if model is None or _compiled(self.trainer, wrapped):
            return []
        return timed_linears(model)

    def times_linears(self, step: int) -> bool:
        """Whether optimizer step `step` (1-based) times its linears: the last `LOCAL_SAMPLES` of each window."""
        return (-step) % self.every < LOCAL_SAMPLES

    def _hook_linears(self) -> None:
        self._remove_hooks()
        for module in self._linears:
            self._handles.append(module.register_forward_pre_hook(self._linear_begin))
            self._handles.append(module.register_forward_hook(self._linear_end))

    def _linear_begin(self, module, args):
        self._linear_start = self.clock.work_mark()

    def _linear_end(self, module, args, output):
        if self._linear_start is not None:
            self._local.append((self._linear_start, self.clock.work_mark()))
            self._linear_start = None
            self._work += args[0].numel() * output.shape[-1]  # multiply-adds: rows x in x out, from the shapes

    def _remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def on_train_end(self, args, state, control, **kwargs):
        self._remove_hooks()

    def _gather_hosts(self) -> list[str]:
        hosts = [None] * self.world
        dist.all_gather_object(hosts, self.host)
        return hosts

    def on_step_begin(self, args, state, control, **kwargs):
        self._begin = self.clock.mark()
        self._micro, self._micro_wall, self._local, self._linear_start, self._work = [], [], [], None, 0
        self._sampled = bool(self._linears) and self.times_linears(state.global_step + 1)
        if self._sampled:
            self._hook_linears()

    def _marks(self) -> tuple:
        """(wall, work) marks of one instant: one CUDA event for both on a GPU."""
        wall = self.clock.mark()
        return (wall, wall) if self.clock.cuda else (wall, self.clock.work_mark())

    def before_micro_batch(self) -> None:
        """Called by PretrainTrainer.training_step before each micro-batch."""
        self._micro_start = self._marks()
        self._ready = None

    def record_micro_batch(self, start: float, end: float) -> None:
        """Called by PretrainTrainer.training_step after each micro-batch's forward and backward.

        `start` / `end` are the trainer's host times; the marks taken here and in `before_micro_batch`
        are on the device clock. The sync micro-batch's local work ends when its last bucket is ready.
        """
        end = self._ready if self._ready is not None else self._marks()
        self._micro_wall.append((self._micro_start[0], end[0]))
        self._micro.append((self._micro_start[1], end[1]))
        self._ready = None

    def on_step_end(self, args, state, control, **kwargs):
        self._remove_hooks()
        if self._begin is None:  # a step whose begin we did not see (attached mid-step)
            return
        end = self.clock.mark()
        record = {"step": (self._begin, end), "compute": self._micro}
        record["compute_wall"] = self._micro if self.clock.cuda else self._micro_wall  # (one set of events on a GPU)
        if self._sampled:
            record["local"] = self._local
            self.work.append(self._work)  # known now (shapes); the times once the device has passed them
        if self._last_end is not None:
            record["data_wait"] = (self._last_end, self._begin)
        self.steps.push(record)
        self._last_end, self._begin = end, None
        for done in self.steps.pop_done():
            step = done["step"]
            compute = min(done["compute"], step) if done["compute"] > 0 else step
            compute_wall = min(done["compute_wall"], step) if done["compute_wall"] > 0 else step
            self.window["compute_s"].append(compute)
            if "local" in done:
                self.window["local_s"].append(done["local"])
            self.window["wait_s"].append(step - compute_wall)
            self.window["data_wait_s"].append(done.get("data_wait", 0.0))
            self.window["step_s"].append(step)
        if state.global_step % self.every == 0:
            self._exchange(state.global_step)

    def _local_row(self) -> dict[str, float]:
        row = {k: statistics.median(v) if v else 0.0 for k, v in self.window.items()}
        latest = self.sensors.latest if self.sensors is not None else {}
        for field, key in (
            ("sm_clock_mhz", "gpu_sm_clock_mhz"),
            ("sm_clock_max_mhz", "gpu_sm_clock_max_mhz"),
            ("power_w", "gpu_power_w"),
            ("utilization_pct", "gpu_utilization_pct"),
            ("memory_gib", "gpu_memory_used_gib"),
        ):
            row[field] = float(latest.get(key, -1))
        row["reasons"] = reasons_mask(latest.get("gpu_throttle_reasons"))
        row["local_work"] = float(statistics.median(self.work)) if self.work else 0.0
        row["wait_free"] = float(self.wait_free)
        row["steps"] = float(len(self.window["step_s"]))
        return row

    def _exchange(self, step: int) -> None:
        local = self._local_row()
        rows = [local]
        if self.world > 1:
            mine = torch.tensor([local[k] for k in FIELDS], dtype=torch.float64, device=self.device)
            gathered = [torch.zeros_like(mine) for _ in range(self.world)]
            dist.all_gather(gathered, mine)
            rows = [dict(zip(FIELDS, t.tolist())) for t in gathered]
        if min(r["steps"] for r in rows) == 0:  # some rank has no step read yet (GPU events pending): next time
            return
        self.window, self.work = {k: [] for k in self.window}, []
        metrics, warning = straggler_report(rows, self.hosts, self.threshold)
        metrics.update({k: local[k] for k in TIMES})
        if warning:
            self.warnings.append((step, warning))
            if self.rank == 0:
                logger.warning(f"straggler at step {step}: {warning}")
            count = self._pending.get("straggler_warnings", 0) + 1
            first = self._pending.get("straggler_warning", warning)  # keep the first until the next log
            metrics.update(straggler_warning=first, straggler_warnings=count)
        for rank, row in enumerate(rows):  # other ranks' under-clock reaches rank 0's logs here
            if rank == self.rank:
                continue  # this rank's own is UnderclockCallback's
            text = underclock_warning(reading_of(row), self.underclock_threshold, rank=rank, host=self.hosts[rank])
            if text:
                metrics.setdefault("underclock_warning", text)
                metrics.setdefault("underclock_rank", rank)
        self._pending = {**self._pending, **metrics}

    def metrics_for_log(self, state) -> dict:
        pending, self._pending = self._pending, {}
        return pending
