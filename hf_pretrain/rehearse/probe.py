"""The rehearsal's eyes inside each rank: the launch target that runs the user's script under watch.

`hf-pretrain rehearse` launches `python probe.py RECORD_DIR FAULT SCRIPT ARGS...` through accelerate in
place of `SCRIPT ARGS...`. FAULT is `0` (none), `STEP` (SIGKILL, the launch must tear down) or, for a launch with
restarts allowed, `restart-kill:STEP` / `restart-stop:STEP` (SIGKILL or SIGSTOP in the first attempt only; each
attempt's records in RECORD_DIR/attempt<k>/, the fault in fault.json). Before running the script as `__main__` (`runpy`), the probe wraps
`transformers.Trainer.__init__` so that every Trainer the script builds (any subclass) gets:
- `ProbeCallback`: at `on_train_begin` the rank's identity (rank, node, host, backend, rendezvous
  address, the step it starts from) and, on rank 0, the first samples of the sampler's order when the
  sampler can tell it (`order(epoch)`, as `ResumableSampler` does); at every `on_step_end` the record
  is written to RECORD_DIR/rank-<r>.json; `on_train_end` marks it finished;
- a wrapper of its `training_step` that notes, for every micro-batch the rank really trains, the ids
  of its samples (their index in the training dataset, found by a fingerprint of their tokens; under
  Ulysses SP, where each rank trains its part of every row, `[row, part]`: the part k of sp equal cuts
  of the row, as DeepSpeed's loader adapter cuts it) and the loss it returns; and, on the last rank at the FAULT's step, once the checkpoint saved before that step is in
  place (an asynchronous save's write may end after the step began), writes killed.json (fault.json) and SIGKILLs
  (or SIGSTOPs) its own process before the micro-batch's forward: a node lost (or hung) mid-step, the others left
  in a collective.

The probe also leaves the process group at exit (`training.processes.leave_process_group`, as
`PretrainTrainer` does): a plain-`Trainer` script rehearsed on gloo would otherwise now and then
abort at exit, a fault of the rehearsal's CPU backend, not of the launch rehearsed.

Why a wrapper process and not a flag of the library: the observation and the fault belong to the
rehearsal only. The library and the user's script stay as they are (no environment variable read by
library code, no callback to remember to attach), and any script that trains with a `Trainer` can be
rehearsed. The cost is one patch of `Trainer.__init__`, confined to the rehearsal's processes.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import runpy
import signal
import socket
import sys
import time
from pathlib import Path

import numpy as np
from transformers import TrainerCallback

from hf_pretrain.training.processes import leave_process_group  # absolute: the probe runs as a script

MAX_INDEXED_ROWS = 2_000_000  # beyond this, samples are identified by fingerprint only
MAX_ORDER = 100_000  # samples of the sampler's order kept for the coverage check


def fingerprint(tokens) -> str:
    """A short hash of a sample's token ids."""
    return hashlib.blake2b(np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=8).hexdigest()


def _rows(inputs: dict) -> list:
    """The samples of a micro-batch as token lists, right padding removed by the attention mask."""
    ids = inputs["input_ids"].detach().cpu().numpy()
    mask = inputs.get("attention_mask")
    if mask is None or mask.dim() != 2:
        return list(ids)
    mask = mask.detach().cpu().numpy().astype(bool)
    return [row[keep] for row, keep in zip(ids, mask)]


def _find_sampler(dataloader, depth: int = 5):
    """The first object under the data loader (batch sampler, sampler, base loader, the loader an SP adapter
    wraps) that knows its order."""
    if dataloader is None or depth == 0:
        return None
    if callable(getattr(dataloader, "order", None)):
        return dataloader
    for name in ("batch_sampler", "sampler", "base_dataloader", "dl"):
        found = _find_sampler(getattr(dataloader, name, None), depth - 1)
        if found is not None:
            return found
    return None


def parse_fault(fault: str) -> tuple[str, int, int]:
    """(kind, step, attempt): `10` -> ("kill", 10, 0); `restart-stop:10` -> ("stop", 10, restart count)."""
    kind, _, step = fault.rpartition(":")
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)
    return (kind.removeprefix("restart-") or "kill"), int(step), attempt if kind.startswith("restart-") else -1


