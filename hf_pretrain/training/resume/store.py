"""Atomic checkpoints and the run state that makes a resume exact.

transformers writes `checkpoint-N/` in place, file after file, and `get_last_checkpoint` picks
the highest N: a process killed in the middle of a save leaves a half-written `checkpoint-N`
that the next `resume_from_checkpoint=True` loads (or fails on). `PretrainTrainer` writes every
checkpoint under `OUTPUT_DIR/.saving/checkpoint-N`, waits for all ranks, flushes the files to
disk and renames the folder to `OUTPUT_DIR/checkpoint-N` in one `rename`, so a `checkpoint-N`
is complete or absent. The older checkpoints are rotated (`save_total_limit`) only after that.
A leftover `.saving/` from a killed save is removed at the next start. The final `save_model` is as
safe (`save_into_place`): written under `OUTPUT_DIR/.saving/final`, then moved into `OUTPUT_DIR`
file by file (renames on one file system), the weights before `config.json`; a save that fails (a
full disk: named, with the free space) leaves `OUTPUT_DIR` as it was.

Each checkpoint also holds `hf_pretrain_state.json` (`RUN_STATE_NAME`): the data position
(epoch, samples consumed in it, the batch geometry and the dataset's length and fingerprint)
and the loss guard's state (learning-rate scale after roll-backs, counters, recent losses).

Written by hand: neither transformers nor accelerate writes checkpoints atomically; the rename
is the usual POSIX recipe (same file system, so it cannot be half done).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

STAGING_DIR = ".saving"
RUN_STATE_NAME = "hf_pretrain_state.json"


def staging_root(run_dir: str) -> str:
    return os.path.join(run_dir, STAGING_DIR)


def clear_staging(run_dir: str) -> list[str]:
    """Remove what interrupted saves left in `run_dir/.saving`; return the names removed."""
    root = Path(staging_root(run_dir))
    if not root.is_dir():
        return []
    left = sorted(p.name for p in root.iterdir())
    with contextlib.suppress(FileNotFoundError):  # a writer's promote may remove the emptied folder meanwhile
        shutil.rmtree(root)
    return left


def _fsync_tree(folder: str) -> None:
    """Flush every file of the folder, then its entries. The background writers flush the files they wrote first,
    each rank its own in parallel (DCP's writer does too), so here each file is already clean: rank 0 pays an open
    and an fsync per file of every rank (at 1,000 ranks a few thousand metadata calls per save, on its writer
    thread), the price of never renaming into place a file whose bytes are not on the disk."""
    for path in sorted(Path(folder).rglob("*")):
        if path.is_file():
            fsync_file(path)
    _fsync_dir(folder)


def fsync_file(path: str | Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(folder: str) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def promote(staged: str, final: str) -> None:
    """Make the fully written checkpoint `staged` visible as `final` with one rename."""
    _fsync_tree(staged)
    replaced = None
    if os.path.exists(final):  # the same step saved again (e.g. the final save at a save step)
        replaced = os.path.join(os.path.dirname(staged), f"replaced-{os.path.basename(final)}")
        os.replace(final, replaced)
    os.replace(staged, final)
    _fsync_dir(os.path.dirname(final))
    if replaced:
        shutil.rmtree(replaced)
    with contextlib.suppress(OSError):  # leave no empty staging folder behind
        os.rmdir(os.path.dirname(staged))


def checkpoint_name(step: int) -> str:
    return f"{PREFIX_CHECKPOINT_DIR}-{step}"


def write_run_state(checkpoint: str, state: dict) -> None:
    path = os.path.join(checkpoint, RUN_STATE_NAME)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(state, f, indent=2)


def read_run_state(checkpoint: str) -> dict:
    """The checkpoint's run state; `{}` for a checkpoint written by plain transformers."""
    path = os.path.join(checkpoint, RUN_STATE_NAME)
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _folder_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def disk_full_error(error: BaseException, run_dir: str, name: str) -> OSError | None:
    """A clear error for a save that failed for want of space, or None when the error does not say so.

    The error says so by its errno (ENOSPC, EDQUOT) or its words: torch's writer says
    `inline_container.cc ... unexpected pos` and nothing of space. The file system's free bytes are
    measured here, against the size of the newest checkpoint already written; less free space than
    that alone (an error of another kind) only adds a note to the error, which stays the user's."""
    chain, cause = [], error
    while cause is not None and len(chain) < 8:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    text = " ".join(str(e) for e in chain)
    free = shutil.disk_usage(run_dir).free
    whole = sorted(Path(run_dir).glob(f"{PREFIX_CHECKPOINT_DIR}-*"), key=lambda p: p.stat().st_mtime)
    needed = _folder_bytes(whole[-1]) if whole else None
    no_space = any(getattr(e, "errno", None) in (errno.ENOSPC, errno.EDQUOT) for e in chain)
    no_space = no_space or "No space left" in text or "unexpected pos" in text
    if not no_space:
        if needed is not None and free < needed and hasattr(error, "add_note"):  # Python 3.11+
            error.add_note(
                f"{free / 2**20:.1f} MiB free on the file system of {run_dir}, less than the newest checkpoint "
                f"({whole[-1].name}) takes ({needed / 2**20:.1f} MiB): the disk may be the cause."
            )
        return None
    size = f", the newest checkpoint ({whole[-1].name}) takes {needed / 2**20:.1f} MiB" if needed else ""
    intact = f" The checkpoints already there are intact (newest: {whole[-1].name})." if whole else ""
    return OSError(
        errno.ENOSPC,
        f"Saving {name} to {run_dir} failed ({type(error).__name__}: {str(error).splitlines()[0][:200]}): "
        f"{free / 2**20:.1f} MiB free on that file system{size}. Fix: free space, lower save_total_limit, or set "
        f"output_dir on a larger disk.{intact}",
    )


FINAL_STAGING = "final"


def save_into_place(save: Callable[[str], None], output_dir: str, writer: bool, barrier: Callable[[], None]) -> None:
    """`save(folder)` (every rank calls it: gathers are collective) into `output_dir/.saving/final`, then, on the
    `writer` process, each file moved into `output_dir`, the weights before `config.json` (a `from_pretrained` never
    finds a config without its weights). A failed save leaves `output_dir` untouched; a full disk is named."""
    staged = os.path.join(staging_root(output_dir), FINAL_STAGING)
    try:
        if writer:
            shutil.rmtree(staged, ignore_errors=True)
        barrier()
        save(staged)
        barrier()
        if writer:
            _fsync_tree(staged)
            files = sorted((p for p in Path(staged).rglob("*") if p.is_file()), key=_move_order)
            for path in files:
                target = Path(output_dir, path.relative_to(staged))
                target.parent.mkdir(parents=True, exist_ok=True)
                os.replace(path, target)
            _fsync_dir(output_dir)
            _remove_staged(staged)
        barrier()
    except Exception as error:  # safetensors' SafetensorError is none of OSError / RuntimeError
        if writer:
            _remove_staged(staged)
        full = disk_full_error(error, output_dir, "the model")
        if full is None:
            raise
        raise full from error


def _remove_staged(staged: str) -> None:
    shutil.rmtree(staged, ignore_errors=True)
    with contextlib.suppress(OSError):  # leave no empty staging folder behind
        os.rmdir(os.path.dirname(staged))


def _move_order(path: Path) -> tuple[bool, bool]:
    """Weights and the rest first, then the shard indexes, `config.json` last."""
    return path.name == "config.json", path.name.endswith(".index.json")
