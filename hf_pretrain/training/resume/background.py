"""Asynchronous checkpoints: the training loop waits only for the state to be copied into host memory.

A save still runs the Trainer's own `_save_checkpoint` into the staging folder (`checkpointing.py`), but its large
writes are deferred: the checkpoint code hands them to an explicit writer (`DeferredWriter`: the Trainer's
`torch.save` calls of the optimizer, scheduler, RNG and arguments, its safetensors weight files, DeepSpeed's
checkpoint engine, DCP's `save` of FSDP2's sharded state; routed by `checkpointing.py`, nothing of torch,
safetensors or DCP replaced), which keeps a copy of each object in host memory, made by DCP's `DefaultStager` (the
buffers kept and reused from one save to the next; pinned, and copied without blocking, where CUDA is present);
one background thread per rank writes them.

The copy itself runs beside the next step where it can (DCP's asynchronous staging, as torchtitan uses it): the
objects whose every tensor is a parameter or an optimizer state (the weights, `optimizer.pt`: nearly all the bytes)
change only in `optimizer.step()`, so they are copied on the stager's thread while the next step's forward and
backward run, and a pre-step hook on every torch optimizer (`register_optimizer_step_pre_hook`, removed once it
fired) holds the next update until the copy is done; that wait is timed as checkpoint stall (goodput, and the
watchdog's save floor). Any other object (the scheduler, RNG states, a buffer, a tensor made for the save, anything
DeepSpeed writes) is copied at once. On CUDA the stager's copy stream waits on an event recorded on the training
stream after the step (the host does not drain the device), so the copy reads the state that step made however far
the host ran ahead. The trade: the loop's stall shrinks to what the forward and backward do not cover, but the copy
shares the host (on a CPU run: its cores) with that step. When every rank's writes are done (the outcome
gathered on a gloo group of the checkpointer's own, so no training collective ever shares a group with another
thread), rank 0 flushes the folder and renames it into place, then rotates the old checkpoints (`store.py`).

Kept from the synchronous save: a `checkpoint-N` appears only complete; rotation only after it did; the same
bytes, so a resume is exact; at most one save in flight (the next waits for it, and says so); a failed write is
raised on every rank by the same training step, the first after the write ended on every rank (`settled`: while a
save is outstanding, each optimizer step reads whether it is over on every rank from one flag all-reduced on a
second gloo group of the checkpointer's, started a step before with `async_op`; a rank that checked only its own
writer would train on into a collective that the failed rank never joins); an exchange of the outcome that fails
(a peer lost, a timeout) is that rank's write error, never a quiet end; `finish()` makes the last save complete
before `train()` returns. DCP's `async_save` is not called as such: it starts an executor per call, and FSDP2's
model and optimizer are two calls whose collectives must not run from two threads at once; its stager and `save`
run here, in order, on one thread. DeepSpeed's own asynchronous writer (`checkpoint.writer.decoupled`) commits a
checkpoint only at the next save, from the training loop, and its fast writer needs the `async_io` op: its
`torch.save` calls are deferred here like the Trainer's.
Written by hand: neither transformers nor accelerate writes a checkpoint in the background.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import datetime
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import safetensors.torch
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils._pytree import tree_leaves
from transformers.utils import logging

from ..private import staging_stream
from .store import fsync_file

logger = logging.get_logger(__name__)

ASYNC_CHECKPOINT_DEFAULT = True
HOST_MEMORY_SHARE = 0.5  # stage only when the copy takes at most this share of the host memory available
SCALARS = (int, float, bool, str, bytes, type(None))  # what a copy beside the next step may hold besides tensors


class CheckpointWriteError(RuntimeError):
    """A checkpoint's background write failed; the checkpoints already in place are intact."""


@dataclass
class Write:
    path: str
    run: Callable[[], object]


