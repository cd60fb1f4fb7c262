"""Data blocks: corpus loading, tokenizer training, tokenize-and-pack (imported on first use: `hf-pretrain data`
parses its arguments before `datasets` and torch are loaded)."""

import importlib

_HOMES = {
    "Pack": ".packing",
    "PackedDocumentCollator": ".collator",
    "bytes_per_token": ".tokenizer",
    "embedded_documents": ".corpus",
    "load_or_train_tokenizer": ".tokenizer",
    "load_text_dataset": ".corpus",
    "pack_dataset": ".packing",
    "train_bpe_tokenizer": ".tokenizer",
    "write_embedded_corpus": ".corpus",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'hf_pretrain.data' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name], __name__), name)
    globals()[name] = value
    return value
