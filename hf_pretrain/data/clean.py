"""The "clean" block: strip markup and junk from documents, normalise the text, drop bad documents.

Rules, in the order they run (the first rule a document fails is its one drop reason):

1. `not_text`: the text is None or not a string (a number, a list), as the reader counts it;
   `empty`: the text is only whitespace (also after the rewrites).
2. `too_large`: more than `max_bytes` UTF-8 bytes (default 10 MB), checked before any regex, so a
   50 MB document never stalls a worker.
3. Rewrites, which never drop on their own: HTML (`<script>`/`<style>` blocks with their content,
   comments, doctype, tags of HTML elements, block elements becoming line breaks; then `&...;`
   entities unescaped), Unicode normal form (NFKC; then C0/C1 controls, zero-width space, word
   joiner, soft hyphen and BOM removed), URLs (`http://`, `https://`, `ftp://`, also `<URL>`),
   e-mail addresses, whitespace (line breaks to `\n`, runs of spaces and tabs inside a line to one
   space, line ends stripped, at most one blank line; indentation kept: code needs it).
4. `too_short`: fewer than `min_tokens` tokens (default 32; Gopher: 50 words).
5. Quality rules, on the non-blank lines and on the words (whitespace-separated tokens with a letter,
   digit or `_`: punctuation tokens do not count, as in datatrove). Gopher = Rae et al. 2021,
   "Scaling Language Models: Methods, Analysis & Insights from Training Gopher", section A.1.1 and
   table A1; FineWeb = Penedo et al. 2024, datatrove's `FineWebQualityFilter`. Defaults:
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
6. `too_long`: more than `max_tokens` tokens (default 2048) with `long_documents="drop"`. With the
   default "split", the document is cut at paragraph breaks (at line breaks, then between words, for
   a paragraph or line too long on its own) into pieces of similar size of at most `max_tokens`
   tokens, no word lost; pieces under `min_tokens` are then dropped as `too_short` (and, with a
   tokenizer, a single word longer than `max_tokens` as `too_long`).

Every rule is a `CleanConfig` field: a bool or None switches a rewrite off, None disables a rule.
Tokens are whitespace-separated words unless the block is given a `tokenizer` (any callable taking
a list of texts and returning their `input_ids`, e.g. a transformers tokenizer; special tokens are
not counted where it takes `add_special_tokens`).

Measured on the embedded corpus (`embedded_documents()` with Python 3.11: 426 documents of pydoc
topics and stdlib docstrings, much of it code, grammar and tables) with the defaults: 410 kept
(96.2 %); dropped: too_short 6 (headings with a line of text, 19-29 words), duplicate_line_chars 6
(docstrings repeated by inheriting classes, e.g. "Base class for arithmetic errors." 12 times),
alpha_words 3 (doctest sessions, lists of numbers), symbol_ratio 1 (a doctest with `...` prompts);
none split; 9 URLs removed, no e-mail address, HTML tag or entity; whitespace normalisation
rewrites 366 documents (double spaces after full stops, aligned columns). Each quality rule alone
drops: duplicate_lines 0, duplicate_line_chars 6, symbol_ratio 2, bullet_lines 0, ellipsis_lines
0, alpha_words 4 (1 at 0.70), word_length 0, stop_words 2, line_punct 58.

HTML tags are only removed from a document that shows HTML (a closing tag, a tag with an attribute,
a comment, a doctype, `<br>`, `<hr>` or `<img>`), and only tags named after HTML elements: Python's
documentation writes placeholders like `<body>`, `<value>` or `<class 'int'>`, which stay. URLs
without a scheme (`www.example.com`) stay too: in code they are strings. Every regex runs in time
linear in the text (no rescanning on unclosed `<script>` or `<!--`, runs matched from their start).

Counters in `stats.extra`: `urls_removed`, `emails_removed`, `html_tags_removed` (a script, style or
comment block counts one), `html_entities_unescaped`, `split_documents` (documents cut into more
than one piece) and `tokens_out`. They are summed over the rows that come out of the block (each
document's counts ride on its first kept piece, in helper columns), so they are exact with worker
processes and on streams; a dropped document's removals are not counted: its text is gone.

Written by hand with `re`, `html` and `unicodedata`: datatrove has these filters, but on its own
document model and executors; this package stays on `datasets` (see `blocks.py`).
"""

from __future__ import annotations

import html
import inspect
import math
import re
import string
import unicodedata
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pyarrow.compute as pc
from datasets import Dataset, IterableDataset

