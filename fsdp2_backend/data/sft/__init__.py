"""The fine-tuning data path (`data_manager_type: lf`, `stage: sft`): LLaMA-Factory's data semantics, ours.

formats.py (alpaca / sharegpt / openai → canonical), loader.py (dataset_info.json, files, mixing),
template.py (qwen3 / gpt / empty / the tokenizer's own), supervised.py (labels, cutoff budget, packing),
collator.py (micro-batches, position ids), pipeline.py (preparation, caching, loaders), job_data.py (build's and
the trainer's view: the train stream and the evaluation hook).
"""
