"""Supervised examples: canonical example → input ids and labels, the length budget, and packing.

LLaMA-Factory's rules (processor/supervised.py), which MindSpeed-LLM's FSDP2 SFT vendors:
- Labels are IGNORE_INDEX on prompts and the token ids on replies; `train_on_prompt` labels prompts too;
  `mask_history` labels only the last turn's reply (turns are added from the last one backwards so the last
  turn survives the cutoff).
- `cutoff_len` is shared turn by turn: each turn gets what the earlier turns left, split between prompt and reply
  by `infer_seqlen` — a reply shorter than half the budget is kept whole, else a prompt shorter than half is
  kept whole, else both are cut in proportion to their lengths. `efficient_eos` templates reserve one token
  for the eos appended at the end (labelled), and label the first prompt token of every later turn (in the
  order turns are taken) with the eos id: the replies of those templates carry no eos of their own.
- `packing`: the encoded examples of one preprocessing batch are packed by a greedy knapsack (each row at most
  `cutoff_len` tokens, examples encoded to `cutoff_len - 1` so a row keeps room for a pad token); a packed row
  records its examples' lengths (`doc_lens`).
Labels here are aligned with input_ids (HF style); the collator shifts them within each example.
"""
from __future__ import annotations

import bisect
from typing import Dict, List, Sequence, Tuple

from fsdp2_backend.data.sft.template import encode_conversations

IGNORE_INDEX = -100


def infer_seqlen(source_len: int, target_len: int, cutoff_len: int) -> Tuple[int, int]:
    """(prompt tokens kept, reply tokens kept) of a turn given the remaining budget."""
    if target_len * 2 < cutoff_len:
        max_target = cutoff_len
    elif source_len * 2 < cutoff_len:
        max_target = cutoff_len - source_len
    else:
        max_target = int(cutoff_len * (target_len / (source_len + target_len)))
    new_target = min(max_target, target_len)
    new_source = min(max(cutoff_len - new_target, 0), source_len)
    return new_source, new_target


def encode_supervised(pairs: Sequence[Tuple[List[int], List[int]]], cutoff_len: int, *, train_on_prompt: bool,
                      mask_history: bool, efficient_eos: bool, eos_id) -> Tuple[List[int], List[int]]:
    """(input_ids, labels) of one example's (prompt ids, reply ids) turns under the budget and mask rules."""
    input_ids: List[int] = []
    labels: List[int] = []
    total = 1 if efficient_eos else 0
    ordered = list(pairs)[::-1] if mask_history else list(pairs)
    for turn, (source, target) in enumerate(ordered):
        if total >= cutoff_len:
            break
        source_len, target_len = infer_seqlen(len(source), len(target), cutoff_len - total)
        source, target = source[:source_len], target[:target_len]
        total += source_len + target_len
        source_label = list(source) if train_on_prompt else [IGNORE_INDEX] * source_len
        if efficient_eos and turn != 0 and not train_on_prompt and source_len and eos_id is not None:
            source_label[0] = eos_id  # the eos the previous reply left out, as LLaMA-Factory labels it
        target_label = [IGNORE_INDEX] * target_len if (mask_history and turn != 0) else list(target)
        if mask_history:  # turns were taken last first: put each one before the ones already added
            input_ids = list(source) + list(target) + input_ids
            labels = source_label + target_label + labels
        else:
            input_ids += list(source) + list(target)
            labels += source_label + target_label
    if efficient_eos and eos_id is not None:
        input_ids.append(eos_id)
        labels.append(eos_id)
    return input_ids, labels


def greedy_knapsack(lengths: List[int], capacity: int) -> List[List[int]]:
    """Groups of lengths (each group's sum <= capacity): repeatedly fill a knapsack with the largest length
    that still fits (LLaMA-Factory's greedy_knapsack)."""
    remaining = sorted(lengths)
    knapsacks = []
    while remaining:
        current, room = [], capacity
        while True:
            index = bisect.bisect(remaining, room)
            if index == 0:
                break
            room -= remaining[index - 1]
            current.append(remaining.pop(index - 1))
        if not current:  # a length above the capacity: cannot happen for encoded examples, never loop forever
            current.append(remaining.pop())
        knapsacks.append(current)
    return knapsacks


def pack_examples(input_ids: List[List[int]], labels: List[List[int]], cutoff_len: int) -> Dict[str, list]:
    """Packed rows of encoded examples: concatenated ids and labels, and `doc_lens` per row."""
    by_length: Dict[int, List[int]] = {}
    for index, ids in enumerate(input_ids):
        by_length.setdefault(len(ids), []).append(index)
    rows: Dict[str, list] = {"input_ids": [], "labels": [], "doc_lens": []}
    for knapsack in greedy_knapsack([len(ids) for ids in input_ids], cutoff_len):
        packed_ids, packed_labels, lens = [], [], []
        for length in knapsack:
            index = by_length[length].pop()
            packed_ids += input_ids[index]
            packed_labels += labels[index]
            lens.append(length)
        rows["input_ids"].append(packed_ids)
        rows["labels"].append(packed_labels)
        rows["doc_lens"].append(lens)
    return rows


class SupervisedProcessor:
    """The batched map function: canonical rows (formats.py) → encoded (and, with packing, packed) examples.

    Picklable (datasets' worker processes get a copy). Examples whose labels are all IGNORE_INDEX after the
    cutoff (nothing to learn) are dropped, as LLaMA-Factory drops them.
    """

    def __init__(self, template, hf_tokenizer, data_args, packing: bool):
        self.template, self.hf = template, hf_tokenizer
        self.cutoff_len = data_args.cutoff_len - (1 if packing else 0)
        self.packing, self.full_len = packing, data_args.cutoff_len
        self.train_on_prompt, self.mask_history = data_args.train_on_prompt, data_args.mask_history
        self.eos_id = hf_tokenizer.eos_token_id  # looked up once: transformers' property costs ~30 us a call

    def __call__(self, batch: Dict[str, list]) -> Dict[str, list]:
        render = self.template.render
        columns = (batch.get(name, ()) for name in ("messages", "system", "tools"))  # each read out once
        conversations = [render(messages, system, tools) for messages, system, tools in zip(*columns)]
        ids_out, labels_out = [], []
        for pairs in encode_conversations(self.hf, conversations):
            ids, labels = encode_supervised(pairs, self.cutoff_len, train_on_prompt=self.train_on_prompt,
                                            mask_history=self.mask_history, efficient_eos=self.template.efficient_eos,
                                            eos_id=self.eos_id)
            if ids and labels.count(IGNORE_INDEX) != len(labels):  # something to learn (count: C speed)
                ids_out.append(ids)
                labels_out.append(labels)
        if self.packing:
            return pack_examples(ids_out, labels_out, self.cutoff_len)
        return {"input_ids": ids_out, "labels": labels_out, "doc_lens": [[len(ids)] for ids in ids_out]}