class Job:
    def __init__(self, name: str, target: Callable[[], None]):
        self.name, self.started = name, time.monotonic()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(target,), name=f"hf_pretrain-save-{name}", daemon=True)
        self.thread.start()  # a daemon: a run that dies does not wait for it at exit (the staged folder is cleared)

    def _run(self, target) -> None:
        try:
            target()
        finally:
            self.done.set()


class DeferredWriter:
    """The explicit writer of one asynchronous save: `torch_save`, `save_file` and `dcp_save` take what
    `torch.save`, safetensors' `save_file` and DCP's `save` take, stage the object in host memory and list the write
    for the background thread (`writes`)."""

    def __init__(self, saves: BackgroundSaves, stepped: set[int] | None):
        self.saves, self.stepped = saves, stepped
        self.writes: list[Write] = []

    def torch_save(self, obj, f, *args, **kwargs) -> None:
        if not isinstance(f, (str, os.PathLike)):  # a file object: written now, as asked
            return torch.save(obj, f, *args, **kwargs)
        staged = self.saves.stage(obj, self.stepped)
        self.writes.append(Write(str(f), lambda: torch.save(copied(staged), f, *args, **kwargs)))

    def save_file(self, tensors, filename, metadata=None) -> None:
        staged = self.saves.stage(tensors, self.stepped)
        write = lambda: safetensors.torch.save_file(copied(staged), filename, metadata=metadata)  # noqa: E731
        self.writes.append(Write(str(filename), write))

    def dcp_save(self, state_dict, *, process_group=None, **kwargs) -> None:
        staged = self.saves.stage(state_dict, self.stepped)
        where = kwargs.get("checkpoint_id") or getattr(kwargs.get("storage_writer"), "path", "?")
        group = self.saves.group() if process_group is None else process_group
        self.writes.append(Write(str(where), lambda: dcp.save(copied(staged), process_group=group, **kwargs)))


class DeepSpeedWrites:
    """A DeepSpeed engine's checkpoint engine whose `save` goes to the writer (set on the one engine for one save:
    DeepSpeed writes every file of its checkpoint through `engine.checkpoint_engine.save`)."""

    def __init__(self, engine, writer: DeferredWriter):
        self._engine, self._writer = engine, writer

    def save(self, state_dict, path: str) -> None:
        self._writer.torch_save(state_dict, path)

    def __getattr__(self, name: str):
        return getattr(self._engine, name)


