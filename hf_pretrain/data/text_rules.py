"""Text rewrites of the clean block: HTML markup, Unicode form, URLs, e-mail addresses, whitespace.

Each function takes a text and returns the rewritten text (and how many things it removed); none
drops a document. In the order `Clean` runs them:

- `remove_html`: `<script>`/`<style>` blocks with their content, comments, doctype, tags of HTML
  elements (block elements become line breaks, table cells a space); then `&...;` entities
  unescaped. Tags are only removed from a document that shows HTML (a closing tag, a tag with an
  attribute, a comment, a doctype, `<br>`, `<hr>` or `<img>`), and only tags named after HTML
  elements: Python's documentation writes placeholders like `<body>`, `<value>` or
  `<class 'int'>`, which stay.
- `normalize_unicode`: a Unicode normal form (NFKC by default); then C0/C1 controls, zero-width
  space, word joiner, soft hyphen and BOM removed.
- `remove_urls`: `http://`, `https://`, `ftp://` URLs, also `<URL>`; trailing punctuation and
  unbalanced closing brackets stay. URLs without a scheme (`www.example.com`) stay too: in code
  they are strings.
- `remove_emails`: e-mail addresses.
- `normalize_whitespace`: line breaks to `\n`, runs of spaces and tabs inside a line to one space,
  line ends stripped, at most one blank line; indentation kept (code needs it).

Every regex runs in time linear in the text (no rescanning on unclosed `<script>` or `<!--`, runs
matched from their start). Written by hand with `re`, `html` and `unicodedata`: datatrove has these
filters, but on its own document model and executors; this package stays on `datasets`.
"""

from __future__ import annotations

import html
import re
import unicodedata

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
