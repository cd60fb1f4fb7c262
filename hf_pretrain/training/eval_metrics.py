"""Perplexity and next-token accuracy in `evaluate()` for causal LMs, and nothing new for other models.

With no `compute_metrics` of the user's, `PretrainTrainer.evaluate()` of a causal LM adds
`eval_perplexity` and `eval_next_token_accuracy` from per-sequence sums
(`hf_pretrain.evaluation.reduce`): every batch is reduced as soon as the model produced it and
added to the metrics (`batch_eval_metrics`), so neither logits nor labels of the evaluation set are
kept. The arguments are the user's and are not written to: the evaluation runs on a copy of them.
Any other model (a regression head, a classifier, a model whose outputs are not
`[batch, seq, vocab]` logits) evaluates exactly as with `Trainer`: `eval_loss` only.
"""

from __future__ import annotations

import contextlib
import copy

from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from ..evaluation import CausalLMMetrics, causal_lm_statistics_or_empty


def is_causal_lm(model) -> bool:
    """Whether `model` (a PeftModel's base model included) is a causal LM whose logits are [batch, seq, vocab]."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    name = type(base).__name__
    return name.endswith("ForCausalLM") or name in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values()


@contextlib.contextmanager
def lm_eval_metrics(trainer):
    if not (
        getattr(trainer.args, "eval_lm_metrics", True)
        and trainer.compute_metrics is None
        and trainer.preprocess_logits_for_metrics is None
        and is_causal_lm(trainer.model)
    ):
        yield
        return
    args = trainer.args
    trainer.args = copy.copy(args)
    trainer.args.batch_eval_metrics = True  # one add_batch per batch: nothing of the eval set accumulates
    trainer.compute_metrics = CausalLMMetrics(skip_empty=True)
    trainer.preprocess_logits_for_metrics = causal_lm_statistics_or_empty
    try:
        yield
    finally:
        trainer.compute_metrics = trainer.preprocess_logits_for_metrics = None
        trainer.args = args
