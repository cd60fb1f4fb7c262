"""The data chain end to end: read -> clean -> perplexity filter -> dedup -> tokenizer -> pack.

`PipelineConfig` (a JSON file for `hf-pretrain data prepare CONFIG`) names the input, the output
folder and one section per step; a section set to `null` skips that step (the perplexity filter
is off by default: it needs a model). `run_pipeline(config)` runs the steps in order, each
writing `OUTPUT/NN-step/` (an Arrow `save_to_disk` folder, or the tokenizer) and then its
`stats.json` last, atomically, beside `step.json` (the step's key: a hash of its settings, of the
input files' names, sizes and modification times for the read, and of the key of the step before
it). A step whose `stats.json` exists under the same key is complete, and a relaunched `prepare`
(or a second run of the example on the same cache) reuses it instead of running it again; a
changed setting or input file runs that step and every later one again. Each step shows one progress
bar (`datasets`' own bars are off inside it). At the end it writes `OUTPUT/stats.json` (every step's
counters) and prints a one-screen summary table.

Held-out text: after dedup, a `heldout_fraction` of documents (`split.split_by_hash`, the one rule
of every data path) is set aside; a `save_to_disk` DatasetDict input that brings its own
held-out split (`heldout`, `validation` or `test`) keeps it instead, and every document block runs
on each split. The tokenizer reports bytes per token on the held-out text and the pack step packs
it separately (`OUTPUT/NN-pack/heldout`), so evaluation never sees a training document; a held-out
split too small to fill one block is left unpacked, with the reason in its stats (`skipped`).

The chain's one wiring: `hf-pretrain data prepare`, `examples/pretrain.py` and the precision trial
all run it through `run_pipeline` / `Pipeline`.

On a large corpus: run one `prepare` per machine with `rank` / `world_size` set: each reads its
own files and writes its own output folder; dedup is then within each rank's shard (see the data
guide for the cross-shard pass).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
from pathlib import Path

from datasets import Dataset, DatasetDict, concatenate_datasets, load_from_disk

from .blocks import BlockStats, from_pretrained
from .pipeline_config import PipelineConfig
from .read import ReadFiles, list_files
from .split import own_heldout, split_by_hash
from .workers import children_die_with_parent


def _done(folder: Path, key: str | None = None) -> bool:
    """Complete: `stats.json` written, under `key` when one is given."""
    if not (folder / "stats.json").exists():
        return False
    return key is None or (folder / "step.json").exists() and json.loads((folder / "step.json").read_text()) == key


def _write_stats(folder: Path, stats: list[BlockStats]) -> None:
    tmp = folder / "stats.json.tmp"
    tmp.write_text(json.dumps([s.to_dict() for s in stats], indent=2) + "\n")
    os.replace(tmp, folder / "stats.json")


def _read_stats(folder: Path) -> list[BlockStats]:
    return [BlockStats(**s) for s in json.loads((folder / "stats.json").read_text())]


def files_signature(path: str | Path) -> list:
    """The files at `path` (a file or a folder) with their sizes and modification times: what a step read. The
    cache files `datasets` writes beside the data of a `save_to_disk` folder (`cache-*.arrow`, `tmp*`) are left out."""
    path = Path(path)
    if not path.exists():  # a tokenizer's name on the Hub, not a folder
        return [str(path)]
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    files = [p for p in files if not (p.name.startswith("cache-") and p.suffix == ".arrow" or p.name.startswith("tmp"))]
    return [[p.as_posix(), p.stat().st_size, p.stat().st_mtime_ns] for p in files]


@contextlib.contextmanager
def one_bar(label: str):
    """One progress bar for a step of the chain, in place of `datasets`' bars for each map, filter and save in it
    (their switch is restored after)."""
    import datasets
    from tqdm.auto import tqdm

    were_off = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    bar = tqdm(total=1, desc=label, leave=True)
    try:
        yield
        bar.update(1)
    finally:
        bar.close()
        if not were_off:
            datasets.enable_progress_bars()


def _key(*parts) -> str:
    return hashlib.sha1(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


class Pipeline:
    """The chain's steps in order; `reused` names the steps found complete, `verbose` prints the summary table."""

    def __init__(self, config: PipelineConfig, verbose: bool = True):
        self.config = config
        self.verbose = verbose
        self.out = Path(config.output_dir)
        self.stats: list[BlockStats] = []
        self.reused: list[str] = []
        self.key = ""  # the last step's key: every step's key includes the one before

    def _step(self, index: int, name: str, settings, run) -> Path:
        """Run one step into OUTPUT/NN-name unless it is complete under the same key; returns the folder."""
        folder = self.out / f"{index:02d}-{name}"
        self.key = _key(self.key, name, settings)
        if _done(folder, self.key):
            self.reused.append(name)
        else:
            if folder.exists():
                shutil.rmtree(folder)  # an interrupted earlier attempt, or one with other settings
            folder.mkdir(parents=True)
            (folder / "step.json").write_text(json.dumps(self.key))
            with one_bar(f"[data] {index:02d}-{name}"):
                _write_stats(folder, run(folder))
        self.stats += _read_stats(folder)
        return folder

    @children_die_with_parent()
    def run(self) -> list[BlockStats]:
        c = self.config
        self.stats, self.reused, self.key = [], [], ""
        list_files(c.input)  # a missing or empty input is one line before any key is computed
        read = [files_signature(c.input), c.text_column, c.max_bytes, c.rank, c.world_size]
        data_dir = self._step(0, "read", read, self._read)
        for index, name, section, block in self._document_blocks():
            run = lambda folder, d=data_dir, b=block: self._apply(b, d, folder)  # noqa: E731
            data_dir = self._step(index, name, [section, c.text_column], run)
        split_dir = self._step(5, "split", c.heldout_fraction, lambda folder: self._split(data_dir, folder))
        if c.tokenizer is not None:
            settings = [c.tokenizer, files_signature(c.tokenizer["path"]) if "path" in c.tokenizer else None]
            tok_dir = self._step(6, "tokenizer", settings, lambda folder: self._tokenizer(split_dir, folder))
            if c.pack is not None:
                self._step(7, "pack", c.pack, lambda folder: self._pack(split_dir, tok_dir, folder))
        _write_stats(self.out, self.stats)
        if self.verbose:
            print(summary_table(self.stats, self.reused))
        return self.stats

    def _read(self, folder: Path) -> list[BlockStats]:
        """The input's documents; with the input's own held-out split, a DatasetDict of train and heldout."""
        c = self.config
        reader = ReadFiles(c.text_column, c.max_bytes)
        data = reader.run(c.input, c.rank, c.world_size, c.num_proc)
        stats = [reader.stats]
        kind, _ = list_files(c.input)
        loaded = load_from_disk(c.input) if kind == "disk" else None
        own = own_heldout(loaded) if isinstance(loaded, DatasetDict) else None
        if own:
            if "train" not in loaded:
                raise ValueError(f"input={c.input!r} has splits {list(loaded)}, no 'train'; save one named train.")
            held = ReadFiles(c.text_column, c.max_bytes)
            heldout = held.read_dataset(loaded[own], f"{Path(c.input).name}/{own}", c.rank, c.world_size, c.num_proc)
            data = DatasetDict(train=data, heldout=heldout)
            stats.append(dataclasses.replace(held.stats, block="read heldout"))
        data.save_to_disk(str(folder / "data"))
        return stats

    def _document_blocks(self):
        from .clean import Clean, CleanConfig
        from .dedup import ExactDedup, MinHashDedup
        from .perplexity import PerplexityFilter

        c = self.config
        if c.clean is not None:
            yield 1, "clean", c.clean, [Clean(CleanConfig(**c.clean), text_column=c.text_column)]
        if c.perplexity is not None:
            yield 2, "perplexity", c.perplexity, [PerplexityFilter(text_column=c.text_column, **c.perplexity)]
        if c.dedup is not None:
            options = dict(c.dedup)
            blocks = [ExactDedup(text_column=c.text_column)] if options.pop("exact", True) else []
            if options.pop("minhash", True):
                blocks.append(MinHashDedup(text_column=c.text_column, **options))
            yield 3, "dedup", c.dedup, blocks

    def _apply(self, blocks: list, data_dir: Path, folder: Path) -> list[BlockStats]:
        """The blocks in order over the data (over each split, when the input brought its own)."""
        loaded = load_from_disk(str(data_dir / "data"))
        splits = dict(loaded) if isinstance(loaded, DatasetDict) else {"": loaded}
        stats = []
        for split, data in splits.items():
            for block in blocks:
                data = block.run(data, num_proc=self.config.num_proc)
                stats.append(dataclasses.replace(block.stats, block=f"{block.name} {split}".strip()))
            splits[split] = data
        (DatasetDict(splits) if isinstance(loaded, DatasetDict) else splits[""]).save_to_disk(str(folder / "data"))
        return stats

    def _split(self, data_dir: Path, folder: Path) -> list[BlockStats]:
        c = self.config
        data = load_from_disk(str(data_dir / "data"))
        own = isinstance(data, DatasetDict)
        splits = data if own else split_by_hash(data, c.heldout_fraction, c.text_column, c.num_proc)
        splits.save_to_disk(str(folder / "data"))
        train, heldout = len(splits["train"]), len(splits["heldout"])
        stats = BlockStats("split", documents_in=train + heldout, documents_out=train)
        stats.extra.update(train=train, heldout=heldout, heldout_fraction=None if own else c.heldout_fraction)
        return [stats]

    def _tokenizer(self, split_dir: Path, folder: Path) -> list[BlockStats]:
        c = self.config
        splits = load_from_disk(str(split_dir / "data"))
        heldout = list(splits["heldout"][c.text_column][:1000])
        return make_tokenizer(splits["train"], heldout, c.tokenizer, folder, c.text_column)

    def _pack(self, split_dir: Path, tok_dir: Path, folder: Path) -> list[BlockStats]:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(str(tok_dir / "tokenizer"))
        splits = load_from_disk(str(split_dir / "data"))
        c = self.config
        return pack_splits(splits, tokenizer, c.text_column, c.pack, c.num_proc, lambda split: folder / split)