class BackgroundSaves:
    """One rank's background writer: stage (training thread), write and promote (one save at a time)."""

    def __init__(self, rank: int, world_size: int, timeout_s: float, waiting=contextlib.nullcontext):
        self.rank, self.world_size, self.timeout_s = rank, world_size, timeout_s
        self.waiting = waiting  # a context around the next step's wait for a copy: checkpoint stall
        self.job: Job | None = None
        self.error: BaseException | None = None
        self.staging_waits: list[float] = []  # seconds an optimizer step waited for a save's copy (when it did)
        self.staged_total = 0  # bytes the last save copied into host memory (`staged_bytes` is the estimate)
        self._stager: DefaultStager | None = None  # copies at once, on the training thread
        self._stager_beside: DefaultStager | None = None  # copies on its thread, beside the next step
        self._copies: list[concurrent.futures.Future] = []  # this save's copies still running beside the step
        self._before_step = None  # the optimizer pre-step hook's handle while copies are out
        self._group = None
        self._poll_group = None  # the training threads' agreement that a save is over (`settled`)
        self._poll: tuple | None = None  # (work, flag) of the poll started at the previous step

    @property
    def in_flight(self) -> str | None:
        return self.job.name if self.job is not None and not self.job.done.is_set() else None

    def stage(self, obj, stepped: set[int] | None = None):
        """A copy of `obj` in host memory, or a future of one when every tensor in it lives in `stepped` (storages
        only an optimizer step changes): that copy runs beside the next step, whose update waits for it."""
        cuda = torch.cuda.is_available()
        self.staged_total += tensor_bytes(obj)
        if stepped is None or not only_stepped(obj, stepped):
            if self._stager is None:
                self._stager = DefaultStager(staging_options(beside=False))
            return self._stager.stage(obj)
        if self._stager_beside is None:
            self._stager_beside = DefaultStager(staging_options(beside=True))
        if cuda and not self._copies:  # the copy stream waits for the step that made this state; the host does not
            staging_stream(self._stager_beside).wait_event(torch.cuda.current_stream().record_event())
        copy = self._stager_beside.stage(obj)
        self._copies.append(copy)
        if self._before_step is None:
            self._before_step = register_optimizer_step_pre_hook(self._hold_step)
        return copy

    def _hold_step(self, optimizer, args, kwargs) -> None:
        waited = self.wait_for_copies()
        if waited:
            self.staging_waits.append(waited)

    def wait_for_copies(self) -> float:
        """Wait for this save's copies that run beside the step (the pre-step hook; every wait for the save)."""
        copies, self._copies = self._copies, []
        if self._before_step is not None:
            self._before_step.remove()
            self._before_step = None
        pending = [copy for copy in copies if not copy.done()]
        if not pending:
            return 0.0
        start = time.monotonic()
        with self.waiting():
            concurrent.futures.wait(pending)  # a failed copy is the write's error (raised by the next step), not here
        return time.monotonic() - start

    @contextlib.contextmanager
    def deferred_writes(self, stepped: set[int] | None = None):
        """Inside: a `DeferredWriter` whose calls stage their objects and list the writes (`writer.writes`).
        `stepped`: the storages only an optimizer step changes (`stepped_storages`), whose copy may run beside the
        next step; None: every copy made at once. The checkpoint code calls the writer (checkpointing.py routes the
        Trainer's, DeepSpeed's and DCP's saves to it); nothing of torch, safetensors or DCP is replaced."""
        self.staged_total = 0
        yield DeferredWriter(self, stepped)

    def group(self):
        """The checkpointer's gloo group (created at the first save, by every rank); None for one process."""
        if self._group is None and self.world_size > 1 and dist.is_initialized():
            timeout = datetime.timedelta(seconds=self.timeout_s)
            self._group = dist.new_group(backend="gloo", timeout=timeout)
            self._poll_group = dist.new_group(backend="gloo", timeout=timeout)
        return self._group

    def settled(self) -> bool:
        """Whether the save in flight is over on every rank (then its outcome, gathered by the writers, is the same
        everywhere); True with none. Called by every rank once per optimizer step while a save is out.

        One process: its own writer says. Several: each call reads the answer of the previous step's poll (one
        1-element all-reduce, MIN of "my writer is done", started with `async_op` and waited a step later, when it
        has long completed) and starts the next; every rank reads the same answer at the same step, so a failed
        write is raised by the same step everywhere, at most two steps after the last writer ended. Cost: one
        asynchronous host collective per step while a write is out, none otherwise (benchmarks/failure_exchange.py)."""
        if self.job is None:
            return True
        if self._poll_group is None:
            over = self.job.done.is_set()
        else:
            over = self._poll_answer()
            if not over:
                flag = torch.tensor([float(self.job.done.is_set())])
                work = dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self._poll_group, async_op=True)
                self._poll = (work, flag)
        if over:
            self.wait()  # over everywhere: nothing more to agree on
        return over

    def _poll_answer(self) -> bool:
        """The answer of the poll in flight (waited for: started a step ago), False with none. A poll that fails (a
        peer lost) raises this rank's own write error when it has one, else the collective's."""
        if self._poll is None:
            return False
        (work, flag), self._poll = self._poll, None
        try:
            work.wait()
        except Exception:
            if self.job is not None and self.job.done.is_set() and self.error is not None:
                self.raise_if_failed()
            raise
        return bool(flag.item())

    def on_this_host(self, value: int) -> tuple[int, int]:
        """`value` summed over the ranks on this host, and how many they are (every rank calls it, once)."""
        group = self.group()
        if group is None:
            return value, 1
        rows: list = [None] * self.world_size
        dist.all_gather_object(rows, (socket.gethostname(), value), group=group)
        here = [v for host, v in rows if host == socket.gethostname()]
        return sum(here), len(here)

    def agree(self, usable: bool) -> bool:
        """Whether every rank can save in the background (called once, by every rank, at the first save)."""
        group = self.group()
        if group is None:
            return usable
        flag = torch.tensor([float(usable)])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        return bool(flag.item())

    def submit(self, name: str, writes: list[Write], promote: Callable[[], None], describe_error) -> None:
        """Write `writes` in the background; when every rank wrote its own, `promote()` (the writer ranks)."""
        self.group()  # created here, in the training thread, by every rank in the same order
        self.job = Job(name, lambda: self._write(name, writes, promote, describe_error))

    def _write(self, name: str, writes: list[Write], promote, describe_error) -> None:
        error = None
        try:
            for write in writes:
                write.run()
                if os.path.isfile(write.path):  # this rank flushes its own files (DCP's writer flushes its own)
                    fsync_file(write.path)
        except BaseException as failure:  # every failure is reported at the next step
            error = failure
        error, failed = self._failed_ranks(error)
        if not failed:
            try:
                promote()
            except BaseException as failure:
                error = failure
            error, failed = self._failed_ranks(error)
        if failed:
            self.error = describe_error(error, failed)

    def _failed_ranks(self, error: BaseException | None) -> tuple[BaseException | None, list[int]]:
        """This rank's error and the ranks whose write failed, gathered from every rank. An exchange that fails (a
        gloo timeout, a lost peer) is this rank's failure: the checkpoint is then neither promoted nor lost quietly
        (the thread would end without an error, and `auto` would resume an older checkpoint without a word)."""
        group = self.group()
        if group is None:
            return error, [self.rank] if error is not None else []
        flags = [torch.zeros(1) for _ in range(self.world_size)]
        try:
            dist.all_gather(flags, torch.tensor([float(error is not None)]), group=group)
        except Exception as exchange:
            failure = RuntimeError(f"the ranks could not agree on the write's outcome: {exchange}")
            failure.__cause__ = exchange
            return error or failure, [self.rank]
        return error, [rank for rank, flag in enumerate(flags) if flag.item()]

    def wait(self, next_save: str | None = None) -> float:
        """Wait for the save in flight; returns the seconds waited (logged when a next save had to wait)."""
        start = time.monotonic()
        self.wait_for_copies()
        if self._poll is not None:  # every rank started it at the same step: drained, its answer no longer needed
            with contextlib.suppress(Exception):  # a lost peer is for the next collective to say
                self._poll[0].wait()
            self._poll = None
        job = self.job
        if job is None:
            return time.monotonic() - start
        in_flight = not job.done.is_set()
        job.done.wait()
        self.job = None
        waited = time.monotonic() - start
        if next_save and in_flight and self.rank == 0:
            logger.warning(
                f"{next_save} waited {waited:.2f} s for {job.name}'s background write to finish (it took "
                f"{time.monotonic() - job.started:.1f} s): saves come faster than the disk writes them; raise "
                "save_steps, or write to a faster disk."
            )
        return waited

    def raise_if_failed(self) -> None:
        if self.error is not None:
            error, self.error = self.error, None
            raise error

    def close(self) -> None:
        self.wait()
        for stager in (self._stager, self._stager_beside):
            if stager is not None:
                stager.close()
        self._stager = self._stager_beside = None


