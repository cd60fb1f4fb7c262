"""`PerplexityFilter`: drop documents a small causal LM finds too surprising (CCNet-style).

Any checkpoint `AutoModelForCausalLM.from_pretrained` loads works, with the tokenizer saved
beside it (or `tokenizer_path`): a model this package trained on clean text, a GPT-2, a small
Llama. Each document is scored by its perplexity `exp(mean token negative log-likelihood)` over
its first `max_length` tokens, in batches (right-padded, padding masked out of the mean), in
fp32 on the CPU or in the model's dtype on a GPU; documents above `threshold` (default 1500, a
loose bound that keeps fluent text and drops boiler-plate, tables and garbage for a mid-sized
model; tune it on your data with `keep_scores=True`) are dropped with reason `perplexity`.
Documents with fewer than 2 tokens cannot be scored and are kept (counted as `unscored`).

The model is loaded once per worker process on first use. The map runs with `num_proc=None`
by default: torch already uses every core for one batch, so worker processes only add copies
of the model.

Logs (`stats.extra`, non-streaming runs): `scored`, `unscored`, `mean_perplexity_kept`, `threshold`,
`model`. With `keep_scores=True` the kept rows carry a `perplexity` column.
"""

from __future__ import annotations

import math

import torch

from .blocks import DROP, Block, from_pretrained

PPL = "perplexity"


class PerplexityFilter(Block):
    name = "perplexity"
    batch_size = 64

    def __init__(
        self,
        model_path: str,
        threshold: float = 1500.0,
        text_column: str = "text",
        tokenizer_path: str | None = None,
        max_length: int = 512,
        batch_size: int = 8,
        keep_scores: bool = False,
        device: str | None = None,
    ):
        super().__init__()
        if threshold <= 1:
            raise ValueError(f"threshold={threshold}: a perplexity is at least 1; use e.g. 1500.")
        self.model_path, self.tokenizer_path = model_path, tokenizer_path or model_path
        self.threshold, self.text_column, self.max_length = threshold, text_column, max_length
        self.model_batch, self.keep_scores = batch_size, keep_scores
        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self._model = self._tokenizer = None
        self._check_paths()

    def _check_paths(self) -> None:
        """Both folders load (the model's config, the tokenizer) before any data is read."""
        from transformers import AutoConfig, AutoTokenizer

        from .. import modeling  # noqa: F401  (registers the hf_pretrain model type with the Auto classes)

        from_pretrained(AutoConfig, self.model_path, "model_path")
        from_pretrained(AutoTokenizer, self.tokenizer_path, "tokenizer_path")

    def _load(self):
        if self._model is None:
            from transformers import AutoModelForCausalLM, AutoTokenizer

            from .. import modeling  # noqa: F401  (registers the hf_pretrain model type with the Auto classes)

            self._tokenizer = from_pretrained(AutoTokenizer, self.tokenizer_path, "tokenizer_path")
            dtype = torch.float32 if self.device == "cpu" else "auto"
            model = from_pretrained(AutoModelForCausalLM, self.model_path, "model_path", dtype=dtype)
            self._model = model.to(self.device).eval()
        return self._model, self._tokenizer

    @torch.no_grad()
    def perplexities(self, texts: list[str]) -> list[float]:
        """Perplexity of each text (NaN when it has fewer than 2 tokens)."""
        model, tokenizer = self._load()
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id or 0
        out = []
        for i in range(0, len(texts), self.model_batch):
            ids = tokenizer(
                texts[i : i + self.model_batch], add_special_tokens=False, truncation=True, max_length=self.max_length
            )["input_ids"]
            width = max(len(x) for x in ids)
            batch = torch.full((len(ids), width), pad, dtype=torch.long)
            mask = torch.zeros((len(ids), width), dtype=torch.long)
            for row, x in enumerate(ids):
                batch[row, : len(x)], mask[row, : len(x)] = torch.tensor(x, dtype=torch.long), 1
            batch, mask = batch.to(self.device), mask.to(self.device)
            logits = model(input_ids=batch, attention_mask=mask).logits[:, :-1].float()
            nll = torch.nn.functional.cross_entropy(logits.transpose(1, 2), batch[:, 1:], reduction="none")
            counted = mask[:, 1:].float()
            mean = (nll * counted).sum(1) / counted.sum(1).clamp(min=1)
            out += [math.exp(m) if n > 0 else math.nan for m, n in zip(mean.tolist(), counted.sum(1).tolist())]
        return out

    def process(self, batch: dict[str, list]) -> dict[str, list]:
        scores = self.perplexities(batch[self.text_column])
        batch = dict(batch)
        batch[DROP] = [PPL if s > self.threshold else "" for s in scores]  # NaN > t is False: kept
        batch[PPL] = scores
        return batch

    def finish(self, kept):
        values = list(kept[PPL]) if len(kept) else []
        finite = [s for s in values if not math.isnan(s)]
        self.stats.extra.update(
            scored=self.stats.documents_in - (len(values) - len(finite)),
            unscored=len(values) - len(finite),
            mean_perplexity_kept=round(sum(finite) / len(finite), 2) if finite else None,
            threshold=self.threshold,
            model=self.model_path,
        )
        return self.finish_stream(kept)

    def finish_stream(self, kept):
        return kept if self.keep_scores else kept.remove_columns([PPL])
