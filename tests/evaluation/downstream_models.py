"""Models and tokenizers of the downstream tests: a BPE trained on benchmark text, a tiny random model, an oracle."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from tokenizers import processors

from hf_pretrain import PretrainForCausalLM
from hf_pretrain.data.tokenizer import train_bpe_tokenizer
from hf_pretrain.evaluation.downstream import data_root
from hf_pretrain.evaluation.downstream.data import load_rows
from tests.conftest import small_config

VOCAB = 400


def bpe_tokenizer(bos: bool = False):
    """hf_pretrain's byte-level BPE (no BOS added, as the example's), trained on 300 HellaSwag rows; with `bos`, a
    post-processor that starts every encoding with <|bos|> (as Llama's tokenizers do)."""
    rows = load_rows(str(data_root() / "hellaswag/none/validation"))[:300]
    tokenizer = train_bpe_tokenizer([r["ctx"] + " " + " ".join(r["endings"]) for r in rows], VOCAB)
    if bos:
        token = tokenizer.bos_token
        tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
            single=f"{token} $A", special_tokens=[(token, tokenizer.bos_token_id)]
        )
    return tokenizer


def tiny_model(max_positions: int = 512, seed: int = 0, dtype=torch.float32) -> PretrainForCausalLM:
    torch.manual_seed(seed)
    config = small_config(vocab_size=VOCAB, num_hidden_layers=2, max_position_embeddings=max_positions)
    return PretrainForCausalLM(config).to(dtype).eval()


class OracleLM(torch.nn.Module):
    """Puts all probability on the gold continuation: after a prefix of (context + gold continuation) it predicts
    the gold's next token (log-probability 0); anything else gets a flat distribution."""

    def __init__(self, gold_sequences: list[list[int]], context_lengths: list[int], vocab: int, max_positions: int):
        super().__init__()
        self.config = SimpleNamespace(model_type="oracle", max_position_embeddings=max_positions)
        self.anchor = torch.nn.Parameter(torch.zeros(1))  # a device for the evaluator
        self.vocab = vocab
        self.next_token = {
            tuple(seq[:k]): seq[k]
            for seq, start in zip(gold_sequences, context_lengths)
            for k in range(start, len(seq))
        }

    def forward(self, input_ids, **kwargs):
        logits = torch.zeros(*input_ids.shape, self.vocab)
        for b, row in enumerate(input_ids.tolist()):
            for t in range(len(row)):
                token = self.next_token.get(tuple(row[: t + 1]))
                if token is not None:
                    logits[b, t] = -1e4
                    logits[b, t, token] = 0.0
        return SimpleNamespace(logits=logits)


def training_rows(tokenizer, rows: int = 32, length: int = 64):
    """A causal-LM dataset of `rows` blocks of `length` tokens of HellaSwag text (labels = inputs)."""
    from datasets import Dataset

    texts = [r["ctx"] for r in load_rows(str(data_root() / "hellaswag/none/validation"))[300:1300]]
    ids = [t for text in texts for t in tokenizer(text)["input_ids"]][: rows * length]
    blocks = [ids[i : i + length] for i in range(0, len(ids), length)]
    return Dataset.from_dict({"input_ids": blocks, "labels": blocks})
