"""Log-likelihood requests: (context, continuation) pairs as tokens, then rows and batches for the model.

Tokenization follows lm-eval-harness's `HFLM` (0.4), so the same tokens are scored:
- trailing whitespace of the context moves to the start of the continuation;
- `context + continuation` and `context` are each encoded with the tokenizer's own special tokens
  (a Llama tokenizer adds BOS, GPT-2's and hf_pretrain's BPE add none: the context is then scored
  from its first token, without a BOS, as lm-eval does); the continuation's tokens are the whole's
  past the context's length;
- an empty context is replaced by the prefix token: BOS, else EOS (a tokenizer with neither cannot
  score an empty context: error);
- a request longer than the model's positions keeps its last `max_length + 1` tokens (left
  truncation); the number truncated is counted and said. An example with a continuation longer than
  the positions by itself cannot be scored whole: it is skipped, counted and said (lm-eval stops).

Batching, our own: the model input of a request is `(context + continuation)[:-1]`; requests with
the same input (e.g. single-token answers " A" / " B" after one context) share one sequence. Packed
(`pack=True`: hf_pretrain's models with `position_ids` restarting per document, each attending only
to itself), sequences fill rows of at most `max_length` tokens; else each sequence is its own row,
right-padded (a causal model never looks right, so no mask).
Rows are sorted longest first and grouped into batches of at most `batch_tokens` tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .tasks import Example

DEFAULT_MAX_LENGTH = 2048  # lm-eval's default when neither the config nor the tokenizer names one
_TOKENIZER_INFINITY = 10**18  # transformers' "no limit" model_max_length is about 1e30


@dataclass(frozen=True)
class Request:
    task: str
    example: int  # index of the example in its task's list
    choice: int
    context: str
    continuation: str


@dataclass
class Encoded:
    request: Request
    context_ids: list[int]
    continuation_ids: list[int]

    @property
    def input_ids(self) -> tuple[int, ...]:
        return tuple((self.context_ids + self.continuation_ids)[:-1])


def requests_of(task: str, examples: Sequence[Example]) -> list[Request]:
    return [
        Request(task, i, c, ctx, cont)
        for i, example in enumerate(examples)
        for c, (ctx, cont) in enumerate(zip(example.contexts, example.continuations))
    ]


def max_length_of(model_config, tokenizer=None, default: int = DEFAULT_MAX_LENGTH) -> int:
    """The model's context length, looked up as lm-eval does: config, then tokenizer, then `default`."""
    config = getattr(model_config, "text_config", None) or model_config
    for name in ("n_positions", "max_position_embeddings", "n_ctx"):
        value = getattr(config, name, None)
        if value is not None:
            return int(value)
    limit = getattr(tokenizer, "model_max_length", None)
    return int(limit) if limit is not None and limit < _TOKENIZER_INFINITY else default


def prefix_token_id(tokenizer) -> int:
    for token in (tokenizer.bos_token_id, tokenizer.eos_token_id):
        if token is not None:
            return token
    raise ValueError(
        "An empty context is scored after the tokenizer's BOS (or EOS) token, and this tokenizer has neither: "
        "set tokenizer.bos_token (or eos_token)."
    )


