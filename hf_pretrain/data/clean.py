"""The "clean" block: strip markup and junk from documents, normalise the text, drop bad documents.

Rules, in the order they run (the first rule a document fails is its one drop reason): `not_text` / `empty`;
`too_large` (over `max_bytes`, checked before any regex, so a 50 MB document never stalls a worker); the rewrites
of `text_rules.py` (HTML, Unicode normal form, URLs, e-mail addresses, whitespace: they never drop); `too_short`
(under `min_tokens`); the quality rules of `quality.py` (Gopher, FineWeb); `too_long` with
`long_documents="drop"`, else the document is split at paragraph, line or word breaks into pieces of at most
`max_tokens` (no word lost; pieces under `min_tokens` dropped as `too_short`). Every rule is a `CleanConfig`
field; None (or False) switches it off. Tokens are whitespace-separated words unless a `tokenizer` is given.

Counters in `stats.extra` (`urls_removed`, `emails_removed`, `html_tags_removed`, `html_entities_unescaped`,
`split_documents`, `tokens_out`) ride on each document's first kept piece in helper columns and are summed after
the map, so they are exact with worker processes and on streams. Defaults and what they drop: docs/data.md.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyarrow.compute as pc
from datasets import Dataset, IterableDataset

from .blocks import DROP, FIRST, Block
from .quality import QualityThresholds, quality_reason
from .text_rules import (
    normalize_unicode,
    normalize_whitespace,
    remove_emails,
    remove_html,
    remove_urls,
)

UNICODE_FORMS = (None, "NFC", "NFD", "NFKC", "NFKD")
LONG_DOCUMENTS = ("split", "drop")
COUNTERS = (
    "urls_removed",
    "emails_removed",
    "html_tags_removed",
    "html_entities_unescaped",
    "split_documents",
    "tokens_out",
)
COUNT_COLUMNS = {name: f"_clean_{name}" for name in COUNTERS}  # per-row counts, summed after the map


@dataclass
class CleanConfig(QualityThresholds):
    """Every rule of the clean block (the quality thresholds are `QualityThresholds`'); None (or False) turns a
    rule off. Sources: `quality.py`, docs/data.md."""

    max_bytes: int | None = 10_000_000  # larger documents dropped as "too_large" before any work
    remove_html: bool = True  # script/style blocks, comments, HTML element tags; then &entities;
    normalize_unicode: str | None = "NFKC"  # Unicode normal form (then invisible characters removed); None keeps
    remove_urls: bool = True  # http(s):// and ftp:// URLs
    remove_emails: bool = True
    normalize_whitespace: bool = True  # one space inside lines, no trailing spaces, <= 1 blank line
    min_tokens: int | None = 32  # shorter documents (and split pieces) dropped as "too_short"
    max_tokens: int | None = 2048  # longer documents split or dropped as "too_long"
    long_documents: str = "split"  # "split" at paragraph/line/word boundaries, or "drop"

    def __post_init__(self):
        if self.normalize_unicode not in UNICODE_FORMS:
            raise ValueError(f"normalize_unicode={self.normalize_unicode!r}: use one of {UNICODE_FORMS}.")
        if self.long_documents not in LONG_DOCUMENTS:
            raise ValueError(f"long_documents={self.long_documents!r}: use one of {LONG_DOCUMENTS}.")
        for name in ("max_bytes", "min_tokens", "max_tokens", "min_stop_words"):
            value = getattr(self, name)
            if value is not None and value < (1 if name in ("max_bytes", "max_tokens") else 0):
                raise ValueError(f"{name}={value} is invalid: use a positive number or None.")
        if self.min_tokens is not None and self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} > max_tokens={self.max_tokens}.")


# --- the block ------------------------------------------------------------------------------------

_SEPARATORS = ("\n\n", "\n", " ")  # split levels: paragraphs, lines, words


def _accepts(function: Callable, name: str) -> bool:
    try:
        params = inspect.signature(function).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


class Clean(Block):
    """Rewrites the text column (markup, Unicode, whitespace) and drops or splits documents by the config's rules."""

    name = "clean"

    def __init__(self, config: CleanConfig | None = None, text_column: str = "text", tokenizer: Any = None):
        super().__init__()
        self.config = config or CleanConfig()
        self.text_column = text_column
        self.tokenizer = tokenizer
        self._tokenizer_kwargs = (
            {"add_special_tokens": False} if tokenizer is not None and _accepts(tokenizer, "add_special_tokens") else {}
        )

    # -- per document --

    def count_tokens(self, texts: list[str]) -> list[int]:
        """Tokens per text: whitespace-separated words, or the tokenizer's input_ids."""
        if self.tokenizer is None:
            return [len(t.split()) for t in texts]
        if not texts:
            return []
        out = self.tokenizer(texts, **self._tokenizer_kwargs)
        ids = out if isinstance(out, list) else out["input_ids"]
        return [len(x) for x in ids]

    def rewrite(self, text: str) -> tuple[str, dict[str, int]]:
        """The text after the rewrite rules, and how many URLs, e-mails, tags and entities went."""
        c, counts = self.config, {}
        if c.remove_html:
            text, counts["html_tags_removed"], counts["html_entities_unescaped"] = remove_html(text)
        if c.normalize_unicode:
            text = normalize_unicode(text, c.normalize_unicode)
        if c.remove_urls:
            text, counts["urls_removed"] = remove_urls(text)
        if c.remove_emails:
            text, counts["emails_removed"] = remove_emails(text)
        if c.normalize_whitespace:
            text = normalize_whitespace(text)
        return text, counts

    def clean_text(self, text: str) -> str:
        return self.rewrite(text)[0]

    def _too_large(self, text: str) -> bool:
        limit = self.config.max_bytes
        if limit is None or len(text) * 4 <= limit:  # at most 4 bytes a character
            return False
        return len(text) > limit or len(text.encode("utf-8", "surrogatepass")) > limit

    def _length_reason(self, n_tokens: int) -> str:
        c = self.config
        if c.min_tokens is not None and n_tokens < c.min_tokens:
            return "too_short"
        if c.max_tokens is not None and n_tokens > c.max_tokens:
            return "too_long"
        return ""

    def clean_document(self, text: Any) -> tuple[list[tuple[str, str, int]], dict[str, int]]:
        """One input document as (text, drop reason or "", tokens) pieces, and its rewrite counts."""
        if not isinstance(text, str):
            return [("", "not_text", 0)], {}
        if self._too_large(text):
            return [("", "too_large", 0)], {}
        text, counts = self.rewrite(text) if text.strip() else ("", {})
        if not text.strip():
            return [("", "empty", 0)], counts
        (n_tokens,) = self.count_tokens([text])
        c = self.config
        if c.min_tokens is not None and n_tokens < c.min_tokens:
            return [("", "too_short", 0)], counts
        reason = quality_reason(text, c)
        if reason:
            return [("", reason, 0)], counts
        if c.max_tokens is None or n_tokens <= c.max_tokens or c.long_documents == "drop":
            return [(text, self._length_reason(n_tokens), n_tokens)], counts
        pieces = self.split(text)
        counts["split_documents"] = int(len(pieces) > 1)
        return [(piece, self._length_reason(n), n) for piece, n in pieces], counts

    # -- splitting --

    def _units(self, text: str, level: int = 0) -> list[tuple[str, str, int]]:
        """(separator before, unit, tokens): paragraphs; lines of a paragraph too long, words of a line too long."""
        sep = _SEPARATORS[level]
        parts = text.split() if sep == " " else text.split(sep)
        units = []
        for i, (part, n) in enumerate(zip(parts, self.count_tokens(parts))):
            before = sep if i else ""
            sub = self._units(part, level + 1) if n > self.config.max_tokens and level + 1 < len(_SEPARATORS) else []
            if sub:
                units += [(before, sub[0][1], sub[0][2]), *sub[1:]]
            else:
                units.append((before, part, n))
        return units

    def _fit(self, units: list[tuple[str, str, int]]) -> list[tuple[str, int]]:
        """Join units into a piece; with a tokenizer, recount it and halve it while it is too long."""
        text = units[0][1] + "".join(sep + unit for sep, unit, _ in units[1:])
        if self.tokenizer is None:
            return [(text, sum(n for _, _, n in units))]
        (n_tokens,) = self.count_tokens([text])
        if n_tokens <= self.config.max_tokens or len(units) == 1:
            return [(text, n_tokens)]
        half = len(units) // 2
        return self._fit(units[:half]) + self._fit(units[half:])

    def split(self, text: str) -> list[tuple[str, int]]:
        """Pieces of similar size, each at most `max_tokens` (but a single unbreakable word), no text lost."""
        max_tokens = self.config.max_tokens
        units = self._units(text)
        total = sum(n for _, _, n in units)
        target = math.ceil(total / math.ceil(total / max_tokens)) if total else max_tokens
        groups, current, n_current = [], [], 0
        for unit in units:
            if current and (n_current + unit[2] > max_tokens or n_current >= target):
                groups.append(current)
                current, n_current = [], 0
            current.append(unit)
            n_current += unit[2]
        if current:
            groups.append(current)
        return [piece for group in groups for piece in self._fit(group)]

    # -- batches and counters --

    def process(self, batch: dict[str, list]) -> dict[str, list]:
        columns = list(batch)
        out = {name: [] for name in [*columns, DROP, FIRST, *COUNT_COLUMNS.values()]}
        for i, text in enumerate(batch[self.text_column]):
            pieces, counts = self.clean_document(text)
            counts_at = next((j for j, (_, reason, _) in enumerate(pieces) if not reason), None)
            for j, (piece, reason, n_tokens) in enumerate(pieces):
                for name in columns:
                    out[name].append(batch[name][i])
                out[self.text_column][-1] = "" if reason else piece
                out[DROP].append(reason)
                out[FIRST].append(j == 0)
                # A document's counts ride on its first kept piece, so summing the kept rows counts each once.
                row_counts = {**(counts if j == counts_at else {}), "tokens_out": 0 if reason else n_tokens}
                for name, column in COUNT_COLUMNS.items():
                    out[column].append(row_counts.get(name, 0))
        return out

    def finish(self, kept: Dataset) -> Dataset:
        table = kept.select_columns(list(COUNT_COLUMNS.values())).with_format("arrow")[:]
        for name, column in COUNT_COLUMNS.items():
            self.stats.extra[name] = pc.sum(table.column(column)).as_py() or 0
        return kept.remove_columns(list(COUNT_COLUMNS.values()))

    def finish_stream(self, kept: IterableDataset) -> IterableDataset:
        extra = self.stats.extra  # this run's stats, filled as the stream is consumed
        extra.update(dict.fromkeys(COUNTERS, 0))

        def count(row: dict) -> dict:
            for name, column in COUNT_COLUMNS.items():
                extra[name] += row[column]
            return {}

        return kept.map(count, remove_columns=list(COUNT_COLUMNS.values()))
