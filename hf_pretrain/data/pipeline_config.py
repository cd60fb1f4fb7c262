"""`PipelineConfig`: the settings of the data chain (`hf-pretrain data prepare CONFIG`), checked before any data is read.

One field per global setting and one section per step (`clean`, `perplexity`, `dedup`,
`tokenizer`, `pack`); a section set to `None` (`null` in the JSON file) skips its step. Each
section is checked against the keyword arguments of the block it configures (`settable_keys`), so
an unknown key is one line naming the section and the valid keys, and a value the block refuses is
its own error prefixed with the section. `chain/run.py` runs the steps.

Types are checked in one place, `check_types`, against the annotations of `PipelineConfig` and of
each section's block (a JSON file has no types of its own: `"0.05"` is a string), so a value of
the wrong type is one line naming the field, the type expected and the value given, before a block
compares it with anything.

`output_dir` may be an fsspec URL (`s3://bucket/prefix`): the chain then works in `work_dir` and publishes its
results to the URL (`chain/run.py`); `work_folder()` is where it works.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

from .blocks import check_rank, from_pretrained
from .split import check_fraction
from .storage import cache_root, config_key, is_url


@dataclass
class PipelineConfig:
    input: str
    output_dir: str
    text_column: str = "text"
    num_proc: int | None = None
    rank: int = 0
    world_size: int = 1
    max_bytes: int = 10_000_000
    heldout_fraction: float = 0.01
    clean: dict | None = field(default_factory=dict)  # CleanConfig fields; {} = defaults
    perplexity: dict | None = None  # {"model_path": ..., "threshold": 1500, ...}
    dedup: dict | None = field(default_factory=dict)  # DedupConfig fields: {"exact": true, "threshold": 0.8, ...}
    tokenizer: dict | None = field(default_factory=lambda: {"vocab_size": 32768})  # or {"path": existing}
    pack: dict | None = field(default_factory=lambda: {"seq_len": 4096, "mode": "best_fit"})
    executor: dict | None = (
        None  # {"kind": "local" | "slurm" | "ray", "tasks": 64, ...}: data/chain/; None: the local executor
    )
    work_dir: str | None = None  # with an output_dir URL: where the chain works (default: work_folder())

    def __post_init__(self):
        """Every field and section checked before any data is read: types, unknown keys, missing ones, values the
        blocks refuse, an output folder that cannot be one."""
        check_types(
            "", {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}, typing.get_type_hints(type(self))
        )
        check_output(self)
        check_rank(self.rank, self.world_size)
        if self.num_proc is not None and self.num_proc < 1:
            raise ValueError(f"num_proc={self.num_proc}: use a number of worker processes >= 1, or null.")
        check_fraction(self.heldout_fraction)
        for name, check in (
            ("clean", _check_clean),
            ("perplexity", _check_perplexity),
            ("dedup", _check_dedup),
            ("tokenizer", _check_tokenizer),
            ("pack", _check_pack),
            ("executor", _check_executor),
        ):
            values = getattr(self, name)
            if values is None:
                continue
            try:
                check(values)
            except (TypeError, ValueError) as err:  # a value a block refuses: name the section
                raise ValueError(str(err) if str(err).startswith("section") else f"section {name!r}: {err}") from None

    def work_folder(self) -> Path:
        """Where the chain works: `output_dir` itself, or for a URL `work_dir`, by default
        `cache_root()/chain/<hash of the URL>` (`storage.cache_root`: `$HF_PRETRAIN_CACHE` or ~/.cache/hf_pretrain)."""
        if not is_url(self.output_dir):
            return Path(self.output_dir)
        return Path(self.work_dir) if self.work_dir else cache_root() / "chain" / config_key(self.output_dir)

    @classmethod
    def from_file(cls, path: str | Path) -> PipelineConfig:
        if not Path(path).is_file():
            raise FileNotFoundError(f"config file {str(path)!r} does not exist; pass the JSON file of the pipeline.")
        try:
            values = json.loads(Path(path).read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{path} is not valid JSON: {err}.") from None
        if not isinstance(values, dict):
            raise ValueError(f"{path}: expected a JSON object of PipelineConfig fields, not {type(values).__name__}.")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"{path}: unknown field(s) {unknown}; the fields are {sorted(known)}.")
        missing = [name for name in ("input", "output_dir") if name not in values]
        if missing:
            raise ValueError(f"{path}: missing field(s) {missing}.")
        try:
            return cls(**values)
        except (TypeError, ValueError) as err:
            raise ValueError(f"{path}: {err}") from None


def _check_clean(values) -> None:
    from .clean import CleanConfig

    CleanConfig(**check_section("clean", values, settable_keys(CleanConfig)))


def _check_perplexity(values) -> None:
    from .perplexity import PerplexityFilter  # torch: imported only when the step is on

    PerplexityFilter(**check_section("perplexity", values, settable_keys(PerplexityFilter), required=("model_path",)))


def _check_dedup(values) -> None:
    from .dedup import DedupConfig

    DedupConfig(**check_section("dedup", values, settable_keys(DedupConfig)))


def _check_tokenizer(values) -> None:
    keys = {"path": str} if isinstance(values, dict) and "path" in values else {"vocab_size": int, "min_frequency": int}
    check_section("tokenizer", values, keys, required=tuple(keys)[:1])
    if "path" in values:
        from transformers import AutoTokenizer

        from .prepared import tokenizer_folder

        from_pretrained(AutoTokenizer, tokenizer_folder(values["path"]), "path")


def _check_pack(values) -> None:
    from .packing import MODES, Pack, check_seq_len

    check_section("pack", values, settable_keys(Pack, "tokenizer"))
    check_seq_len(values.get("seq_len", 4096))
    if values.get("mode", "best_fit") not in MODES:
        raise ValueError(f"mode={values['mode']!r} is invalid; use one of {list(MODES)}.")


def _check_executor(values) -> None:
    from .executor_config import ExecutorConfig

    ExecutorConfig(**check_section("executor", values, settable_keys(ExecutorConfig))).check_installed()


def settable_keys(owner, *also_internal: str) -> dict[str, object]:
    """The keyword arguments a config section may set for `owner` (a dataclass or a block's __init__), with their
    annotated types (`object`, which takes anything, where an annotation cannot be resolved)."""
    target = owner if dataclasses.is_dataclass(owner) else owner.__init__
    try:
        hints = typing.get_type_hints(target)
    except NameError:  # an annotation imported only for type checkers
        hints = {}
    if dataclasses.is_dataclass(owner):
        names = [f.name for f in dataclasses.fields(owner)]
    else:
        internal = {"self", "text_column", *also_internal}
        names = [name for name in inspect.signature(owner.__init__).parameters if name not in internal]
    return {name: hints.get(name, object) for name in names}


def check_section(name: str, values, valid: dict[str, object], required: tuple[str, ...] = ()) -> dict:
    """`values` if it is an object of known keys holding the `required` ones, each of its type; else the one-line
    error."""
    if not isinstance(values, dict):
        raise ValueError(f"section {name!r} must be an object of settings or null (skips the step), not {values!r}.")
    unknown = sorted(set(values) - set(valid))
    if unknown:
        raise ValueError(f"section {name!r} has unknown key(s) {unknown}; valid keys are {sorted(valid)}.")
    missing = [key for key in required if key not in values]
    if missing:
        raise ValueError(f"section {name!r} lacks {missing}; valid keys are {sorted(valid)}.")
    check_types(f"section {name!r}: ", values, valid)
    return values


_EXPECTED = {bool: "true or false", int: "a whole number", float: "a number", str: "a string", dict: "an object"}
_EXPECTED[type(None)] = "null"
_GIVEN = {**_EXPECTED, bool: "a boolean", float: "a decimal number", list: "a list"}


def _accepts(hint, value) -> bool:
    """Whether `value` (parsed JSON) is of the annotated type `hint`: a bool is no number, an int is a float."""
    if hint is object or hint is typing.Any:
        return True
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return any(_accepts(arg, value) for arg in typing.get_args(hint))
    hint = typing.get_origin(hint) or hint  # list[str] -> list
    if hint in (int, float) and isinstance(value, bool):
        return False
    if hint is float:
        return isinstance(value, (int, float))
    return isinstance(value, hint) if isinstance(hint, type) else True


def _described(hint) -> str:
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return " or ".join(_described(arg) for arg in typing.get_args(hint))
    hint = typing.get_origin(hint) or hint
    return _EXPECTED.get(hint, f"a {getattr(hint, '__name__', hint)}")


def check_types(where: str, values: dict, hints: dict) -> None:
    """Each of `values` of its type in `hints`, or one line: the field, the type expected, the value given (and, for
    a number or a switch written as a string, the same value without quotes)."""
    for name, value in values.items():
        hint = hints.get(name, object)
        if _accepts(hint, value):
            continue
        fix = "."
        if isinstance(value, str):
            try:
                unquoted = json.loads(value)
            except ValueError:
                unquoted = None
            if unquoted is not None and _accepts(hint, unquoted):
                fix = f': write "{name}": {json.dumps(unquoted)}, without quotes.'
        given = _GIVEN.get(type(value), f"a {type(value).__name__}")
        raise ValueError(f"{where}{name}={value!r} is {given}; expected {_described(hint)}{fix}")


def check_output(config: PipelineConfig) -> None:
    """A local `output_dir` is a folder (no `work_dir`); a URL's `work_dir` is a local folder, given when tasks may
    run on other machines (Slurm, Ray), whose work must meet in one shared folder."""
    if not is_url(config.output_dir):
        if config.work_dir is not None:
            raise ValueError(
                f"work_dir={config.work_dir!r} is for an output_dir URL (s3://...); a local output_dir "
                f"({config.output_dir!r}) is where the chain works: remove work_dir."
            )
        return check_folder(config.output_dir, "output_dir")
    if config.work_dir is None:
        kind = (config.executor or {}).get("kind", "local")
        if kind != "local":
            raise ValueError(
                f"work_dir: executor {kind!r} with output_dir={config.output_dir!r} needs work_dir, a folder on a "
                "filesystem every node shares (its tasks meet there before publishing to the URL)."
            )
        return None
    if is_url(config.work_dir):
        raise ValueError(f"work_dir={config.work_dir!r} is a URL: pass a local (or shared-filesystem) folder.")
    return check_folder(config.work_dir, "work_dir")


def check_folder(path: str, field: str) -> None:
    """`path` is a folder or can be made one (nothing in the way is a file), or one line naming `field`."""
    for above in (Path(path), *Path(path).parents):
        if above.exists():
            if not above.is_dir():
                where = "is a file" if above == Path(path) else f"is inside {str(above)!r}, a file"
                raise ValueError(f"{field}={str(path)!r} {where}: pass a folder (it is created when missing).")
            return