def make_tokenizer(
    train: Dataset, heldout: list[str], options: dict, folder: Path, text_column: str
) -> list[BlockStats]:
    """The tokenizer step into `folder/tokenizer`: trained on `train`, or `options["path"]` copied; bytes per token
    measured on the `heldout` texts."""
    from .tokenizer import measure_bytes_per_token, train_tokenizer

    options = dict(options)
    if "path" in options:  # an existing tokenizer: copy it, measure it
        from transformers import AutoTokenizer

        tokenizer = from_pretrained(AutoTokenizer, options["path"], "path")
        tokenizer.save_pretrained(str(folder / "tokenizer"))
        extra = {"reused": options["path"], "vocab_size": len(tokenizer)}
        extra.update(measure_bytes_per_token(tokenizer, heldout, train, text_column))
        return [BlockStats("tokenizer", extra=extra)]
    _, stats = train_tokenizer(train, folder / "tokenizer", text_column=text_column, heldout_texts=heldout, **options)
    return [stats]


def pack_splits(
    splits, tokenizer, text_column: str, options: dict, num_proc: int | None, output, required=("train",)
) -> list[BlockStats]:
    """Pack the train and heldout splits into `output(split)`; a split in `required` that cannot fill one block is an
    error, another one is left unpacked with the reason in its stats (`skipped`)."""
    from .packing import Pack

    out = []
    for split in ("train", "heldout"):
        if len(splits[split]) == 0 and split not in required:
            continue
        pack = Pack(tokenizer, text_column=text_column, **options)
        pack.name = f"pack {split}"
        try:
            pack.run(splits[split], num_proc=num_proc).save_to_disk(str(output(split)))
        except ValueError as err:
            if split in required:
                raise
            skipped = {"skipped": str(err)}  # too little text for one block: no data of this split
            out.append(BlockStats(pack.name, documents_in=len(splits[split]), extra=skipped))
            continue
        pack.stats.block = pack.name
        out.append(pack.stats)
    return out


