"""What a `hf-pretrain data prepare` wrote, read back: the packed splits, the tokenizer, the counters' table.

The chain (`chain/`) writes `OUTPUT/NN-stage/` folders and, last, each stage's `stats.json`; a stage folder
without it is not complete. `load_packed` / `packed_path` / `tokenizer_path` find the last complete pack and
tokenizer stage, so training, the precision trial and a mixture read a prepare's output without knowing its
stages. Also here, because both the chain and its readers need them: the signature of the files a stage read
(`files_signature`) and the summary table.

An output at an fsspec URL (`s3://...`, published by the chain) reads the same way: the steps are found by
listing the URL, and a packed split or the tokenizer is downloaded once into a local cache
(`storage.download`): training memory-maps local Arrow files and `AutoTokenizer` loads a local folder. That is a
copy of the packed tokens (and of the tokenizer), not of the corpus.
"""

from __future__ import annotations

from pathlib import Path

from datasets import Dataset, concatenate_datasets, load_from_disk

from .blocks import BlockStats
from .storage import download, exists, glob, is_url, join, signature

SUMMARY_EXTRAS = (
    "bytes_per_token",
    "tokens",
    "blocks",
    "near_duplicates",
    "exact_duplicates",
    "heldout",
    "vocab_size",
    "skipped",
)


def files_signature(path: str | Path) -> list:
    """The files at `path` (a file or a folder) with their sizes and modification times: what a step read. The
    cache files `datasets` writes beside the data of a `save_to_disk` folder (`cache-*.arrow`, `tmp*`) are left out.
    An fsspec URL: each object under it with its size and ETag (or its backend's version, `storage.signature`)."""
    if is_url(path):
        return signature(str(path))
    path = Path(path)
    if not path.exists():  # a tokenizer's name on the Hub, not a folder
        return [str(path)]
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    files = [p for p in files if not (p.name.startswith("cache-") and p.suffix == ".arrow" or p.name.startswith("tmp"))]
    return [[p.as_posix(), p.stat().st_size, p.stat().st_mtime_ns] for p in files]


def summary_table(stats: list[BlockStats], reused: list[str] = ()) -> str:
    """One line a block: documents and megabytes in and out, documents a second, drops by reason and notes."""
    lines = [f"{'step':<16} {'docs in':>11} {'docs out':>11} {'MB in':>9} {'MB out':>9} {'docs/s':>9}  dropped / notes"]
    for s in stats:
        rate = s.documents_in / s.seconds if s.seconds else 0
        dropped = ", ".join(f"{k} {v:,}" for k, v in sorted(s.dropped.items(), key=lambda x: -x[1]))
        extra = {k: v for k, v in s.extra.items() if k in SUMMARY_EXTRAS}
        shown = ", ".join(f"{k} {v:,}" if isinstance(v, int) else f"{k} {v}" for k, v in extra.items())
        notes = "; ".join(filter(None, [dropped, shown]))
        lines.append(
            f"{s.block:<16} {s.documents_in:>11,} {s.documents_out:>11,} {s.bytes_in / 1e6:>9.1f} "
            f"{s.bytes_out / 1e6:>9.1f} {rate:>9,.0f}  {notes}"
        )
    if reused:
        lines.append(f"(complete from an earlier run, reused: {', '.join(reused)})")
    return "\n".join(lines)


def _last_step(output_dir: str | Path, name: str) -> Path | str:
    """The folder (or URL) of the first `NN-name` step, when it is complete (its stats.json written last)."""
    if is_url(output_dir):
        folder = next(iter(glob(str(output_dir), f"*-{name}")), None)
        complete = folder is not None and exists(join(folder, "stats.json"))
    else:
        folder = next(iter(sorted(Path(output_dir).glob(f"*-{name}"))), None)
        complete = folder is not None and (folder / "stats.json").exists()
    if not complete:
        raise FileNotFoundError(f"{output_dir} has no complete {name} step; run `hf-pretrain data prepare` first.")
    return folder


def packed_path(output_dir: str | Path, split: str = "train") -> Path | str:
    """The folder (or URL) of the packed `split` a `prepare` wrote: a folder of shards, one per task (`load_split`
    reads it)."""
    return join(_last_step(output_dir, "pack"), split)


def load_packed(output_dir: str | Path) -> dict[str, Dataset]:
    """The packed train / heldout datasets a `prepare` wrote (heldout absent when it was too small to pack); at a URL,
    read from their local copy (module docstring)."""
    folder = _last_step(output_dir, "pack")
    on = exists if is_url(folder) else lambda path: Path(path).exists()
    return {split: load_split(join(folder, split)) for split in ("train", "heldout") if on(join(folder, split))}


def load_split(folder: Path | str) -> Dataset:
    """A packed split: one `save_to_disk` folder, or one per shard read as one dataset in shard order; a URL's
    local copy (`storage.download`)."""
    folder = download(folder) if is_url(folder) else Path(folder)
    shards = sorted(p for p in folder.iterdir() if (p / "state.json").exists())
    if (folder / "state.json").exists() or not shards:
        return load_from_disk(str(folder))
    return concatenate_datasets([load_from_disk(str(p)) for p in shards])


def documents_folder(path: str | Path) -> Path | None:
    """The documents a `prepare` kept, when `path` is its output folder (`NN-pack/documents/{train,heldout}/SHARD`,
    so one step's output is the next one's input); else None."""
    folder = next(iter(sorted(Path(path).glob("*-pack"))), None)
    if folder is None or not (folder / "stats.json").exists() or not (folder / "documents" / "train").is_dir():
        return None
    return folder / "documents"


def tokenizer_folder(path: str | Path) -> str | Path:
    """The tokenizer at `path`: a `prepare` output folder's (`tokenizer_path`), or `path` itself (a folder that
    save_pretrained wrote, or a name on the Hub)."""
    if is_url(path):
        return tokenizer_path(path)
    if any(Path(path).glob("*-tokenizer/stats.json")):
        return tokenizer_path(path)
    return path


def tokenizer_path(output_dir: str | Path) -> Path:
    """The folder of the tokenizer a `prepare` wrote (`AutoTokenizer.from_pretrained` loads it); at a URL, its local
    copy."""
    folder = join(_last_step(output_dir, "tokenizer"), "tokenizer")
    return download(folder) if is_url(folder) else folder
