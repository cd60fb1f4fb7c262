"""`DownstreamEvaluator`: a suite of tasks prepared once (examples, tokens, batches), scored on a model on demand.

Preparation (once per process): the examples of each task (`tasks.py`), their requests encoded and
batched (`requests.py`). Scoring (`evaluate(model)`): eval mode, no gradients, plain linears
(`precision.high_precision`, as `Trainer.evaluate`), an optional autocast; each batch is one
forward; the log-softmax is taken in fp32 over the scored positions only, and each request's
log-likelihood summed in fp64. Train mode is restored afterwards, even on an error.

Several processes: every rank builds the same batches (no communication) and scores every
`world_size`-th one; the log-likelihoods are summed across ranks with one `all_reduce` (a request
is scored by exactly one rank, which is checked), so every rank ends with the same figures. When
the parameters are sharded (DeepSpeed ZeRO-3, FSDP) each forward gathers them layer by layer, so
every rank must run as many forwards as the others: a rank with one batch fewer runs one
single-token forward more. No rank ever holds the full weights for it.

Tensor parallelism (`tp_size`, read off the model by default: `generation_probe.split_linear_ranks`, DeepSpeed
AutoTP's layers carry their group's size): each rank holds part of every split linear and the row-wise ones
all-reduce their partial sums over the TP group inside each forward, so the ranks of a group must run the same batch together. The unit of sharding is then the group (the
training loader's rule: data rank = rank // tp_size, consecutive ranks form a group): every `world / tp_size`-th
batch for each group, scored by all its ranks, and only the group's first rank adds the log-likelihoods to the sum;
every rank adds its count, so the check becomes "a request is scored by exactly one group, all `tp_size` ranks of
it". Sharding by rank instead ran two different batches in one forward: the all-reduce summed activations of two
examples (wrong figures when the shapes match) or stopped on a size mismatch.

Preparation is long work too (the full hellaswag, arc_easy and piqa: 46,125 requests, 10-25 s of encoding on
a 2-core CPU): requests are encoded in chunks of `ENCODE_CHUNK`, and rank 0 prints, every `progress_s`, how many
are encoded, per task, and a closing line (only if it printed one before, as below).

Progress (`progress_s`, default every 10 s of scoring; None: silent): rank 0 prints a line of the
requests its share has scored, per task and in all, the rate and the time left (from the tokens left:
rows come longest first, so requests alone would overstate it early), as lm-eval's and the Trainer's
bars do, and a last line when done (if it printed any before). Plain lines, not a bar: they read the
same in a log file as on a terminal, and between the Trainer's own log lines. With several ranks the
figures are rank 0's share; the others score theirs at about the same pace.
"""

from __future__ import annotations

import contextlib
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from ... import precision
from ..generation_probe import split_linear_ranks
from .requests import Encoded, Encoder, Row, batches_of, max_length_of, requests_of, rows_of, segments_of, too_long
from .scoring import ExampleResult, centered_mean, score_example, task_figures
from .tasks import TaskSet, build_examples, resolve_tasks

DEFAULT_BATCH_TOKENS = 8192
PROGRESS_S = 10.0  # seconds of scoring between two progress lines
ENCODE_CHUNK = 2048  # requests encoded at once: a progress line can come between two chunks


def packs_documents(model, device: torch.device) -> bool:
    """Whether packing rows pays: an hf_pretrain model (it keeps packed documents apart by their restarting
    `position_ids`; transformers' Llama, GPT-2 or Qwen2 would attend across them) whose attention runs packed rows
    without computing the masked-out scores (FlashAttention varlen, flex). SDPA and eager would compute every score
    of a full row, so short sequences one a row cost less there."""
    config = getattr(model, "config", None)
    if getattr(config, "model_type", None) != "hf_pretrain":
        return False
    from ...modeling.attention import Environment, LayerNeed, is_efficient, plan_attention

    plan = getattr(getattr(model, "model", None), "attention_plan", None)  # pinned by a training run
    if not plan:
        plan = plan_attention(config, Environment.detect(device, next(model.parameters()).dtype, False), True)
    return all(is_efficient(choice.backend, LayerNeed(layer, None, True)) for layer, choice in plan.items())


@dataclass
class DownstreamResult:
    tasks: dict[str, dict[str, float]]
    centered: float
    seconds: float
    truncated: int
    examples: dict[str, dict[int, ExampleResult]] = field(default_factory=dict)  # task -> example index -> result

    def logs(self, prefix: str = "downstream") -> dict[str, float]:
        out = {f"{prefix}/centered": self.centered}
        for name, figures in self.tasks.items():
            for key in ("acc", "acc_norm", "acc_per_token", "bpb", "centered"):
                out[f"{prefix}/{name}/{key}"] = figures[key]
        return out


