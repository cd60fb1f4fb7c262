"""Check a checkpoint before a resume reads it: every file the resume needs is there and readable.

`Trainer` resumes from whatever `checkpoint-N` it is given or finds newest: without `optimizer.pt` silently with a
fresh AdamW, with a truncated `model.safetensors` failing deep inside safetensors without naming the file.
`check_checkpoint` reads headers and zip directories, never the tensors: `trainer_state.json` and
`hf_pretrain_state.json` (a checkpoint of plain transformers has none: a warning says what its resume loses);
the weights (`model.safetensors` long enough for every tensor its header lists, `pytorch_model.bin`, a sharded
index and its shards, a PEFT adapter; under DeepSpeed the tag folder named by `latest`; under FSDP accelerate's
DCP folders, each with the `.metadata` the coordinator writes last, or its full `.bin` files); `optimizer.pt` and
`scheduler.pt` (`torch.save` zips keep their directory at the end, so a cut file fails to open), unless
`save_only_model`; the RNG state of each rank (saved for another number of processes: a warning only).
An explicit path with a problem raises `CheckpointError` naming each file, what is wrong and the fix; `True`
skips to the newest whole checkpoint (`checkpointing.py`). Written by hand: neither transformers nor accelerate
validates a checkpoint before loading it.
"""

from __future__ import annotations