from .blocks import DROP, FIRST, Block

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
STOP_WORDS = frozenset({"the", "be", "to", "of", "and", "that", "have", "with"})  # Gopher's list
BULLETS = ("•", "-", "*", "‣", "◦", "●", "–", "·")
ELLIPSES = ("...", "…")
LINE_PUNCT = (".", "!", "?", '"', "'")  # FineWeb's stop characters


@dataclass
class CleanConfig:
    """Every rule of the clean block; None (or False) turns a rule off. Sources in the module docstring."""

    max_bytes: int | None = 10_000_000  # larger documents dropped as "too_large" before any work
    remove_html: bool = True  # script/style blocks, comments, HTML element tags; then &entities;
    normalize_unicode: str | None = "NFKC"  # Unicode normal form (then invisible characters removed); None keeps
    remove_urls: bool = True  # http(s):// and ftp:// URLs
    remove_emails: bool = True
    normalize_whitespace: bool = True  # one space inside lines, no trailing spaces, <= 1 blank line
    min_tokens: int | None = 32  # shorter documents (and split pieces) dropped as "too_short"
    max_tokens: int | None = 2048  # longer documents split or dropped as "too_long"
    long_documents: str = "split"  # "split" at paragraph/line/word boundaries, or "drop"
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


# --- rewrites -------------------------------------------------------------------------------------

_HTML_ELEMENTS = (
    "a abbr acronym address area article aside audio b base bdi bdo big blockquote body br button canvas caption "
    "center cite code col colgroup data datalist dd del details dfn dialog div dl dt em embed fieldset figcaption "
    "figure font footer form frame frameset h1 h2 h3 h4 h5 h6 head header hgroup hr html i iframe img input ins kbd "
    "label legend li link main map mark meta meter nav nobr noscript object ol optgroup option output p param "
    "picture pre progress q rp rt ruby s samp section select small source span strike strong sub summary sup svg "
    "table tbody td template textarea tfoot th thead time title tr track tt u ul var video wbr"
)
_BLOCK_ELEMENTS = (
    "address article aside blockquote body br dd details dialog div dl dt fieldset figcaption figure footer form "
    "frame h1 h2 h3 h4 h5 h6 head header hgroup hr html li main nav ol p pre section summary table tbody tfoot "
    "thead title tr ul"
)
HTML_ELEMENTS = frozenset(_HTML_ELEMENTS.split())
BLOCK_ELEMENTS = frozenset(_BLOCK_ELEMENTS.split())  # replaced by a line break, so words do not run together
CELL_ELEMENTS = frozenset({"td", "th"})
_NAMES = "|".join(sorted(HTML_ELEMENTS, key=len, reverse=True))
# Blocks removed with their content, each with its closing tag: a block is only looked for before the last
# closing tag, so unclosed openers never make the lazy `.*?` scan to the end of the text again and again.
_HTML_BLOCKS = tuple(
    (re.compile(opener + r".*?" + closer, re.IGNORECASE | re.DOTALL), re.compile(closer, re.IGNORECASE), replacement)
    for opener, closer, replacement in (
        (r"<!--", r"-->", ""),
        (r"<script\b[^<>]*>", r"</script\s*>", "\n"),
        (r"<style\b[^<>]*>", r"</style\s*>", "\n"),
    )
)
_HTML_TAG = re.compile(rf"<!doctype\b[^<>]*>|</?(?P<name>{_NAMES})(?=[\s/>])[^<>]*>", re.IGNORECASE)
_HTML_EVIDENCE = re.compile(
    rf"</(?:{_NAMES})\s*>|<(?:{_NAMES})\s+[\w:-]+\s*=|<!--|<!doctype\b|<(?:br|hr|img)\b[^<>]*>", re.IGNORECASE
)
_ENTITY = re.compile(r"&(?:#[0-9]{1,7}|#[xX][0-9a-fA-F]{1,6}|[A-Za-z][A-Za-z0-9]{1,31});")
_URL_BODY = r"(?:https?|ftp)://[^\s<>\"'`]+"
_URL = re.compile(rf"<(?:URL:)?{_URL_BODY}>|\b{_URL_BODY}", re.IGNORECASE)
_URL_TRAILING = ".,;:!?"
_BRACKETS = {")": "(", "]": "[", "}": "{"}
# The lookbehind starts a match only at the beginning of a run: linear time on long words.
_EMAIL = re.compile(r"(?<![\w.+-])[\w.+-]+@[\w-]+(?:\.[\w-]+)*\.[A-Za-z]{2,}\b")
_INVISIBLE = re.compile("[\x00-\x08\x0e-\x1f\x7f-\x84\x86-\x9f\u00ad\u200b\u2060\ufeff]")
_NEWLINES = re.compile("\r\n|[\r\x0b\x0c\x85\u2028\u2029]")
_TRAILING_SPACE = re.compile(r"(?<![^\S\n])[^\S\n]+$", re.MULTILINE)
_INNER_SPACE = re.compile(r"(?<=\S)(?:[^\S\n]{2,}|[^\S\n ])")
_BLANK_LINES = re.compile(r"\n{3,}")
_HAS_ALPHA = re.compile(r"[^\W\d_]")  # a letter
_HAS_WORD_CHAR = re.compile(r"\w")