class DownstreamEvaluator:
    """Tasks prepared for one tokenizer and context length; `evaluate(model)` scores them.

    `tasks`: names (`tasks.resolve_tasks`); `limit`: examples a task (a seeded sample, None: all);
    `shots`: fixed seeded shots; `max_length`: the model's positions (`max_length_of(config)` by
    default); `pack`: pack sequences into rows (None: when `packs_documents(model, device)` says it
    pays, decided at the first `evaluate`); `batch_tokens`: tokens per forward; `progress_s`: seconds
    of preparation between two lines of rank 0 (None: silent).
    """

    def __init__(
        self,
        tokenizer,
        tasks: str | list[str] | None = None,
        limit: int | None = None,
        shots: int = 0,
        seed: int = 1234,
        max_length: int | None = None,
        pack: bool | None = None,
        batch_tokens: int = DEFAULT_BATCH_TOKENS,
        data_dir: str | Path | None = None,
        progress_s: float | None = PROGRESS_S,
    ):
        from .data import data_root

        self.tokenizer = tokenizer
        self.tasks = resolve_tasks(tasks)
        if limit is not None and limit < 1:
            raise ValueError(f"limit={limit}: evaluate at least one example a task, or pass limit=None for all.")
        if shots < 0:
            raise ValueError(f"shots={shots} must be >= 0.")
        self.limit, self.shots, self.seed = limit, shots, seed
        self.max_length, self.pack, self.batch_tokens = max_length, pack, batch_tokens
        self.root = data_root(data_dir)
        self.sets: list[TaskSet] = [build_examples(t, limit, shots, seed, self.root) for t in self.tasks]
        self.encoded: list[Encoded] = self._encode(progress_s if _rank() == 0 else None)
        self._batches: list[list[Row]] | None = None
        self._batch_tasks: list[Counter] = []  # per batch: requests of each task it scores
        self.truncated = 0
        self.skipped: set[tuple[str, int]] = set()
        self._notes: list[str] = []

    def _encode(self, progress_s: float | None) -> list[Encoded]:
        """Every task's requests encoded, `ENCODE_CHUNK` at a time; at most every `progress_s` seconds a line of
        the requests encoded so far, per task, and a closing line if one came before."""
        encoder, encoded = Encoder(self.tokenizer), []
        work = {s.task.name: requests_of(s.task.name, s.examples) for s in self.sets}
        done = dict.fromkeys(work, 0)
        total = sum(map(len, work.values()))
        start = last = time.perf_counter()
        printed = False

        def say(final: bool = False) -> None:
            tasks = " | ".join(f"{n} {done[n]:,}/{len(r):,}" for n, r in work.items() if r)
            elapsed = time.perf_counter() - start
            what = f"done in {elapsed:.1f} s" if final else f"{elapsed:.0f} s so far"
            print(f"[downstream] preparing: {len(encoded):,}/{total:,} requests encoded: {tasks}; {what}", flush=True)

        for name, requests in work.items():
            for at in range(0, len(requests), ENCODE_CHUNK):
                encoded += encoder.encode(requests[at : at + ENCODE_CHUNK])
                done[name] = min(at + ENCODE_CHUNK, len(requests))
                if progress_s is not None and time.perf_counter() - last >= progress_s:
                    say()
                    last, printed = time.perf_counter(), True
        if printed:
            say(final=True)
        return encoded

    @property
    def num_examples(self) -> int:
        return sum(len(s.examples) for s in self.sets)

    def batches(self, model, device: torch.device | None = None) -> list[list[Row]]:
        if self._batches is None:
            if self.max_length is None:
                self.max_length = max_length_of(getattr(model, "config", None), self.tokenizer)
            if self.pack is None:
                self.pack = packs_documents(model, device or _device_of(model))
            self.skipped = too_long(self.encoded, self.max_length)
            skip = {n for n, e in enumerate(self.encoded) if (e.request.task, e.request.example) in self.skipped}
            segments, self.truncated = segments_of(self.encoded, self.max_length, skip)
            rows = rows_of(segments, self.max_length, self.pack)
            self._batches = batches_of(rows, max(self.batch_tokens, self.max_length))
            self._batch_tasks = [self._tasks_of(batch) for batch in self._batches]
            self._notes = self._describe(rows)
        return self._batches

    def _tasks_of(self, batch: list[Row]) -> Counter:
        """How many requests of each task a batch scores."""
        return Counter(
            self.encoded[number].request.task
            for row in batch
            for segment in row.segments
            for number, _ in segment.scored
        )

    def _describe(self, rows: list[Row]) -> list[str]:
        notes = []
        for s in self.sets:
            count = sum(task == s.task.name for task, _ in self.skipped)
            if count:
                notes.append(
                    f"{s.task.name}: {count} of {len(s.examples)} examples skipped: a choice alone is longer than the "
                    f"model's {self.max_length} positions"
                )
        if self.truncated:
            notes.append(
                f"{self.truncated} of {len(self.encoded)} requests are longer than the model's {self.max_length} "
                "positions: their contexts are left-truncated, as lm-eval does"
            )
        probe = self.tokenizer("a")["input_ids"]
        if self.tokenizer.bos_token_id is None or probe[:1] != [self.tokenizer.bos_token_id]:
            notes.append("the tokenizer adds no BOS token: contexts are scored from their first token, as lm-eval does")
        tokens = sum(r.length for r in rows)
        notes.append(
            f"{self.num_examples} examples, {len(self.encoded)} requests, {tokens} tokens in {len(rows)} "
            f"{'packed ' if self.pack else ''}rows of up to {self.max_length}"
        )
        return notes

    def notes(self) -> list[str]:
        """What the first scoring found worth saying (truncation, no BOS, the size of the work); once."""
        notes, self._notes = self._notes, []
        return notes

    def evaluate(
        self,
        model,
        device: torch.device | str | None = None,
        sharded: bool = False,
        autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
        keep_examples: bool = False,
        progress_s: float | None = PROGRESS_S,
        tp_size: int | None = None,
    ) -> DownstreamResult:
        """Score every task on `model` (all ranks call it together when a process group is up); rank 0 prints its
        progress at most every `progress_s` seconds (None: never). `tp_size`: the ranks each split linear spans
        (None: read off the model); the ranks of a TP group score the same batches together (module docstring)."""
        start = time.perf_counter()
        device = torch.device(device) if device is not None else _device_of(model)
        batches = self.batches(model, device)
        distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        rank, world = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
        tp_size = tp_size or split_linear_ranks(model)
        check_tp_groups(model, tp_size, rank, world)
        group, groups = rank // tp_size, world // tp_size  # the TP group: its ranks run each forward together
        adds = rank % tp_size == 0  # the group's first rank adds its log-likelihoods; every rank counts
        mine = batches[group::groups]
        shares = self._batch_tasks[group::groups]
        share_of = f"{groups} TP groups" if tp_size > 1 else f"{groups} ranks"
        progress = (
            Progress(self.sets, shares, mine, progress_s, groups, share_of)
            if rank == 0 and progress_s is not None
            else None
        )
        forwards = -(-len(batches) // groups)  # every rank's number of forwards when the weights are sharded
        sums = torch.zeros(len(self.encoded), dtype=torch.float64, device=device)
        counts = torch.zeros(len(self.encoded), dtype=torch.float64, device=device)
        pad = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        was_training = model.training
        model.eval()
        try:
            with precision.high_precision(model), torch.no_grad(), autocast():
                for batch, tasks in zip(mine, shares):
                    numbers, values = score_batch(model, batch, device, pad, self.pack)
                    if adds:
                        sums.index_add_(0, numbers, values)
                    counts.index_add_(0, numbers, torch.ones_like(values))
                    if progress is not None:
                        progress.update(tasks, batch)
                for _ in range(forwards - len(mine) if sharded else 0):
                    model(input_ids=torch.full((1, 1), pad, device=device), use_cache=False)
        finally:
            model.train(was_training)
        if progress is not None:
            progress.finish()
        if distributed:
            dist.all_reduce(sums)
            dist.all_reduce(counts)
        expected = (
            torch.tensor(
                [float((e.request.task, e.request.example) not in self.skipped) for e in self.encoded], device=device
            ).double()
            * tp_size
        )
        if not torch.equal(counts, expected):
            raise RuntimeError(
                f"downstream evaluation: {int((counts != expected).sum())} requests not scored by exactly one "
                f"{'TP group' if tp_size > 1 else 'rank'}."
            )
        return self._result(sums.tolist(), time.perf_counter() - start, keep_examples)

    def _result(self, loglikelihoods: list[float], seconds: float, keep_examples: bool) -> DownstreamResult:
        per_task, examples, at = {}, {}, 0
        for s in self.sets:
            results: dict[int, ExampleResult] = {}
            for i, example in enumerate(s.examples):
                k = len(example.choices)
                if (s.task.name, i) not in self.skipped:
                    tokens = [len(e.continuation_ids) for e in self.encoded[at : at + k]]
                    results[i] = score_example(example, loglikelihoods[at : at + k], tokens)
                at += k
            if not results:
                raise ValueError(f"{s.task.name}: no example fits the model's {self.max_length} positions.")
            scored = [s.examples[i] for i in results]
            per_task[s.task.name] = task_figures(scored, list(results.values()), s.task.primary)
            if keep_examples:
                examples[s.task.name] = results
        return DownstreamResult(per_task, centered_mean(per_task), seconds, self.truncated, examples)


class Progress:
    """Requests scored of one rank's share, per task: a line at most every `every_s` seconds, and when done."""

    def __init__(
        self,
        sets: list[TaskSet],
        shares: list[Counter],
        batches: list[list[Row]],
        every_s: float,
        world: int,
        share_of: str = "",
    ):
        self.names = [s.task.name for s in sets]
        self.total = sum(shares, Counter())
        self.done: Counter = Counter()
        self.tokens, self.tokens_done = sum(map(_cost, batches)), 0
        self.every_s, self.world, self.share_of = every_s, world, share_of or f"{world} ranks"
        self.start = self.last = time.perf_counter()
        self.printed = False

    def update(self, tasks: Counter, batch: list[Row]) -> None:
        self.done.update(tasks)
        self.tokens_done += _cost(batch)
        if time.perf_counter() - self.last >= self.every_s:
            self.print()

    def finish(self) -> None:
        """The closing line, when a progress line came before it (a short evaluation stays one summary line)."""
        if self.printed:
            self.print(final=True)

    def print(self, final: bool = False) -> None:
        from tqdm import tqdm

        now = time.perf_counter()
        self.last, self.printed = now, True
        done, total, elapsed = sum(self.done.values()), sum(self.total.values()), now - self.start
        rate = done / elapsed if elapsed > 0 else 0.0
        tasks = " | ".join(f"{n} {self.done[n]:,}/{self.total[n]:,}" for n in self.names if self.total[n])
        left = elapsed * (self.tokens - self.tokens_done) / self.tokens_done if self.tokens_done else None
        when = f"done in {tqdm.format_interval(elapsed)}" if final else f"{tqdm.format_interval(left or 0)} left"
        share = f" (rank 0's share of {self.share_of})" if self.world > 1 else ""
        print(
            f"[downstream] {done:,}/{total:,} requests{share} ({100 * done / max(total, 1):.0f}%): {tasks}; "
            f"{rate:,.1f} requests/s, {when}",
            flush=True,
        )


def check_tp_groups(model, tp_size: int, rank: int, world: int) -> None:
    """The TP groups are consecutive ranks (the training loader's rule, data rank = rank // tp_size), as each of
    DeepSpeed's split layers says (`tp_index`, its rank in the group); otherwise scoring by group would be wrong."""
    if tp_size < 1 or world % tp_size:
        raise ValueError(f"tp_size={tp_size}: it must divide the {world} processes (the run's TP degree).")
    indices = {m.tp_index for m in model.modules() if isinstance(getattr(m, "tp_index", None), int)}
    if tp_size > 1 and indices and indices != {rank % tp_size}:
        raise RuntimeError(
            f"downstream evaluation: rank {rank} holds TP shard(s) {sorted(indices)}, not {rank % tp_size}: the TP "
            f"groups are not consecutive ranks, so the batches cannot be shared out by group (rank // {tp_size})."
        )


def _cost(batch: list[Row]) -> int:
    """The tokens a batch's forward runs: its rows padded to the longest."""
    return len(batch) * max(r.length for r in batch)


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _device_of(model) -> torch.device:
    return next(iter(model.parameters())).device


def score_batch(model, rows: list[Row], device, pad: int, pack: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward over `rows`; returns (request numbers, their continuation log-likelihoods)."""
    width = max(r.length for r in rows)
    ids = torch.full((len(rows), width), pad, dtype=torch.long)
    positions = torch.zeros((len(rows), width), dtype=torch.long)
    where_b, where_t, targets, numbers = [], [], [], []
    for b, row in enumerate(rows):
        offset = 0
        for segment in row.segments:
            n = len(segment.input_ids)
            ids[b, offset : offset + n] = torch.tensor(segment.input_ids)
            positions[b, offset : offset + n] = torch.arange(n)
            for number, continuation in segment.scored:
                k = len(continuation)
                where_b += [b] * k
                where_t += range(offset + n - k, offset + n)
                targets += continuation
                numbers += [number] * k
            offset += n
        positions[b, offset:] = torch.arange(width - offset)  # the padding: a document of its own
    inputs = {"input_ids": ids.to(device), "use_cache": False}
    if pack:
        inputs["position_ids"] = positions.to(device)
    logits = model(**inputs).logits
    picked = logits[torch.tensor(where_b, device=device), torch.tensor(where_t, device=device)]
    logprobs = torch.log_softmax(picked.to(torch.promote_types(picked.dtype, torch.float32)), dim=-1)
    values = logprobs.gather(1, torch.tensor(targets, device=device).unsqueeze(1)).squeeze(1).double()
    token_numbers = torch.tensor(numbers, device=device)
    unique, inverse = torch.unique(token_numbers, return_inverse=True)
    per_request = torch.zeros(len(unique), dtype=torch.float64, device=device).index_add_(0, inverse, values)
    return unique, per_request
