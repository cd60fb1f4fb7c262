"""Text corpora: the embedded default and the user's own files, as `datasets` with a held-out split.

The embedded default needs no download: it is English prose that ships with every CPython, the
reference topics of `pydoc_data` (the text behind `help("for")`) plus the docstrings of a fixed
list of pure-Python standard-library modules, about 0.7 MB. Topics are cut at blank lines into
documents of at most `max_chars` characters so that a held-out split by document is meaningful;
short paragraphs are merged into their neighbours, and the few remnants under 40 characters (bare
headings) are left out.

The held-out split is by document, chosen by a hash of the text (`split.py`, the one rule every
data path uses), so it is stable across runs, machines and orderings, and no held-out document
leaks into training.
"""

from __future__ import annotations

import importlib
import inspect
import json
from pathlib import Path

from datasets import DatasetDict

from .read import read_splits
from .split import is_heldout, own_heldout, split_by_hash

__all__ = ["embedded_documents", "is_heldout", "load_text_dataset", "write_embedded_corpus"]

STDLIB_MODULES = (
    "argparse",
    "asyncio",
    "collections",
    "contextlib",
    "csv",
    "dataclasses",
    "datetime",
    "decimal",
    "difflib",
    "email",
    "enum",
    "fractions",
    "functools",
    "heapq",
    "http.client",
    "inspect",
    "itertools",
    "json",
    "logging",
    "pathlib",
    "pickle",
    "random",
    "re",
    "shutil",
    "socket",
    "statistics",
    "string",
    "subprocess",
    "tarfile",
    "textwrap",
    "threading",
    "typing",
    "unittest",
    "urllib.parse",
    "zipfile",
)


def _split_paragraphs(text: str, max_chars: int) -> list[str]:
    docs, current = [], ""
    for para in text.split("\n\n"):
        if current and len(current) + len(para) > max_chars:
            docs.append(current.strip())
            current = ""
        current += para + "\n\n"
    if current.strip():
        docs.append(current.strip())
    return docs


def embedded_documents(max_chars: int = 2000) -> list[str]:
    """Documents from text that ships with Python: pydoc topics and stdlib docstrings."""
    from pydoc_data.topics import topics

    docs = [d for key in sorted(topics) for d in _split_paragraphs(topics[key], max_chars)]
    for name in STDLIB_MODULES:
        module = importlib.import_module(name)
        pieces = [inspect.getdoc(module) or ""]
        for attr in sorted(vars(module)):
            obj = getattr(module, attr)
            public = not attr.startswith("_") and (inspect.isclass(obj) or inspect.isfunction(obj))
            if public and (getattr(obj, "__module__", None) or "").startswith(
                name.split(".")[0]
            ):  # None: a wrapper made at run time (Ray replaces inspect.isgenerator)
                pieces.append(f"{attr}\n\n{inspect.getdoc(obj) or ''}")
        docs += _split_paragraphs("\n\n".join(p for p in pieces if len(p) > 40), max_chars)
    return [d for d in docs if len(d) >= 40]


def write_embedded_corpus(out_dir: str | Path, heldout_fraction: float = 0.05) -> dict[str, Path]:
    """Write the embedded corpus as `train.jsonl` / `heldout.jsonl` in `out_dir` (kept if present)."""
    out = Path(out_dir)
    paths = {"train": out / "train.jsonl", "heldout": out / "heldout.jsonl"}
    if all(p.exists() for p in paths.values()):
        return paths
    out.mkdir(parents=True, exist_ok=True)
    docs = embedded_documents()
    for split, path in paths.items():
        keep = [d for d in docs if is_heldout(d, heldout_fraction) == (split == "heldout")]
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps({"text": d}) + "\n" for d in keep), encoding="utf-8")
        tmp.replace(path)
    return paths


def load_text_dataset(
    path: str | Path, text_column: str = "text", heldout_fraction: float = 0.05, num_proc: int | None = None
) -> DatasetDict:
    """Load the user's data: jsonl/json/text/parquet/arrow files, a folder of them, or a `save_to_disk` folder.

    Returns a `DatasetDict` with `train` and `heldout`; an existing `heldout`/`validation`/`test` split is
    used as is, otherwise documents are split by hash (`split.split_by_hash`). Every split goes through the reader
    (`read.py`): lines and rows that are not documents (malformed JSON, invalid UTF-8, null or non-string text,
    ...) are dropped and their counts printed, every field is kept and each document gets its `doc_id`.
    """
    data = read_splits(path, text_column, num_proc)
    own = own_heldout(data)
    if own:
        return DatasetDict(train=data["train"], heldout=data[own])
    return split_by_hash(data["train"], heldout_fraction, text_column, num_proc)