def _html_tag(match: re.Match) -> str:
    name = (match.group("name") or "").lower()
    if name in BLOCK_ELEMENTS:
        return "\n"
    return " " if name in CELL_ELEMENTS else ""


def _remove_blocks(text: str) -> tuple[str, int]:
    count = 0
    for block, closer, replacement in _HTML_BLOCKS:
        ends = [m.end() for m in closer.finditer(text)]
        if ends:
            head, n = block.subn(replacement, text[: ends[-1]])
            text, count = head + text[ends[-1] :], count + n
    return text, count


def remove_html(text: str) -> tuple[str, int, int]:
    """Text without HTML markup, entities unescaped; with the numbers of tags (or blocks) and entities removed."""
    tags = 0
    if "<" in text and _HTML_EVIDENCE.search(text):
        text, blocks = _remove_blocks(text)
        text, tags = _HTML_TAG.subn(_html_tag, text)
        tags += blocks
    entities = 0
    if "&" in text:

        def unescape(match: re.Match) -> str:
            nonlocal entities
            out = html.unescape(match.group())
            entities += out != match.group()
            return out

        text = _ENTITY.sub(unescape, text)
    return text, tags, entities


def _url_tail(match: re.Match) -> str:
    """What to keep of a URL match: trailing punctuation and unbalanced closing brackets."""
    url = match.group()
    if url.startswith("<"):
        return ""
    unbalanced = {close: url.count(close) - url.count(opening) for close, opening in _BRACKETS.items()}
    end = len(url)
    while end:
        char = url[end - 1]
        if unbalanced.get(char, 0) > 0:
            unbalanced[char] -= 1
        elif char not in _URL_TRAILING:
            break
        end -= 1
    return url[end:]


def remove_urls(text: str) -> tuple[str, int]:
    return _URL.subn(_url_tail, text) if "://" in text else (text, 0)


def remove_emails(text: str) -> tuple[str, int]:
    return _EMAIL.subn("", text) if "@" in text else (text, 0)


def normalize_unicode(text: str, form: str) -> str:
    return _INVISIBLE.sub("", unicodedata.normalize(form, text))


def normalize_whitespace(text: str) -> str:
    text = _NEWLINES.sub("\n", text)
    text = _TRAILING_SPACE.sub("", text)
    text = _INNER_SPACE.sub(" ", text)
    return _BLANK_LINES.sub("\n\n", text).strip("\n")


# --- quality --------------------------------------------------------------------------------------


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


def quality_reason(text: str, config: CleanConfig) -> str:
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

    def run(
        self, data: Dataset | IterableDataset, rank: int = 0, world_size: int = 1, num_proc: int | None = None
    ) -> Dataset | IterableDataset:
        kept = super().run(data, rank, world_size, num_proc)
        columns = list(COUNT_COLUMNS.values())
        if isinstance(kept, Dataset):
            return kept.remove_columns([c for c in columns if c in kept.column_names])
        extra = self.stats.extra  # this run's stats, filled as the stream is consumed
        extra.update(dict.fromkeys(COUNTERS, 0))

        def count(row: dict) -> dict:
            for name, column in COUNT_COLUMNS.items():
                extra[name] += row[column]
            return {}

        return kept.map(count, remove_columns=columns)

    def finish(self, kept: Dataset) -> None:
        table = kept.select_columns(list(COUNT_COLUMNS.values())).with_format("arrow")[:]
        for name, column in COUNT_COLUMNS.items():
            self.stats.extra[name] = pc.sum(table.column(column)).as_py() or 0