class Probe:
    def __init__(self, record_dir: Path, fault: str):
        self.kind, self.kill_at, self.attempt = parse_fault(fault)
        self.faults_dir = record_dir
        self.dir = record_dir / f"attempt{self.attempt}" if self.attempt >= 0 else record_dir
        self.dir.mkdir(parents=True, exist_ok=True)
        if self.attempt > 0:
            self.kill_at = 0  # the fault happens in the first attempt only
        self.rank = int(os.environ.get("RANK", "0"))
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.index: dict[str, int | list[int]] = {}
        self.sp_size = lambda: 1  # the Trainer's SP degree (`get_sp_size`), once attached
        self.record = {
            "rank": self.rank,
            "world_size": self.world_size,
            "node": int(os.environ.get("GROUP_RANK", "0")),
            "host": socket.gethostname(),
            "master": f"{os.environ.get('MASTER_ADDR', '?')}:{os.environ.get('MASTER_PORT', '?')}",
            "micro_batches": {},  # step -> [[sample ids of each micro-batch]]
            "losses": {},  # step -> sum of the micro-batch losses this rank returned
            "finished": False,
        }

    def attach(self, trainer) -> None:
        if getattr(trainer, "_rehearsal_probe", None) is not None:
            return
        trainer._rehearsal_probe = self
        self.sp_size = getattr(trainer, "get_sp_size", lambda: 1)
        trainer.add_callback(ProbeCallback(self))
        step = trainer.training_step

        def training_step(model, inputs, *args, **kwargs):
            current = trainer.state.global_step + 1
            if current == self.kill_at and self.rank == self.world_size - 1:
                wait_for_due_checkpoint(trainer.args, current)
                self.die(current)
            loss = step(model, inputs, *args, **kwargs)
            ids = [self.index.get(f, f) for f in map(fingerprint, _rows(inputs))]
            self.record["micro_batches"].setdefault(str(current), []).append(ids)
            losses = self.record["losses"]
            losses[str(current)] = losses.get(str(current), 0.0) + float(loss.detach().float().sum())
            return loss

        trainer.training_step = training_step

    def begin(self, args, state, train_dataloader) -> None:
        import torch.distributed as dist

        self.record.update(
            start_step=state.global_step,
            begin_time=time.time(),
            backend=dist.get_backend() if dist.is_available() and dist.is_initialized() else "none",
            global_batch=args.per_device_train_batch_size * args.world_size * args.gradient_accumulation_steps,
            max_steps=state.max_steps,
        )
        loader = getattr(train_dataloader, "dl", train_dataloader)  # the loader under Ulysses SP's adapter
        dataset = getattr(loader, "dataset", None)
        columns = getattr(dataset, "column_names", None) or []
        if "input_ids" in columns and len(dataset) <= MAX_INDEXED_ROWS:
            self.index_rows(dataset["input_ids"], self.sp_size())
            self.record["dataset_rows"] = len(dataset)
        sampler = _find_sampler(train_dataloader)
        self.record["sampler"] = type(sampler).__name__ if sampler is not None else None
        if sampler is not None and self.rank == 0 and state.global_step == 0:
            self.record["order"] = sampler.order(0)[:MAX_ORDER].tolist()
        self.write()

    def index_rows(self, rows, sp: int) -> None:
        """Each row's fingerprint -> its index; with `sp` > 1 also each of its sp equal parts -> [index, part]."""
        for i, tokens in enumerate(rows):
            self.index.setdefault(fingerprint(tokens), i)
        if sp > 1:
            for i, tokens in enumerate(rows):
                if len(tokens) % sp == 0:
                    cut = len(tokens) // sp
                    for k in range(sp):
                        self.index.setdefault(fingerprint(tokens[k * cut : (k + 1) * cut]), [i, k])
        self.record["sp"] = sp

    def write(self) -> None:
        path = self.dir / f"rank-{self.rank}.json"
        partial = path.with_suffix(".partial")
        partial.write_text(json.dumps(self.record))
        partial.replace(path)

    def die(self, step: int) -> None:
        self.write()
        fault = {"rank": self.rank, "step": step, "time": time.time(), "kind": self.kind}
        name = "fault.json" if self.attempt >= 0 else "killed.json"  # killed.json: the launch must tear down
        (self.faults_dir / name).write_text(json.dumps(fault))
        os.kill(os.getpid(), signal.SIGSTOP if self.kind == "stop" else signal.SIGKILL)


def wait_for_due_checkpoint(args, step: int, deadline_s: float = 60.0) -> None:
    """Before the fault at `step`: the newest checkpoint saved before it is in place (at most `deadline_s`). With
    asynchronous saves a checkpoint appears once its background write is done, which for the save right before the
    fault may be after the step began; the rehearsal judges what a kill leaves of the checkpoints already made (a
    kill during a write is tests/distributed/test_multiprocess_resume.py's)."""
    save_steps = getattr(args, "save_steps", 0) or 0
    if str(getattr(args, "save_strategy", "no")).split(".")[-1].lower() != "steps" or save_steps < 1:
        return
    due = (step - 1) // int(save_steps) * int(save_steps)
    folder = Path(args.output_dir) / f"checkpoint-{due}"
    deadline = time.monotonic() + deadline_s
    while due > 0 and not folder.exists() and time.monotonic() < deadline:
        time.sleep(0.01)


class ProbeCallback(TrainerCallback):
    """Logs nothing: writes the rank's record (rank-<r>.json) for `hf-pretrain rehearse`."""

    def __init__(self, probe: Probe):
        self.probe = probe

    def on_train_begin(self, args, state, control, train_dataloader=None, **kwargs):
        self.probe.begin(args, state, train_dataloader)

    def on_step_end(self, args, state, control, **kwargs):
        self.probe.write()

    def on_train_end(self, args, state, control, **kwargs):
        self.probe.record.update(finished=True, end_time=time.time(), end_step=state.global_step)
        self.probe.write()


def install(probe: Probe) -> None:
    """Every Trainer built from now on is watched by `probe`."""
    import transformers

    original = transformers.Trainer.__init__

    def __init__(self, *args, **kwargs):
        original(self, *args, **kwargs)
        probe.attach(self)

    transformers.Trainer.__init__ = __init__


def main(argv: list[str]) -> None:
    record_dir, fault, script, *script_args = argv
    install(Probe(Path(record_dir), fault))
    atexit.register(leave_process_group)  # the same function object as PretrainTrainer's: registered once
    sys.argv = [script, *script_args]
    here = str(Path(__file__).resolve().parent)
    sys.path[:] = [p for p in sys.path if not p or str(Path(p).resolve()) != here]  # as if the script were launched
    sys.path.insert(0, str(Path(script).resolve().parent))
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main(sys.argv[1:])
