"""`PackedDocumentCollator`: batches of packed blocks that keep documents apart.

A packed block holds several documents separated by EOS (see `packing.py`). The collator returns
- `input_ids`: the blocks, stacked;
- `position_ids`: restarting at 0 after every EOS, so RoPE sees each document from position 0
  and the attention kernels see the boundaries (transformers turns restarting position ids into
  varlen `cu_seqlens` for FlashAttention, a document mask for flex and a block-diagonal causal
  mask for SDPA/eager);
- `labels`: the inputs, except the first token of every document after the first, which gets
  -100: predicting it from the previous document's EOS would be learning across the boundary.
No `attention_mask` is returned: a 2D mask would hide the packing from transformers' mask
builders. Rows of different lengths (best-fit packing) are right-padded with `pad_token_id` to
the longest row of the batch rounded up to `pad_to_multiple_of` (8); the padding follows the last
EOS, so it is a "document" of its own that no real token attends to, and its labels are -100. With `separate_documents=False` the collator returns
plain causal-LM batches (position ids 0..T-1, every label kept), the classic GPT recipe.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE_INDEX = -100


def document_position_ids(input_ids: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """Positions that restart at 0 on the token after each EOS (vectorised over the batch)."""
    batch, seq = input_ids.shape
    arange = torch.arange(seq, device=input_ids.device).expand(batch, seq)
    starts = torch.zeros_like(input_ids, dtype=torch.bool)
    starts[:, 1:] = input_ids[:, :-1] == eos_token_id
    starts[:, 0] = True
    last_start = torch.where(starts, arange, torch.zeros_like(arange)).cummax(dim=1).values
    return arange - last_start


@dataclass
class PackedDocumentCollator:
    eos_token_id: int
    separate_documents: bool = True
    packed_documents: bool = True  # read by PretrainTrainer's preflight: batches carry document boundaries
    pad_token_id: int | None = None  # needed for rows of different lengths (best-fit packing)
    pad_to_multiple_of: int = 8

    def __post_init__(self):
        if self.eos_token_id is None:
            raise ValueError("PackedDocumentCollator.eos_token_id is None; pass tokenizer.eos_token_id.")
        self.packed_documents = self.separate_documents
        # Full blocks have no padding: PretrainTrainer then counts every token as a real one.
        self.has_padding = self.pad_token_id is not None

    def _stack(self, rows: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, padding mask) of the rows, padded when their lengths differ."""
        longest = max(len(r) for r in rows)
        if all(len(r) == longest for r in rows):
            ids = torch.tensor(rows, dtype=torch.long)
            return ids, torch.zeros_like(ids, dtype=torch.bool)
        if self.pad_token_id is None:
            raise ValueError("Rows of different lengths (best-fit packing): pass pad_token_id=tokenizer.pad_token_id.")
        width = -(-longest // self.pad_to_multiple_of) * self.pad_to_multiple_of
        ids = torch.full((len(rows), width), self.pad_token_id, dtype=torch.long)
        padding = torch.ones((len(rows), width), dtype=torch.bool)
        for i, row in enumerate(rows):
            ids[i, : len(row)], padding[i, : len(row)] = torch.tensor(row, dtype=torch.long), False
        return ids, padding

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        input_ids, padding = self._stack([f["input_ids"] for f in features])
        labels = input_ids.masked_fill(padding, IGNORE_INDEX)
        if not self.separate_documents:
            return {"input_ids": input_ids, "labels": labels}
        position_ids = document_position_ids(input_ids, self.eos_token_id)
        labels[(position_ids == 0) & (torch.arange(input_ids.shape[1]) > 0)] = IGNORE_INDEX
        return {"input_ids": input_ids, "position_ids": position_ids, "labels": labels}
