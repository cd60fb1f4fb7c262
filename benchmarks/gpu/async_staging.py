"""`async_staging`: an asynchronous save's copy of the state runs beside the next step on the device, and what it
writes is the state of its own step; its stall against a synchronous save of the same files.

A model and fused AdamW on the device take one step; the synchronous save `torch.save`s the weights and optimizer
states (the reference files, the state after step 1). Then `BackgroundSaves` (training/resume/background.py) stages
the same two objects: on CUDA the host first waits for the queued step, and the pinned device-to-host copy runs on
the stager's own stream and thread while the host enqueues step 2, whose `optimizer.step()` waits for it (the
pre-step hook). The deferred writes run after step 2, and their files must equal the reference bit for bit and
differ from the state after step 2 (so the check can fail). The stall is host time: the stage calls plus the
update's hold, against the synchronous `torch.save` calls (host-side blocking is what stalls a training loop;
both include the device-to-host copy, the synchronous one also the write).
"""

from __future__ import annotations

import time

import torch

from .common import Context, free_memory, model_optimizer_batch, old_transformers, require

GOAL = "written = its own step's state; stall async / sync <= 0.1"


def train_step(model, optimizer, ids) -> None:
    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=ids.device.type == "cuda"):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=False)


def save(model, optimizer, folder) -> None:
    torch.save(model.state_dict(), folder / "model.pt")
    torch.save(optimizer.state_dict(), folder / "optimizer.pt")


def same(a, b) -> bool:
    """Whether two loaded objects (nested dicts / lists of tensors and values) are equal bit for bit."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(map(same, a, b))
    return a == b


def run(ctx: Context) -> dict:
    require(old_transformers())
    from hf_pretrain.training.resume.background import BackgroundSaves, stepped_storages

    s = ctx.sizes
    model, optimizer, ids = model_optimizer_batch(ctx, s.overhead_preset, s.overhead_seq, s.overhead_batch, 1e-3)
    train_step(model, optimizer, ids)
    reference, written = ctx.workdir / "async_staging" / "sync", ctx.workdir / "async_staging" / "async"
    reference.mkdir(parents=True, exist_ok=True)
    written.mkdir(parents=True, exist_ok=True)

    start = time.perf_counter()
    save(model, optimizer, reference)
    sync_s = time.perf_counter() - start
    saves = BackgroundSaves(rank=0, world_size=1, timeout_s=600)
    start = time.perf_counter()
    with saves.deferred_writes(stepped_storages(model, optimizer)) as writes:
        save(model, optimizer, written)
    staged_s = time.perf_counter() - start
    beside = len(saves._copies)  # the copies that run beside the step (both objects, on a torch optimizer)
    train_step(model, optimizer, ids)  # the update waits for the copy
    held_s = sum(saves.staging_waits)
    for write in writes:
        write.run()
    saves.close()
    load = lambda folder, name: torch.load(folder / name, map_location="cpu", weights_only=True)  # noqa: E731
    equal = all(same(load(written, n), load(reference, n)) for n in ("model.pt", "optimizer.pt"))
    moved = not same({k: v.cpu() for k, v in model.state_dict().items()}, load(reference, "model.pt"))
    del model, optimizer
    free_memory()
    ratio = (staged_s + held_s) / sync_s
    state_bytes = sum((folder / n).stat().st_size for folder in (reference,) for n in ("model.pt", "optimizer.pt"))
    text = (
        f"{s.overhead_preset}, {state_bytes / 2**30:.2f} GiB of state: written = step 1's state {equal} (step 2's "
        f"differs {moved}), {beside} of 2 copies beside the step; stall async {staged_s + held_s:.3f} s (stage "
        f"{staged_s:.3f}, update held {held_s:.3f}) / sync {sync_s:.3f} s = {ratio:.3f}"
    )
    correct = equal and moved and beside == 2
    judged = ctx.judge(correct and ratio <= 0.1)
    if not correct:
        judged = False  # the bytes are a correctness property: they hold on a CPU too
    details = {"equal": equal, "moved": moved, "beside": beside, "staged_s": staged_s, "held_s": held_s}
    return {"result": text, "value": ratio, "pass": judged, "details": {**details, "sync_s": sync_s}}
