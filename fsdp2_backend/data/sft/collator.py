"""SFT micro-batches: padded rows of encoded (or packed) examples → the tensors the trainer reads.

Keys (the pretraining batch's, so the loop is the same): `tokens` [b, s], `labels` [b, s] already shifted
(labels[t] is the token after input t, within the same example: the last token of each packed example predicts
nothing), `loss_mask` [b, s] (1 where a label is trained) and `position_ids` [b, s].
- `neat_packing`: position ids restart at 0 at each packed example (and at the padding), the one packed-sequence
  convention of `kernels/varlen.py`, which the packed attention reads as document boundaries: no example attends
  to another, and no S×S mask is built. Plain `packing` and unpacked rows: position ids run 0..s-1, so packed
  examples attend to the earlier ones of their row (LLaMA-Factory's plain packing).
- `ignore_pad_token_for_loss` False: padding is labelled with the pad id and trained (LLaMA-Factory's meaning).
- Rows are padded to the longest of the micro-batch, rounded up to `pad_multiple` (context parallel needs the
  sequence to divide into its shards).
"""
from __future__ import annotations

from typing import Dict, List, Sequence

import torch

from fsdp2_backend.data.sft.supervised import IGNORE_INDEX


class SFTCollator:
    def __init__(self, pad_id: int, neat_packing: bool, ignore_pad_token_for_loss: bool = True,
                 pad_multiple: int = 1):
        self.pad_id, self.neat_packing = pad_id, neat_packing
        self.pad_label = IGNORE_INDEX if ignore_pad_token_for_loss else pad_id
        self.pad_multiple = max(pad_multiple, 1)

    def __call__(self, rows: Sequence[Dict[str, List[int]]]) -> Dict[str, torch.Tensor]:
        longest = max(len(row["input_ids"]) for row in rows)
        length = -(-longest // self.pad_multiple) * self.pad_multiple
        tokens = torch.full((len(rows), length), self.pad_id, dtype=torch.long)
        labels = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.long)
        positions = torch.arange(length).repeat(len(rows), 1)
        for r, row in enumerate(rows):
            ids, row_labels = row["input_ids"], row["labels"]
            n = len(ids)
            tokens[r, :n] = torch.tensor(ids)
            start = 0
            for doc in row.get("doc_lens") or [n]:
                doc_labels = torch.tensor(row_labels[start + 1:start + doc], dtype=torch.long)
                labels[r, start:start + doc - 1] = doc_labels
                if self.neat_packing:
                    positions[r, start:start + doc] = torch.arange(doc)
                start += doc
            if n < length:
                labels[r, n - 1:length - 1] = self.pad_label  # the last real token predicts the first pad
                labels[r, n - 1] = IGNORE_INDEX if self.pad_label == IGNORE_INDEX else self.pad_label
                if self.neat_packing:
                    positions[r, n:] = torch.arange(length - n)
        loss_mask = (labels != IGNORE_INDEX).long()
        return {"tokens": tokens, "labels": labels.clamp(min=0), "loss_mask": loss_mask, "position_ids": positions}