import json
import os
import re
import struct
import zipfile
from dataclasses import dataclass
from pathlib import Path

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from .store import RUN_STATE_NAME

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin", "adapter_model.safetensors", "adapter_model.bin")
INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed, with the files at fault and the fix."""


@dataclass
class CheckpointCheck:
    path: str
    problems: list[str]  # "file: what is wrong"; empty when the checkpoint can be resumed
    warnings: list[str]

    @property
    def ok(self) -> bool:
        return not self.problems


def check_checkpoint(
    path: str | os.PathLike,
    world_size: int = 1,
    deepspeed: bool = False,
    save_only_model: bool = False,
    fsdp: bool = False,
) -> CheckpointCheck:
    folder = Path(path)
    if not folder.is_dir():
        return CheckpointCheck(str(folder), [f"{folder}: no such checkpoint folder"], [])
    problems: list[str] = []
    warnings: list[str] = []
    problems += _json_problem(folder / "trainer_state.json", required=True)
    run_state_problems, run_state_warnings = _run_state_problems(folder / RUN_STATE_NAME)
    problems += run_state_problems
    warnings += run_state_warnings
    if deepspeed:
        problems += _deepspeed_problems(folder)
    elif fsdp:
        problems += _fsdp_problems(folder, "pytorch_model_fsdp", "the weights")
    else:
        problems += _weight_problems(folder)
    if not save_only_model:
        if fsdp:
            problems += _fsdp_problems(folder, "optimizer", "a resume would start a fresh optimizer")
        elif not deepspeed:
            problems += _zip_problem(
                folder / "optimizer.pt", missing="missing (a resume would start a fresh optimizer)"
            )
        problems += _zip_problem(folder / "scheduler.pt", missing="missing (the learning rate would restart)")
        rng = _rng_problems(folder, world_size)
        if rng and _has_rng_for_other_world_size(folder, world_size):
            warnings += [f"{problem}; resuming anyway (saved for another number of processes)" for problem in rng]
        else:
            problems += rng
    return CheckpointCheck(str(folder), problems, warnings)


def checkpoints_newest_first(run_dir: str | os.PathLike) -> list[Path]:
    pattern = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")
    found = [
        (int(m.group(1)), p) for p in Path(run_dir).glob(f"{PREFIX_CHECKPOINT_DIR}-*") if (m := pattern.match(p.name))
    ]
    return [p for _, p in sorted(found, reverse=True) if p.is_dir()]


def explain(check: CheckpointCheck) -> str:
    return "; ".join(check.problems)


def _json_problem(path: Path, required: bool) -> list[str]:
    if not path.exists():
        return [f"{path.name}: missing"] if required else []
    try:
        json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        return [f"{path.name}: unreadable ({type(error).__name__}: {error})"]
    return []


def _run_state_problems(path: Path) -> tuple[list[str], list[str]]:
    """(problems, warnings) of `hf_pretrain_state.json`: a missing file warns, a malformed one is a problem."""
    if not path.exists():
        return [], [
            f"{path.name}: missing (a checkpoint of plain transformers has none; if PretrainTrainer wrote this one, "
            "it was lost: a stream is read again from its start, the loss guard starts anew); resuming from the step count"
        ]
    problems = _json_problem(path, required=True)
    if problems:
        return problems, []
    state = json.loads(path.read_text(encoding="utf-8"))
    wrong = _run_state_shape(state)
    return ([f"{path.name}: malformed ({wrong})"] if wrong else []), []


def _run_state_shape(state) -> str | None:
    """What in the run state is not what the resume reads, or None."""
    if not isinstance(state, dict):
        return f"a JSON object expected, not {type(state).__name__}"
    for key in ("data", "stream", "loss_guard"):
        if key in state and not isinstance(state[key], dict):
            return f"{key!r} must be an object, not {type(state[key]).__name__}"
    data, stream = state.get("data", {}), state.get("stream", {})
    for owner, key, kind in (
        ("data", "epoch", int),
        ("data", "samples_consumed_in_epoch", int),
        ("stream", "state", dict),
        ("stream", "micro_batches", int),
    ):
        values = data if owner == "data" else stream
        if values and not isinstance(values.get(key), kind):
            return f"{owner}.{key} must be {'an integer' if kind is int else 'an object'}, not {values.get(key)!r}"
    return None


def _zip_problem(path: Path, missing: str = "missing") -> list[str]:
    if not path.exists():
        return [f"{path.name}: {missing}"]
    try:
        with zipfile.ZipFile(path) as archive:
            archive.infolist()
    except (OSError, zipfile.BadZipFile) as error:
        return [f"{path.name}: unreadable, cut or corrupt ({error}; {path.stat().st_size} bytes)"]
    return []


def _safetensors_problem(path: Path) -> list[str]:
    """The header must parse and the file must hold every byte the header points at."""
    size = path.stat().st_size
    try:
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            if length > size - 8:
                raise ValueError(f"header of {length} bytes in a file of {size}")
            header = json.loads(f.read(length))
        end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    except (OSError, struct.error, ValueError, KeyError, TypeError) as error:
        return [f"{path.name}: unreadable header ({error})"]
    if 8 + length + end > size:
        return [f"{path.name}: cut short ({size} bytes, its header needs {8 + length + end})"]
    return []


def _weight_file_problem(path: Path) -> list[str]:
    return _safetensors_problem(path) if path.suffix == ".safetensors" else _zip_problem(path)


def _weight_problems(folder: Path) -> list[str]:
    for name in WEIGHT_FILES:
        if (folder / name).exists():
            return _weight_file_problem(folder / name)
    for name in INDEX_FILES:
        index = folder / name
        if index.exists():
            problems = _json_problem(index, required=True)
            if problems:
                return problems
            shards = sorted(set(json.loads(index.read_text(encoding="utf-8")).get("weight_map", {}).values()))
            missing = [s for s in shards if not (folder / s).exists()]
            if missing:
                return [f"{name}: shards missing: {', '.join(missing)}"]
            return [p for s in shards for p in _weight_file_problem(folder / s)]
    return [f"model weights: none of {', '.join(WEIGHT_FILES)} or a sharded index"]


def _fsdp_problems(folder: Path, name: str, what: str) -> list[str]:
    """accelerate's FSDP state: the DCP folder `{name}_0/` (sharded) or the file `{name}.bin` (full)."""
    sharded, full = folder / f"{name}_0", folder / f"{name}.bin"
    if sharded.is_dir():
        if not (sharded / ".metadata").exists():
            return [f"{sharded.name}/.metadata: missing (the sharded save did not finish)"]
        if not any(sharded.glob("*.distcp")):
            return [f"{sharded.name}/: no *.distcp shards"]
        return []
    if full.exists():
        return _zip_problem(full)
    return [f"{sharded.name}/ or {full.name}: missing ({what})"]


def _deepspeed_problems(folder: Path) -> list[str]:
    latest = folder / "latest"
    if not latest.exists():
        return ["latest: missing (DeepSpeed names its state folder there)"]
    tag = folder / latest.read_text(encoding="utf-8").strip()
    states = sorted(tag.glob("*.pt")) if tag.is_dir() else []
    if not states:
        return [f"{tag.name}/: missing or empty (DeepSpeed's weights and optimizer states)"]
    return [f"{tag.name}/{p}" for state in states for p in _zip_problem(state)]


def _rng_names(world_size: int) -> list[str]:
    return ["rng_state.pth"] if world_size <= 1 else [f"rng_state_{rank}.pth" for rank in range(world_size)]


def _rng_problems(folder: Path, world_size: int) -> list[str]:
    problems = []
    for name in _rng_names(world_size):
        problems += _zip_problem(folder / name, missing="missing (the random streams would not resume)")
    return problems


def _has_rng_for_other_world_size(folder: Path, world_size: int) -> bool:
    mine = set(_rng_names(world_size))
    return any(p.name not in mine for p in folder.glob("rng_state*.pth"))
