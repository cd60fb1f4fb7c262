"""Next-token accuracy of a causal language model from reduced statistics (hf_pretrain's local `evaluate` metric).

Load it without the Hub: `evaluate.load(hf_pretrain.evaluation.metric_path("next_token_accuracy"))`.
This file is copied by `evaluate` into its modules cache and imported from there: it imports
only libraries (no relative imports).
"""

import datasets
import evaluate
import numpy as np

_DESCRIPTION = """\
Next-token (top-1) accuracy of a causal language model: the fraction of predicted tokens whose
argmax over the vocabulary equals the actual next token. Each input row is one already-reduced
piece of the evaluation set (a sequence or a batch): how many of its predicted tokens were right
and how many were predicted. Rows hold two numbers whatever the vocabulary or sequence length, so
`add_batch` per evaluation batch costs almost nothing. `hf_pretrain.evaluation.preprocess_logits_for_metrics`
produces these rows inside `transformers.Trainer` (shifted next-token targets, label -100 ignored).
The result is token-weighted: every predicted token counts once, whichever row it is in.
"""

_KWARGS_DESCRIPTION = """
Args:
    correct (`list` of `int`): per row, how many predicted tokens had the right argmax.
    token_count (`list` of `int`): per row, how many tokens were predicted (>= correct).
Returns:
    next_token_accuracy (`float`): sum(correct) / sum(token_count); NaN when no token was counted.
    token_count (`int`): sum(token_count).
Examples:
    >>> import evaluate
    >>> from hf_pretrain.evaluation import metric_path
    >>> accuracy = evaluate.load(metric_path("next_token_accuracy"))
    >>> accuracy.add_batch(correct=[3, 0], token_count=[4, 4])
    >>> accuracy.compute()["next_token_accuracy"]
    0.375
"""

_CITATION = """\
@misc{hf_pretrain_next_token_accuracy,
    title={Next-token accuracy: top-1 agreement of a causal LM's predictions with the next token},
    note={hf_pretrain local evaluate metric}
}
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class NextTokenAccuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            module_type="metric",
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"correct": datasets.Value("int64"), "token_count": datasets.Value("int64")}),
            format="numpy",
        )

    def _compute(self, correct, token_count):
        correct = np.asarray(correct, dtype=np.int64)
        token_count = np.asarray(token_count, dtype=np.int64)
        if (correct < 0).any() or (correct > token_count).any():
            raise ValueError("Every row needs 0 <= correct <= token_count.")
        total = int(token_count.sum())
        if total == 0:
            return {"next_token_accuracy": float("nan"), "token_count": 0}
        return {"next_token_accuracy": int(correct.sum()) / total, "token_count": total}
