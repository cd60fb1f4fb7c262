"""Quality rules of the clean block (Gopher, FineWeb): `quality_reason(text, config)`.

The rules run on the non-blank lines and on the words (whitespace-separated tokens with a letter,
digit or `_`: punctuation tokens do not count, as in datatrove); the first rule a document fails
is its drop reason. Gopher = Rae et al. 2021, "Scaling Language Models: Methods, Analysis &
Insights from Training Gopher", section A.1.1 and table A1; FineWeb = Penedo et al. 2024,
datatrove's `FineWebQualityFilter`. Thresholds are `QualityThresholds` fields, which `CleanConfig` has
(None turns a rule off):

- `duplicate_lines`: > 0.30 of the lines repeat an earlier line (Gopher 0.30);
- `duplicate_line_chars`: > 0.20 of the characters are in such lines (Gopher 0.20); lines without
  a letter or digit (table borders, `----` rules) are not counted as repeats;
- `symbol_ratio`: `#`, or `...`/`…`, per word > 0.10 (Gopher 0.10);
- `bullet_lines`: > 0.90 of the lines start with a bullet (`•`, `-`, `*`, ...) (Gopher 0.90);
- `ellipsis_lines`: > 0.30 of the lines end with `...`/`…` (Gopher 0.30);
- `alpha_words`: < 0.80 of the words contain a letter (Gopher 0.80);
- `word_length`: mean word length (surrounding punctuation stripped) outside [3, 10] (Gopher);
- `stop_words`: fewer than 2 of "the be to of and that have with" (Gopher 2). Off by default: it
  drops every non-English document;
- `line_punct`: < 0.12 of the lines end in `. ! ? " '` (FineWeb 0.12). Off by default: it is
  meant for web boilerplate (menus, link lists) and drops line-wrapped prose, code and tables.

Written by hand: datatrove has these rules on its own document model (see `text_rules.py`).
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass

STOP_WORDS = frozenset({"the", "be", "to", "of", "and", "that", "have", "with"})  # Gopher's list
BULLETS = ("•", "-", "*", "‣", "◦", "●", "–", "·")
ELLIPSES = ("...", "…")
LINE_PUNCT = (".", "!", "?", '"', "'")  # FineWeb's stop characters
_HAS_ALPHA = re.compile(r"[^\W\d_]")  # a letter
_HAS_WORD_CHAR = re.compile(r"\w")


@dataclass
class QualityThresholds:
    """The thresholds of the quality rules (module docstring); `CleanConfig` derives from it."""

    max_duplicate_line_fraction: float | None = 0.30  # Gopher
    max_duplicate_line_char_fraction: float | None = 0.20  # Gopher
    max_symbol_word_ratio: float | None = 0.10  # Gopher: '#' or ellipses per word
    max_bullet_line_fraction: float | None = 0.90  # Gopher
    max_ellipsis_line_fraction: float | None = 0.30  # Gopher
    min_alpha_word_fraction: float | None = 0.80  # Gopher
    min_mean_word_length: float | None = 3.0  # Gopher
    max_mean_word_length: float | None = 10.0  # Gopher
    min_stop_words: int | None = None  # Gopher 2; off: English only
    min_line_punct_fraction: float | None = None  # FineWeb 0.12; off: drops code and tables


def _duplicates(lines: list[str]) -> tuple[int, int]:
    """Lines that repeat an earlier line, and their characters (Gopher), but for lines without a letter or
    digit: table borders and `----` rules repeat by design."""
    seen, count, chars = set(), 0, 0
    for line in lines:
        if line in seen:
            count += 1
            chars += len(line)
        elif _HAS_WORD_CHAR.search(line):
            seen.add(line)
    return count, chars


def _mean_word_length(words: list[str]) -> float:
    lengths = [len(word.strip(string.punctuation)) or len(word) for word in words]
    return sum(lengths) / len(lengths) if lengths else 0.0


def quality_reason(text: str, config: QualityThresholds) -> str:
    """The first quality rule `text` fails (module docstring order), or "" when it passes them all.

    Lines are the non-blank lines; words the whitespace-separated tokens with a letter, digit or `_`
    (like datatrove, which leaves punctuation tokens out of the word count).
    """
    c = config
    lines = [line for line in text.split("\n") if line.strip()]
    if not lines:
        return "empty"
    words = [word for word in text.split() if _HAS_WORD_CHAR.search(word)]
    n_words = max(len(words), 1)
    if c.max_duplicate_line_fraction is not None or c.max_duplicate_line_char_fraction is not None:
        dup_lines, dup_chars = _duplicates(lines)
        if c.max_duplicate_line_fraction is not None and dup_lines / len(lines) > c.max_duplicate_line_fraction:
            return "duplicate_lines"
        if (
            c.max_duplicate_line_char_fraction is not None
            and dup_chars / len(text) > c.max_duplicate_line_char_fraction
        ):
            return "duplicate_line_chars"
    if c.max_symbol_word_ratio is not None:
        symbols = max(text.count("#"), text.count("...") + text.count("…"))
        if symbols / n_words > c.max_symbol_word_ratio:
            return "symbol_ratio"
    if c.max_bullet_line_fraction is not None:
        bullets = sum(line.lstrip().startswith(BULLETS) for line in lines)
        if bullets / len(lines) > c.max_bullet_line_fraction:
            return "bullet_lines"
    if c.max_ellipsis_line_fraction is not None and (
        sum(line.endswith(ELLIPSES) for line in lines) / len(lines) > c.max_ellipsis_line_fraction
    ):
        return "ellipsis_lines"
    if c.min_alpha_word_fraction is not None and (
        sum(1 for w in words if _HAS_ALPHA.search(w)) / n_words < c.min_alpha_word_fraction
    ):
        return "alpha_words"
    if c.min_mean_word_length is not None or c.max_mean_word_length is not None:
        mean = _mean_word_length(words)
        if (c.min_mean_word_length is not None and mean < c.min_mean_word_length) or (
            c.max_mean_word_length is not None and mean > c.max_mean_word_length
        ):
            return "word_length"
    if c.min_stop_words is not None and sum(w.lower() in STOP_WORDS for w in words) < c.min_stop_words:
        return "stop_words"
    if c.min_line_punct_fraction is not None and (
        sum(line.endswith(LINE_PUNCT) for line in lines) / len(lines) < c.min_line_punct_fraction
    ):
        return "line_punct"
    return ""
