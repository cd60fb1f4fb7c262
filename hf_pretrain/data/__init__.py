"""Data blocks: corpus loading, tokenizer training, tokenize-and-pack (imported on first use: `hf-pretrain data`
parses its arguments before `datasets` and torch are loaded)."""

from ..lazy import lazy_getattr

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


__getattr__ = lazy_getattr(__name__, _HOMES)
