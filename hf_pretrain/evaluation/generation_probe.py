"""`GenerationProbeCallback`: greedy completions of fixed prompts every N steps, with exact-match scoring.

Loss curves say little about what a model from scratch can do; a few fixed prompts completed at regular steps
show it (`If 5x + 3 = 13, then x is` -> ` 2`). Every `every_n_steps` optimizer steps (and at the last step with
`at_end=True`), at `on_step_end`, it runs greedy `model.generate` on each prompt alone, in eval mode, without
gradients, under `high_precision`, prints one line per prompt on rank 0, scores `(prompt, expected_answer)`
pairs with `exact_match` (the completion's first line, case and surrounding punctuation ignored, starts with the
expected words), and asks the Trainer to log at that step on every rank (the decision is the step number, so all
ranks take the same collectives). With DDP only rank 0 generates, on the unwrapped model (no collective, no
deadlock); under FSDP or ZeRO-3 every rank generates in lockstep (`synced_gpus=True`), and so under DeepSpeed
AutoTP (`split_linear_ranks`): a rank holds part of every split linear, whose row-wise half all-reduces over the TP group in
each forward (rank 0 generating alone waited there for ranks gone on to the next step's collectives: a hang). Plain `Trainer` does not
call `metrics_for_log`: there the probe only prints.

Logs (at the probe's step, rank 0):
- `probe_0` ... `probe_{n-1}` (text): the completion of each prompt (left out with `log_completions=False`);
- `probe_exact_match`: the fraction of prompts with an expected answer whose completion matches.
`history` keeps every probe's results in memory. Examples of the matching rule: docs/evaluation.md.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

from .. import precision
from ..callback import PretrainCallback

ANSWER_SEPARATOR = "=>"
_PUNCTUATION = ".,;:!?"
_QUOTES = "\"'`()[]{}<>"


def parse_prompt(text: str) -> str | tuple[str, str]:
    """A command-line probe: `"prompt=>answer"` -> `(prompt, answer)`; text without `=>` is a plain prompt.

    The last `=>` separates, so a prompt may contain `=>` when it also gives an answer. The prompt
    keeps its whitespace (a trailing space changes the tokens); the answer is stripped.
    """
    prompt, sep, answer = text.rpartition(ANSWER_SEPARATOR)
    if not sep:
        return text
    return (prompt, answer.strip())


def _words(text: str) -> list[str]:
    """Lower-cased whitespace words, punctuation and quotes stripped from their ends; words of punctuation only dropped."""
    words = (w.strip(_PUNCTUATION).strip(_QUOTES).strip(_PUNCTUATION) for w in text.lower().split())
    return [w for w in words if w]


def _answer_words(expected: str) -> list[str]:
    words = _words(expected)
    if not words:
        raise ValueError(f"Expected answer {expected!r} is empty after normalisation.")
    return words


def normalize_answer(completion: str) -> str:
    """The part of a completion that is scored: its first line (after leading whitespace), lower-cased, stripped."""
    lines = completion.strip().splitlines()
    return lines[0].strip().lower() if lines else ""


def exact_match(completion: str, expected: str) -> bool:
    """Whether a completion gives `expected` first: its first line, lower-cased, split on whitespace, punctuation
    `.,;:!?` and quotes / brackets stripped from both ends of each word (empty words dropped), starts with the
    expected answer's words treated alike. Expected `2` matches ` 2.`, `(2)`, `2 and so on`, not `20` or `x = 2`."""
    want = _answer_words(expected)
    got = _words(normalize_answer(completion))[: len(want)]
    return got == want


@dataclass
class ProbeResult:
    step: int
    prompt: str
    completion: str
    expected: str | None = None
    match: bool | None = None


def is_sharded(model, args) -> bool:
    """Whether the parameters are sharded across ranks (FSDP 1/2, DeepSpeed ZeRO-3): every rank must run forward."""
    try:
        from transformers.integrations import is_deepspeed_zero3_enabled

        if is_deepspeed_zero3_enabled():
            return True
    except ImportError:  # pragma: no cover
        pass
    if getattr(args, "fsdp", None) or getattr(model, "_is_fsdp_managed_module", False):
        return True
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel

        if isinstance(model, FullyShardedDataParallel):
            return True
        from torch.distributed.fsdp import FSDPModule

        return isinstance(model, FSDPModule)
    except ImportError:  # pragma: no cover
        return False


def split_linear_ranks(model) -> int:
    """How many ranks each split linear of `model` spans: DeepSpeed AutoTP's layers carry `tp_world_size`,
    transformers' `tp_plan` models `_tp_size`; 1 for a whole model. Read off the model, not the arguments: an
    accelerate-config launch leaves `args.hf_deepspeed_config` without it (transformers' `Trainer.get_tp_size()` then
    says 1; `PretrainTrainer`'s reads the DeepSpeed config), and a callback may serve either trainer."""
    sizes = [getattr(model, "_tp_size", None) or 1]
    sizes += [m.tp_world_size for m in model.modules() if isinstance(getattr(m, "tp_world_size", None), int)]
    return max(sizes)


