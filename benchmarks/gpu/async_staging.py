"""`async_staging`: an asynchronous save's copy of the state runs beside the next step on the device, and what it
writes is the state of its own step; a second save's stall against the same step without a save, and against a
synchronous save of the same files.

A model and fused AdamW on the device. First the race the copy stream's wait exists for: a step whose update is
held back on the device (a sleep kernel before `optimizer.step()`: the host returns long before the update ran),
then at once `BackgroundSaves` (training/resume/background.py) stages the weights and optimizer states; its copy
stream must wait on the step's event, or it copies the state from before the update. The deferred writes run
after the next step, and their files must equal the state of their own step (taken after a synchronize) bit for
bit and differ from the state after the next step (so the check can fail). That save also pays the one-time costs
(pinned buffers). Then the figures, every interval synchronised: the median step without a save; a second save's
stage call plus the next step (whose update waits for the copy) less that median: the stall; and a synchronous
`torch.save` of the same two objects. Goal: stall / synchronous <= 0.1.
"""

from __future__ import annotations

import statistics
import time

import torch

from .common import Context, free_memory, model_optimizer_batch, old_transformers, require, sync
from .faults import device_sleep

GOAL = "written = its own step's state; stall async / sync <= 0.1"


def train_step(model, optimizer, ids, hold_update_s: float = 0.0) -> None:
    """One step; `hold_update_s`: a device sleep before the update, so the host returns long before it ran."""
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=ids.device.type == "cuda"):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    if hold_update_s:
        device_sleep(hold_update_s, ids.device)
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)


def save(model, optimizer, folder, torch_save=torch.save) -> None:
    """The two files of the check; `torch_save`: a save's `DeferredWriter.torch_save` for the asynchronous ones."""
    torch_save(model.state_dict(), folder / "model.pt")
    torch_save(optimizer.state_dict(), folder / "optimizer.pt")


def same(a, b) -> bool:
    """Whether two loaded objects (nested dicts / lists of tensors and values) are equal bit for bit."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(same, a, b))
    return a == b


def synchronised(ctx: Context, fn) -> float:
    sync(ctx.device)
    start = time.perf_counter()
    fn()
    sync(ctx.device)
    return time.perf_counter() - start


def run(ctx: Context) -> dict:
    require(old_transformers())
    from hf_pretrain.training.resume.background import BackgroundSaves, stepped_storages

    s = ctx.sizes
    model, optimizer, ids = model_optimizer_batch(ctx, s.overhead_preset, s.overhead_seq, s.overhead_batch, 1e-3)
    train_step(model, optimizer, ids)
    folders = {n: ctx.workdir / "async_staging" / n for n in ("raced", "second", "sync")}
    for folder in folders.values():
        folder.mkdir(parents=True, exist_ok=True)
    saves = BackgroundSaves(rank=0, world_size=1, timeout_s=600)

    # the race: the update still queued on the device when the copy is asked for
    train_step(model, optimizer, ids, hold_update_s=0.2 if ctx.cuda else 0.0)
    with saves.deferred_writes(stepped_storages(model, optimizer)) as writer:
        save(model, optimizer, folders["raced"], writer.torch_save)
    beside = len(saves._copies)  # the copies that run beside the step (both objects, on a torch optimizer)
    sync(ctx.device)
    own_step = {"model.pt": cpu(model.state_dict()), "optimizer.pt": cpu(optimizer.state_dict())}
    train_step(model, optimizer, ids)  # the update waits for the copy
    for write in writer.writes:
        write.run()
    load = lambda folder, name: torch.load(folder / name, map_location="cpu", weights_only=True)  # noqa: E731
    equal = all(same(load(folders["raced"], n), own_step[n]) for n in own_step)
    moved = not same(cpu(model.state_dict()), own_step["model.pt"])

    # the figures, synchronised: a step alone, a second save with its next step, a synchronous save
    alone_s = statistics.median(synchronised(ctx, lambda: train_step(model, optimizer, ids)) for _ in range(3))
    held = len(saves.staging_waits)

    def second_save() -> None:
        with saves.deferred_writes(stepped_storages(model, optimizer)) as second:
            save(model, optimizer, folders["second"], second.torch_save)
        train_step(model, optimizer, ids)
        pending.extend(second.writes)

    pending: list = []
    with_save_s = synchronised(ctx, second_save)
    held_s = sum(saves.staging_waits[held:])
    for write in pending:
        write.run()
    sync_s = synchronised(ctx, lambda: save(model, optimizer, folders["sync"]))
    saves.close()
    stall_s = max(with_save_s - alone_s, 0.0)
    state_bytes = sum((folders["sync"] / n).stat().st_size for n in ("model.pt", "optimizer.pt"))
    free_memory()
    ratio = stall_s / sync_s
    text = (
        f"{s.overhead_preset}, {state_bytes / 2**30:.2f} GiB of state: written = its own step's state {equal} (the "
        f"next differs {moved}; update queued {'0.2 s behind' if ctx.cuda else 'not held (CPU)'}), {beside} of 2 "
        f"copies beside the step; second save: step + save {with_save_s:.3f} s vs step {alone_s:.3f} s -> stall "
        f"{stall_s:.3f} s (update held {held_s:.3f}) / sync {sync_s:.3f} s = {ratio:.3f}"
    )
    correct = equal and moved and beside == 2
    judged = ctx.judge(correct and ratio <= 0.1)
    if not correct:
        judged = False  # the bytes are a correctness property: they hold on a CPU too
    details = {"equal": equal, "moved": moved, "beside": beside, "alone_s": alone_s, "with_save_s": with_save_s}
    return {"result": text, "value": ratio, "pass": judged, "details": {**details, "held_s": held_s, "sync_s": sync_s}}


def cpu(state) -> object:
    """A copy of a state dict on the host (tensors cloned), nested dicts and lists kept."""
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: cpu(v) for k, v in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(cpu(v) for v in state)
    return state
