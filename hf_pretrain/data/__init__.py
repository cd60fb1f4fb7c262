"""Data blocks: corpus loading, tokenizer training, tokenize-and-pack."""

from .collator import PackedDocumentCollator
from .corpus import embedded_documents, load_text_dataset, write_embedded_corpus
from .packing import Pack, pack_dataset
from .tokenizer import bytes_per_token, load_or_train_tokenizer, train_bpe_tokenizer

__all__ = [
    "Pack",
    "PackedDocumentCollator",
    "bytes_per_token",
    "embedded_documents",
    "load_or_train_tokenizer",
    "load_text_dataset",
    "pack_dataset",
    "train_bpe_tokenizer",
    "write_embedded_corpus",
]