class GenerationProbeCallback(PretrainCallback):
    """Greedy completions of `prompts` every `every_n_steps` steps (see the module docstring).

    `prompts`: strings, or `(prompt, expected_answer)` pairs (expected None: not scored).
    `every_n_steps`: 0 probes only at the end (`at_end`). `tokenizer`: defaults to the Trainer's
    `processing_class`. `add_special_tokens`: passed to the tokenizer (False: the prompt's tokens
    only, as `examples/pretrain.py` samples).
    """

    arguments = {"probe_prompts": None, "probe_every": 0, "probe_max_new_tokens": 16, "probe_at_end": True}

    @classmethod
    def from_arguments(cls, trainer, built=()) -> GenerationProbeCallback | None:
        settings = cls.settings(trainer.args)
        if not settings["probe_prompts"] or (settings["probe_every"] <= 0 and not settings["probe_at_end"]):
            return None
        return cls(
            [parse_prompt(p) for p in settings["probe_prompts"]],
            settings["probe_every"],
            settings["probe_max_new_tokens"],
            tokenizer=trainer.processing_class,
            at_end=settings["probe_at_end"],
        )

    def __init__(
        self,
        prompts: Sequence[str | tuple[str, str | None]],
        every_n_steps: int = arguments["probe_every"],
        max_new_tokens: int = arguments["probe_max_new_tokens"],
        tokenizer=None,
        at_end: bool = arguments["probe_at_end"],
        log_completions: bool = True,
        add_special_tokens: bool = False,
    ):
        self.prompts: list[tuple[str, str | None]] = []
        for item in prompts:
            prompt, expected = (item, None) if isinstance(item, str) else tuple(item)
            if not isinstance(prompt, str) or not prompt:
                raise ValueError(f"A probe prompt must be a non-empty string; got {item!r}.")
            if expected is not None:
                _answer_words(expected)  # rejects an answer that normalises to nothing now, not at step N
            self.prompts.append((prompt, expected))
        if not self.prompts:
            raise ValueError("GenerationProbeCallback needs at least one prompt.")
        if every_n_steps < 0 or (every_n_steps == 0 and not at_end):
            raise ValueError("every_n_steps must be >= 1 (or 0 with at_end=True: probe only at the last step).")
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1.")
        self.every_n_steps = every_n_steps
        self.max_new_tokens = max_new_tokens
        self.tokenizer = tokenizer
        self.at_end = at_end
        self.log_completions = log_completions
        self.add_special_tokens = add_special_tokens
        self.history: list[ProbeResult] = []
        self._pending: dict = {}
        self._last_step: int | None = None

    def due(self, state) -> bool:
        step = state.global_step
        if step == self._last_step or step <= 0:
            return False
        periodic = self.every_n_steps > 0 and step % self.every_n_steps == 0
        last = self.at_end and state.max_steps > 0 and step >= state.max_steps
        return periodic or last

    def on_train_begin(self, args, state, control, **kwargs):
        self._last_step = None  # a new train() (or a resumed one) may probe the same step numbers again
        self._pending = {}

    def on_step_end(self, args, state, control, model=None, processing_class=None, **kwargs):
        if not self.due(state):
            return
        self._last_step = state.global_step
        control.should_log = True  # every rank: the probe's results get a log at this very step
        main, lockstep = state.is_world_process_zero, is_sharded(model, args) or split_linear_ranks(model) > 1
        if not main and not lockstep:
            return  # DDP / one process: rank 0 generates alone, on the unwrapped model
        tokenizer = self.tokenizer or processing_class
        if tokenizer is None:
            raise ValueError(
                "GenerationProbeCallback needs a tokenizer: pass tokenizer= or processing_class to the Trainer."
            )
        results = self.probe(model, tokenizer, state.global_step, synced_gpus=lockstep and args.world_size > 1)
        if main:
            self._report(results)

    def probe(self, model, tokenizer, step: int = 0, synced_gpus: bool = False) -> list[ProbeResult]:
        """Greedy completions of every prompt now, scored; the model's train/eval mode is restored."""
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        was_training = model.training
        model.eval()
        results = []
        try:
            with precision.high_precision(model), torch.no_grad():  # plain linears, as evaluate() runs
                for prompt, expected in self.prompts:
                    ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=self.add_special_tokens)
                    ids = {k: v.to(model.device) for k, v in ids.items() if k in ("input_ids", "attention_mask")}
                    generated = model.generate(
                        **ids,
                        max_new_tokens=self.max_new_tokens,
                        do_sample=False,
                        num_beams=1,
                        pad_token_id=pad,
                        synced_gpus=synced_gpus,
                    )
                    completion = tokenizer.decode(generated[0, ids["input_ids"].shape[1] :], skip_special_tokens=True)
                    match = exact_match(completion, expected) if expected is not None else None
                    results.append(ProbeResult(step, prompt, completion, expected, match))
        finally:
            model.train(was_training)
        return results

    def _report(self, results: list[ProbeResult]) -> None:
        self.history.extend(results)
        logs: dict = {}
        scored = [r.match for r in results if r.match is not None]
        for i, r in enumerate(results):
            verdict = ""
            if r.match is not None:
                verdict = f"  [exact match: {'yes' if r.match else 'no'}, expected {r.expected!r}]"
            print(f"[probe] step {r.step}: {r.prompt!r} -> {r.completion!r}{verdict}", flush=True)
            if self.log_completions:
                logs[f"probe_{i}"] = r.completion
        if scored:
            logs["probe_exact_match"] = sum(scored) / len(scored)
        self._pending = logs

    def metrics_for_log(self, state) -> dict:
        pending, self._pending = self._pending, {}
        return pending

    def history_records(self) -> list[dict]:
        """`history` as plain dicts (JSON-ready)."""
        return [asdict(r) for r in self.history]
