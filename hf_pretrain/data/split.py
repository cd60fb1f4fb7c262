"""The held-out split: which documents are measured and never trained on. One rule, used by every data path.

A document is held out when the first 8 bytes of the SHA-1 of its text, read as a fraction of
2**64, are below `fraction` (`is_heldout`). The split is by document and depends on the text
alone, so it is stable across runs, machines, orderings, ranks and worker processes, and no
held-out document leaks into training; exact duplicates land on the same side. `split_by_hash`
applies the rule to a `Dataset` (a batched map, `num_proc` workers, then two filters: order kept).

Data that brings its own held-out split (a `save_to_disk` DatasetDict with a split named in
`HELDOUT_SPLITS`) keeps it: `own_heldout` finds it, and the callers use it as is instead of
hashing (`corpus.load_text_dataset`, the pipeline's read and split steps).

Users of this module: `corpus.write_embedded_corpus` / `load_text_dataset`, the pipeline's
`split` step (so `hf-pretrain data prepare`, the example and the trial), and
`hf-pretrain data train-tokenizer`.
"""

from __future__ import annotations

import functools
import hashlib

from datasets import Dataset, DatasetDict

HELDOUT_SPLITS = ("heldout", "validation", "test")  # names of a split the data brings, in this order
_FLAG = "_heldout"


def is_heldout(text: str, fraction: float) -> bool:
    """Deterministic document-level split: the first 8 bytes of SHA-1 of the text as a fraction."""
    digest = int.from_bytes(hashlib.sha1(text.encode("utf-8")).digest()[:8], "big")
    return digest / 2**64 < fraction


def check_fraction(fraction: float, field: str = "heldout_fraction") -> None:
    if not 0 <= fraction < 1:
        raise ValueError(f"{field}={fraction}: use a fraction in [0, 1), e.g. 0.01.")


def _flags(texts: list[str], fraction: float) -> dict[str, list[bool]]:
    return {_FLAG: [is_heldout(t, fraction) for t in texts]}


def _side(flags: list[bool], heldout: bool) -> list[bool]:
    return [flag == heldout for flag in flags]


def split_by_hash(
    data: Dataset, fraction: float, text_column: str = "text", num_proc: int | None = None
) -> DatasetDict:
    """`train` and `heldout` of `data` by `is_heldout` of each text, each in the order of `data`."""
    check_fraction(fraction)
    if len(data) == 0:
        return DatasetDict(train=data, heldout=data)
    flagged = data.map(
        functools.partial(_flags, fraction=fraction),
        input_columns=[text_column],
        batched=True,
        num_proc=num_proc,
        desc="held-out split",
    )
    sides = {
        name: flagged.filter(
            functools.partial(_side, heldout=name == "heldout"), input_columns=[_FLAG], batched=True, num_proc=num_proc
        ).remove_columns(_FLAG)
        for name in ("train", "heldout")
    }
    return DatasetDict(sides)


def own_heldout(splits) -> str | None:
    """The name of the held-out split `splits` (a DatasetDict, or its split names) brings, or None."""
    return next((name for name in HELDOUT_SPLITS if name in splits), None)