def run_pipeline(config: PipelineConfig, verbose: bool = True) -> list[BlockStats]:
    """The chain in this process (the default), or, with an `executor` section, as tasks on datatrove's local, Slurm
    or Ray executor (`data/engines/`)."""
    if config.executor is not None:
        from .engines import run_engine

        return run_engine(config, verbose)
    return Pipeline(config, verbose).run()


def summary_table(stats: list[BlockStats], reused: list[str] = ()) -> str:
    lines = [f"{'step':<16} {'docs in':>11} {'docs out':>11} {'MB in':>9} {'MB out':>9} {'docs/s':>9}  dropped / notes"]
    for s in stats:
        rate = s.documents_in / s.seconds if s.seconds else 0
        notes = ", ".join(f"{k} {v:,}" for k, v in sorted(s.dropped.items(), key=lambda x: -x[1]))
        extra = {
            k: v
            for k, v in s.extra.items()
            if k
            in (
                "bytes_per_token",
                "tokens",
                "blocks",
                "near_duplicates",
                "exact_duplicates",
                "heldout",
                "vocab_size",
                "skipped",
            )
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


def _last_step(output_dir: str | Path, name: str) -> Path:
    folder = next(iter(sorted(Path(output_dir).glob(f"*-{name}"))), None)
    if folder is None or not _done(folder):
        raise FileNotFoundError(f"{output_dir} has no complete {name} step; run `hf-pretrain data prepare` first.")
    return folder


def packed_path(output_dir: str | Path, split: str = "train") -> Path:
    """The folder of the packed `split` a `prepare` wrote: one `save_to_disk` folder (`load_from_disk` loads it) on
    one machine; a folder of shards, one per task, after an executor's run (`load_packed` / `load_split` read it)."""
    return _last_step(output_dir, "pack") / split


def load_packed(output_dir: str | Path) -> dict[str, Dataset]:
    """The packed train / heldout datasets a `prepare` wrote (heldout absent when it was too small to pack)."""
    folder = _last_step(output_dir, "pack")
    return {split: load_split(folder / split) for split in ("train", "heldout") if (folder / split).exists()}


def load_split(folder: Path) -> Dataset:
    """A packed split: one `save_to_disk` folder, or one per shard (an executor's run, `data/engines/`) read as one
    dataset in shard order."""
    shards = sorted(p for p in folder.iterdir() if (p / "state.json").exists())
    if (folder / "state.json").exists() or not shards:
        return load_from_disk(str(folder))
    return concatenate_datasets([load_from_disk(str(p)) for p in shards])


def tokenizer_path(output_dir: str | Path) -> Path:
    """The folder of the tokenizer a `prepare` wrote (`AutoTokenizer.from_pretrained` loads it)."""
    return _last_step(output_dir, "tokenizer") / "tokenizer"
