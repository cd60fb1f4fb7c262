"""Faults injected by tests into real runs (never by the library): a NaN or spiking loss, a save held open, a
checkpoint's background write that fails or blocks. The slow rank, which benchmarks/gpu_check.py injects too, is
`slow_linears` in benchmarks/gpu/faults.py."""

import errno
import os
import time
from pathlib import Path

from hf_pretrain import PretrainTrainer

SLOW_SAVE_STARTED = "slow-save.started"  # written into a held save's folder once its weights are written


class LossInjectingTrainer(PretrainTrainer):
    """`inject="3:nan,7:spike"`: the loss of those optimizer steps (1-based) becomes NaN or 50x, once per step, so
    the replay of a step after a roll-back is clean."""

    def __init__(self, *args, inject: str = "", **kwargs):
        super().__init__(*args, **kwargs)
        pairs = (item.partition(":") for item in filter(None, inject.split(",")))
        self.injections = {int(step): kind for step, _, kind in pairs}
        self.injected: set[int] = set()

    def compute_loss(self, model, inputs, *args, **kwargs):
        result = super().compute_loss(model, inputs, *args, **kwargs)
        step = self.state.global_step + 1
        kind = self.injections.get(step) if model.training else None
        if kind is None or step in self.injected:
            return result
        loss = result[0] if isinstance(result, tuple) else result
        loss = loss * float("nan") if kind == "nan" else loss * 50.0
        return (loss, *result[1:]) if isinstance(result, tuple) else loss

    def training_step(self, *args, **kwargs):
        loss = super().training_step(*args, **kwargs)
        if self.state.global_step + 1 in self.injections:
            self.injected.add(self.state.global_step + 1)
        return loss


class SlowSaveTrainer(PretrainTrainer):
    """Holds the save of step `at` open for `seconds` between the weights and the optimizer state: a window in
    which a test kills the process with a checkpoint half written."""

    def __init__(self, *args, slow_save: tuple[int, float] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.slow_save = slow_save

    def _save_optimizer_and_scheduler(self, output_dir):
        if self.slow_save and self.slow_save[0] == self.state.global_step:
            Path(output_dir, SLOW_SAVE_STARTED).write_text("")  # the weights are written, the optimizer is not
            time.sleep(self.slow_save[1])
        return super()._save_optimizer_and_scheduler(output_dir)


class WriteFault:
    """An object a checkpoint saves with `torch.save`: its bytes are produced when it is pickled, i.e. by the write
    itself (in the background with async_checkpoint). `fail`: the write raises an I/O error; `block`: it writes
    `marker` and waits until `release` exists (at most `deadline_s`); `slow`: it takes `seconds`."""

    def __init__(self, kind: str, marker: str | None = None, release: str | None = None, seconds: float = 0.0):
        self.kind, self.marker, self.release, self.seconds = kind, marker, release, seconds

    def __deepcopy__(self, memo):  # staged as it is: nothing to copy
        return self

    def __reduce__(self):
        if self.kind == "fail":
            raise OSError(errno.EIO, "injected write error")
        if self.marker:
            Path(self.marker).write_text(str(os.getpid()))
        if self.kind == "block":
            deadline = time.monotonic() + 300
            while not (self.release and Path(self.release).exists()) and time.monotonic() < deadline:
                time.sleep(0.05)
        elif self.kind == "slow":
            time.sleep(self.seconds)  # a slow disk
        return (str, ("",))


class WriteFaultTrainer(PretrainTrainer):
    """Adds `fault` (a WriteFault) to the checkpoint of step `at`, written by process `rank` as `write-fault.pt`."""

    def __init__(self, *args, write_fault: tuple[int, int, WriteFault] | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.write_fault = write_fault

    def _save_optimizer_and_scheduler(self, output_dir):
        super()._save_optimizer_and_scheduler(output_dir)
        if self.write_fault is not None:
            at, rank, fault = self.write_fault
            if self.state.global_step == at and self.args.process_index == rank:
                self.checkpointing.torch_save(fault, os.path.join(output_dir, "write-fault.pt"))  # with the save
