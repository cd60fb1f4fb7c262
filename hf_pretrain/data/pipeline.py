"""The data chain end to end: read -> clean -> perplexity filter -> dedup -> tokenizer -> pack.

`PipelineConfig` (a JSON file for `hf-pretrain data prepare CONFIG`) names the input, the output
folder and one section per step; a section set to `null` skips that step (the perplexity filter
is off by default: it needs a model). `run_pipeline(config)` runs the steps in order, each
writing `OUTPUT/NN-step/` (an Arrow `save_to_disk` folder, or the tokenizer) and then its
`stats.json` last, atomically: a step whose `stats.json` exists is complete, and a relaunched
`prepare` reuses it instead of running it again. At the end it writes `OUTPUT/stats.json` (every
step's counters) and prints a one-screen summary table.

Held-out text: after dedup, a `heldout_fraction` of documents (by hash of the text, the same rule
as `corpus.is_heldout`) is set aside; the tokenizer reports bytes per token on it and the pack
step packs it separately (`OUTPUT/NN-pack/heldout`), so evaluation never sees a training document.

On a large corpus: run one `prepare` per machine with `rank` / `world_size` set: each reads its
own files and writes its own output folder; dedup is then within each rank's shard (see the data
guide for the cross-shard pass).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path

from datasets import Dataset, DatasetDict, load_from_disk

from .blocks import BlockStats, check_rank
from .corpus import is_heldout
from .read import ReadFiles
from .workers import children_die_with_parent


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
    dedup: dict | None = field(default_factory=dict)  # {"exact": true, "threshold": 0.8, "num_perm": 128, ...}
    tokenizer: dict | None = field(default_factory=lambda: {"vocab_size": 32768})  # or {"path": existing}
    pack: dict | None = field(default_factory=lambda: {"seq_len": 4096, "mode": "best_fit"})

    def __post_init__(self):
        """Every section checked before any data is read: unknown keys, missing ones, values the blocks refuse."""
        check_rank(self.rank, self.world_size)
        if self.num_proc is not None and self.num_proc < 1:
            raise ValueError(f"num_proc={self.num_proc}: use a number of worker processes >= 1, or null.")
        if not 0 <= self.heldout_fraction < 1:
            raise ValueError(f"heldout_fraction={self.heldout_fraction}: use a fraction in [0, 1), e.g. 0.01.")
        for name, check in (
            ("clean", _check_clean),
            ("perplexity", _check_perplexity),
            ("dedup", _check_dedup),
            ("tokenizer", _check_tokenizer),
            ("pack", _check_pack),
        ):
            values = getattr(self, name)
            if values is None:
                continue
            try:
                check(values)
            except (TypeError, ValueError) as err:  # a value a block refuses: name the section
                raise ValueError(str(err) if str(err).startswith("section") else f"section {name!r}: {err}") from None

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

    check_section("perplexity", values, settable_keys(PerplexityFilter), required=("model_path",))


def _check_dedup(values) -> None:
    from .dedup import MinHashDedup

    options = dict(check_section("dedup", values, {"exact", "minhash", *settable_keys(MinHashDedup)}))
    options.pop("exact", None)
    if options.pop("minhash", True):
        MinHashDedup(**{**options, "verbose": False})


def _check_tokenizer(values) -> None:
    keys = ("path",) if isinstance(values, dict) and "path" in values else ("vocab_size", "min_frequency")
    check_section("tokenizer", values, keys, required=keys[:1])


def _check_pack(values) -> None:
    from .packing import MODES, Pack, check_seq_len

    check_section("pack", values, settable_keys(Pack, "tokenizer"))
    check_seq_len(values.get("seq_len", 4096))
    if values.get("mode", "best_fit") not in MODES:
        raise ValueError(f"mode={values['mode']!r} is invalid; use one of {list(MODES)}.")


def settable_keys(owner, *also_internal: str) -> set[str]:
    """The keyword arguments a config section may set for `owner` (a dataclass or a block's __init__)."""
    if dataclasses.is_dataclass(owner):
        return {f.name for f in dataclasses.fields(owner)}
    internal = {"self", "text_column", *also_internal}
    return set(inspect.signature(owner.__init__).parameters) - internal


def check_section(name: str, values, valid, required: tuple[str, ...] = ()) -> dict:
    """`values` if it is an object of known keys holding the `required` ones; else the one-line error."""
    if not isinstance(values, dict):
        raise ValueError(f"section {name!r} must be an object of settings or null (skips the step), not {values!r}.")
    unknown = sorted(set(values) - set(valid))
    if unknown:
        raise ValueError(f"section {name!r} has unknown key(s) {unknown}; valid keys are {sorted(valid)}.")
    missing = [key for key in required if key not in values]
    if missing:
        raise ValueError(f"section {name!r} lacks {missing}; valid keys are {sorted(valid)}.")
    return values


def _done(folder: Path) -> bool:
    return (folder / "stats.json").exists()


def _write_stats(folder: Path, stats: list[BlockStats]) -> None:
    tmp = folder / "stats.json.tmp"
    tmp.write_text(json.dumps([s.to_dict() for s in stats], indent=2) + "\n")
    os.replace(tmp, folder / "stats.json")


def _read_stats(folder: Path) -> list[BlockStats]:
    return [BlockStats(**s) for s in json.loads((folder / "stats.json").read_text())]


class Pipeline:
    def __init__(self, config: PipelineConfig):
        self.config = config
        self.out = Path(config.output_dir)
        self.stats: list[BlockStats] = []
        self.reused: list[str] = []

    def _step(self, index: int, name: str, run) -> Path:
        """Run one step into OUTPUT/NN-name unless it is complete; returns the folder."""
        folder = self.out / f"{index:02d}-{name}"
        if _done(folder):
            self.reused.append(name)
        else:
            if folder.exists():
                shutil.rmtree(folder)  # an interrupted earlier attempt
            folder.mkdir(parents=True)
            _write_stats(folder, run(folder))
        self.stats += _read_stats(folder)
        return folder

    @children_die_with_parent()
    def run(self) -> list[BlockStats]:
        c = self.config
        data_dir = self._step(0, "read", self._read)
        for index, name, block in self._document_blocks():
            data_dir = self._step(index, name, lambda folder, d=data_dir, b=block: self._apply(b, d, folder))
        split_dir = self._step(5, "split", lambda folder, d=data_dir: self._split(d, folder))
        if c.tokenizer is not None:
            tok_dir = self._step(6, "tokenizer", lambda folder: self._tokenizer(split_dir, folder))
            if c.pack is not None:
                self._step(7, "pack", lambda folder: self._pack(split_dir, tok_dir, folder))
        _write_stats(self.out, self.stats)
        print(summary_table(self.stats, self.reused))
        return self.stats

    def _read(self, folder: Path) -> list[BlockStats]:
        c = self.config
        reader = ReadFiles(c.text_column, c.max_bytes)
        reader.run(c.input, c.rank, c.world_size, c.num_proc).save_to_disk(str(folder / "data"))
        return [reader.stats]

    def _document_blocks(self):
        from .clean import Clean, CleanConfig
        from .dedup import ExactDedup, MinHashDedup
        from .perplexity import PerplexityFilter

        c = self.config
        if c.clean is not None:
            yield 1, "clean", [Clean(CleanConfig(**c.clean), text_column=c.text_column)]
        if c.perplexity is not None:
            yield 2, "perplexity", [PerplexityFilter(text_column=c.text_column, **c.perplexity)]
        if c.dedup is not None:
            options = dict(c.dedup)
            blocks = [ExactDedup(text_column=c.text_column)] if options.pop("exact", True) else []
            if options.pop("minhash", True):
                blocks.append(MinHashDedup(text_column=c.text_column, **options))
            yield 3, "dedup", blocks

    def _apply(self, blocks: list, data_dir: Path, folder: Path) -> list[BlockStats]:
        data = load_from_disk(str(data_dir / "data"))
        for block in blocks:
            data = block.run(data, num_proc=self.config.num_proc)
        data.save_to_disk(str(folder / "data"))
        return [block.stats for block in blocks]

    def _split(self, data_dir: Path, folder: Path) -> list[BlockStats]:
        c = self.config
        data = load_from_disk(str(data_dir / "data"))
        flags = [is_heldout(t, c.heldout_fraction) for t in data[c.text_column]]
        heldout = [i for i, h in enumerate(flags) if h]
        train = [i for i, h in enumerate(flags) if not h]
        DatasetDict(train=data.select(train), heldout=data.select(heldout)).save_to_disk(str(folder / "data"))
        stats = BlockStats("split", documents_in=len(data), documents_out=len(train))
        stats.extra.update(train=len(train), heldout=len(heldout), heldout_fraction=c.heldout_fraction)
        return [stats]

    def _tokenizer(self, split_dir: Path, folder: Path) -> list[BlockStats]:
        from .tokenizer import train_tokenizer

        c = self.config
        splits = load_from_disk(str(split_dir / "data"))
        options = dict(c.tokenizer)
        if "path" in options:  # an existing tokenizer: copy it, measure it
            from transformers import AutoTokenizer

            AutoTokenizer.from_pretrained(options["path"]).save_pretrained(str(folder / "tokenizer"))
            return [BlockStats("tokenizer", extra={"reused": options["path"]})]
        heldout = list(splits["heldout"][c.text_column][:1000])
        _, stats = train_tokenizer(
            splits["train"], folder / "tokenizer", text_column=c.text_column, heldout_texts=heldout, **options
        )
        return [stats]

    def _pack(self, split_dir: Path, tok_dir: Path, folder: Path) -> list[BlockStats]:
        from transformers import AutoTokenizer

        from .packing import Pack

        c = self.config
        tokenizer = AutoTokenizer.from_pretrained(str(tok_dir / "tokenizer"))
        splits = load_from_disk(str(split_dir / "data"))
        out = []
        for split in ("train", "heldout"):
            if len(splits[split]) == 0:
                continue
            pack = Pack(tokenizer, text_column=c.text_column, **c.pack)
            pack.name = f"pack {split}"
            pack.run(splits[split], num_proc=c.num_proc).save_to_disk(str(folder / split))
            pack.stats.block = pack.name
            out.append(pack.stats)
        return out


def run_pipeline(config: PipelineConfig) -> list[BlockStats]:
    return Pipeline(config).run()


def summary_table(stats: list[BlockStats], reused: list[str] = ()) -> str:
    lines = [f"{'step':<16} {'docs in':>11} {'docs out':>11} {'MB in':>9} {'MB out':>9} {'docs/s':>9}  dropped / notes"]
    for s in stats:
        rate = s.documents_in / s.seconds if s.seconds else 0
        notes = ", ".join(f"{k} {v:,}" for k, v in sorted(s.dropped.items(), key=lambda x: -x[1]))
        extra = {
            k: v
            for k, v in s.extra.items()
            if k
            in ("bytes_per_token", "tokens", "blocks", "near_duplicates", "exact_duplicates", "heldout", "vocab_size")
        }
        notes = "; ".join(
            filter(
                None, [notes, ", ".join(f"{k} {v:,}" if isinstance(v, int) else f"{k} {v}" for k, v in extra.items())]
            )
        )
        lines.append(
            f"{s.block:<16} {s.documents_in:>11,} {s.documents_out:>11,} {s.bytes_in / 1e6:>9.1f} {s.bytes_out / 1e6:>9.1f} {rate:>9,.0f}  {notes}"
        )
    if reused:
        lines.append(f"(complete from an earlier run, reused: {', '.join(reused)})")
    return "\n".join(lines)


def load_packed(output_dir: str | Path) -> dict[str, Dataset]:
    """The packed train / heldout datasets a `prepare` wrote."""
    folder = next(iter(sorted(Path(output_dir).glob("*-pack"))), None)
    if folder is None or not _done(folder):
        raise FileNotFoundError(f"{output_dir} has no complete pack step; run `hf-pretrain data prepare` first.")
    return {split: load_from_disk(str(folder / split)) for split in ("train", "heldout") if (folder / split).exists()}