def staged_bytes(
    model, optimizer, *, writes_model: bool, holds_optimizer: bool, sharded: bool, module_again: bool, gathered: bool
) -> int:
    """The bytes one save copies into host memory on this rank, counted from what the save writes (tested against
    what `stage` copied, per backend):
    - the model file, on the rank that writes it (`writes_model`): the whole model in its dtype (ZeRO-3: the 16-bit
      weights gathered onto rank 0); under FSDP's sharded state (`sharded`) every rank's own shards instead;
    - DeepSpeed ZeRO-1/2's model states file (`module_again`, rank 0): the module's weights once more;
    - the optimizer, on every rank that writes some of it (`holds_optimizer`): its states, and its parameters where
      they are not the model's (DeepSpeed's fp32 master partitions); whole tensors where rank 0 gathers them
      (`gathered`: FSDP with full state dicts), else this rank's shards."""

    def local(tensor) -> int:
        tensor = getattr(tensor, "_local_tensor", tensor)  # a DTensor's shard
        return tensor.numel() * tensor.element_size()

    def whole(p) -> int:  # ZeRO-3 keeps a partition in ds_tensor; numel() of a DTensor is the whole tensor's
        return getattr(p, "ds_numel", p.numel()) * p.element_size()

    params = list(model.parameters())
    total = 0
    if sharded:
        total += sum(local(p) for p in params)
    elif writes_model:
        total += sum(whole(p) for p in params) * (2 if module_again else 1)
    if holds_optimizer:
        inner = base_optimizer(optimizer)
        mine = {storage_of(p) for p in params}
        states = getattr(inner, "state", {})
        # the parameters it steps: its groups' and its states' keys (ZeRO-3 empties the groups it swaps in and out)
        masters = {id(p): p for p in [*(p for g in getattr(inner, "param_groups", ()) for p in g["params"]), *states]}
        masters = [p for p in masters.values() if isinstance(p, torch.Tensor)]
        size = whole if gathered else local
        total += sum(size(p) for p in masters if storage_of(p) not in mine)
        for state in states.values():
            total += sum(size(v) for v in state.values() if isinstance(v, torch.Tensor))
    return total


