"""Perplexity of a causal language model from reduced statistics (hf_pretrain's local `evaluate` metric).

Load it without the Hub: `evaluate.load(hf_pretrain.evaluation.metric_path("perplexity"))`.
This file is copied by `evaluate` into its modules cache and imported from there: it imports
only libraries (no relative imports).
"""

import math

import datasets
import evaluate
import numpy as np

_DESCRIPTION = """\
Perplexity of a causal language model on a token set: exp(total negative log-likelihood / total
predicted tokens), in nats. Unlike the Hub's `perplexity` measurement it does not take texts or
logits: each input row is one already-reduced piece of the evaluation set (a sequence or a batch),
given as the sum of its tokens' negative log-likelihoods and the number of tokens in that sum.
Rows hold two numbers whatever the vocabulary or sequence length, so `add_batch` per evaluation
batch costs almost nothing. `hf_pretrain.evaluation.preprocess_logits_for_metrics` produces
these rows inside `transformers.Trainer` (shifted next-token targets, label -100 ignored).
The result is token-weighted: every predicted token counts once, whichever row it is in.
"""

_KWARGS_DESCRIPTION = """
Args:
    nll_sum (`list` of `float`): per row, the sum of the negative log-likelihoods (natural log) of
        the row's predicted tokens.
    token_count (`list` of `int`): per row, how many tokens `nll_sum` sums over.
Returns:
    perplexity (`float`): exp(sum(nll_sum) / sum(token_count)); NaN when no token was counted,
        inf when the mean exceeds what a float can exponentiate.
    nll_per_token (`float`): sum(nll_sum) / sum(token_count), nats per token.
    token_count (`int`): sum(token_count).
Examples:
    >>> import evaluate
    >>> from hf_pretrain.evaluation import metric_path
    >>> perplexity = evaluate.load(metric_path("perplexity"))
    >>> perplexity.add_batch(nll_sum=[6.0, 2.0], token_count=[3, 1])
    >>> round(perplexity.compute()["perplexity"], 4)  # exp(8 / 4)
    7.3891
"""

_CITATION = """\
@article{jelinek1977perplexity,
    title={Perplexity---a measure of the difficulty of speech recognition tasks},
    author={Jelinek, Fred and Mercer, Robert L and Bahl, Lalit R and Baker, James K},
    journal={The Journal of the Acoustical Society of America},
    volume={62},
    number={S1},
    pages={S63--S63},
    year={1977}
}
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class Perplexity(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            module_type="metric",
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"nll_sum": datasets.Value("float64"), "token_count": datasets.Value("int64")}),
            format="numpy",
            reference_urls=["https://huggingface.co/docs/transformers/perplexity"],
        )

    def _compute(self, nll_sum, token_count):
        nll_sum = np.asarray(nll_sum, dtype=np.float64)
        token_count = np.asarray(token_count, dtype=np.int64)
        if (token_count < 0).any():
            raise ValueError("token_count must be >= 0 in every row.")
        if np.isnan(nll_sum).any() or (nll_sum < 0).any():
            raise ValueError("nll_sum must be a non-negative number in every row (a sum of -log p).")
        total = int(token_count.sum())
        if total == 0:
            return {"perplexity": float("nan"), "nll_per_token": float("nan"), "token_count": 0}
        nll = float(nll_sum.sum()) / total
        try:
            perplexity = math.exp(nll)
        except OverflowError:
            perplexity = float("inf")
        return {"perplexity": perplexity, "nll_per_token": nll, "token_count": total}