class Encoder:
    """Encodes requests with a transformers tokenizer the way lm-eval's HFLM does; texts are encoded once."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._cache: dict[str, list[int]] = {}
        prefix = next((t for t in (tokenizer.bos_token_id, tokenizer.eos_token_id) if t is not None), None)
        self._bos_text = tokenizer.decode([prefix]) if prefix is not None else None

    def encode_all(self, texts: list[str]) -> None:
        todo = list(dict.fromkeys(t for t in texts if t not in self._cache))
        plain = [t for t in todo if not (self._bos_text and t.startswith(self._bos_text))]
        if plain:
            for text, ids in zip(plain, self.tokenizer(plain)["input_ids"]):
                self._cache[text] = list(ids)
        for text in set(todo) - set(
            plain
        ):  # starts with the prefix token: no special tokens (lm-eval's has_bos_prefix)
            self._cache[text] = self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def encode(self, requests: Sequence[Request]) -> list[Encoded]:
        pairs = []
        for r in requests:
            context, continuation = r.context, r.continuation
            spaces = len(context) - len(context.rstrip())
            if spaces:
                context, continuation = context[:-spaces], context[-spaces:] + continuation
            pairs.append((context, continuation))
        self.encode_all([c + k for c, k in pairs if c] + [c for c, _ in pairs if c])
        empty = [k for c, k in pairs if not c]
        bare = self.tokenizer(empty, add_special_tokens=False)["input_ids"] if empty else []
        out, bare_iter = [], iter(bare)
        for request, (context, continuation) in zip(requests, pairs):
            if not context:
                ids = list(next(bare_iter))
                prefix = prefix_token_id(self.tokenizer)
                context_ids, continuation_ids = ([prefix], ids) if ids[:1] != [prefix] else (ids[:1], ids[1:])
            else:
                context_ids = self._cache[context]
                continuation_ids = self._cache[context + continuation][len(context_ids) :]
            if not continuation_ids:
                raise ValueError(
                    f"{request.task} example {request.example} choice {request.choice}: the continuation "
                    f"{request.continuation!r} encodes to no token after its context."
                )
            out.append(Encoded(request, context_ids, continuation_ids))
        return out


@dataclass
class Segment:
    """One model input sequence and the requests scored on it (same input, their own continuation tokens)."""

    input_ids: tuple[int, ...]
    scored: list[tuple[int, list[int]]]  # (request number, continuation tokens scored at the end of the input)


@dataclass
class Row:
    segments: list[Segment]

    @property
    def length(self) -> int:
        return sum(len(s.input_ids) for s in self.segments)


def too_long(encoded: Sequence[Encoded], max_length: int) -> set[tuple[str, int]]:
    """The (task, example) whose some continuation alone exceeds the model's positions: it cannot be scored whole
    (lm-eval stops with an assertion there)."""
    return {(e.request.task, e.request.example) for e in encoded if len(e.continuation_ids) > max_length}


def segments_of(encoded: Sequence[Encoded], max_length: int, skip: set[int] = frozenset()) -> tuple[list[Segment], int]:
    """One segment per distinct model input (left-truncated to `max_length`), requests in `skip` left out; returns
    them and how many requests were truncated."""
    by_input: dict[tuple[int, ...], Segment] = {}
    truncated = 0
    for number, e in enumerate(encoded):
        if number in skip:
            continue
        whole = e.context_ids + e.continuation_ids
        truncated += len(whole) > max_length + 1
        inputs = tuple(whole[-(max_length + 1) :][:-1])
        segment = by_input.setdefault(inputs, Segment(inputs, []))
        segment.scored.append((number, e.continuation_ids))
    return list(by_input.values()), truncated


def rows_of(segments: list[Segment], max_length: int, pack: bool) -> list[Row]:
    """Segments into rows, longest first: packed first-fit up to `max_length` tokens, or one segment a row."""
    ordered = sorted(segments, key=lambda s: (-len(s.input_ids), s.input_ids))
    if not pack:
        return [Row([s]) for s in ordered]
    rows: list[Row] = []
    room: list[int] = []
    for segment in ordered:
        size = len(segment.input_ids)
        slot = next((i for i, free in enumerate(room) if free >= size), None)
        if slot is None:
            rows.append(Row([segment]))
            room.append(max_length - size)
        else:
            rows[slot].segments.append(segment)
            room[slot] -= size
    return rows


def batches_of(rows: list[Row], batch_tokens: int) -> list[list[Row]]:
    """Rows (longest first) grouped so that rows x the longest row's length stays within `batch_tokens`."""
    ordered = sorted(rows, key=lambda r: -r.length)
    batches: list[list[Row]] = []
    for row in ordered:
        if batches and (len(batches[-1]) + 1) * batches[-1][0].length <= batch_tokens:
            batches[-1].append(row)
        else:
            batches.append([row])
    return batches