def base_optimizer(optimizer):
    """The torch optimizer that holds the states: under accelerate's wrapper, and under DeepSpeed's ZeRO optimizer."""
    while hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return optimizer


def tensor_bytes(obj) -> int:
    """The bytes of the tensors in `obj` that this rank holds (a DTensor: its shard)."""
    leaves = (getattr(leaf, "_local_tensor", leaf) for leaf in tree_leaves(obj) if isinstance(leaf, torch.Tensor))
    return sum(leaf.numel() * leaf.element_size() for leaf in leaves)


def staging_options(beside: bool) -> StagingOptions:
    """Pinned host buffers and copies without blocking where CUDA is present; `beside`: on the stager's thread."""
    cuda = torch.cuda.is_available()
    return StagingOptions(
        use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=beside, use_non_blocking_copy=cuda
    )


def copied(staged):
    """A staged object, waited for when its copy ran beside the step (on the writer's thread)."""
    return staged.result() if isinstance(staged, concurrent.futures.Future) else staged


def storage_of(tensor: torch.Tensor) -> int:
    return getattr(tensor, "_local_tensor", tensor).untyped_storage().data_ptr()  # a DTensor: its shard


def stepped_storages(model, optimizer) -> set[int] | None:
    """The storages that only `optimizer.step()` changes: the parameters' and the optimizer states'. None when the
    optimizer is not a torch one (its step would not wait for a copy) or is DeepSpeed's (it updates its own
    partitions)."""
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate's wrapper
    if not isinstance(inner, torch.optim.Optimizer) or type(inner).__module__.startswith("deepspeed"):
        return None
    tensors = list(model.parameters())
    tensors += [v for state in inner.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return {storage_of(t) for t in tensors} - {0}


def only_stepped(obj, stepped: set[int]) -> bool:
    """Whether `obj` holds tensors, every one in `stepped`, and plain values besides (nothing else may change)."""
    tensors = False
    for leaf in tree_leaves(obj):
        if isinstance(leaf, torch.Tensor):
            if storage_of(leaf) not in stepped:
                return False
            tensors = True
        elif not isinstance(leaf, SCALARS):
            return False
    return tensors
