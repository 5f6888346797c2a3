"""Model id `qwen3`: transformers' Qwen3 causal LM (`modeling.py`). Imports nothing: the spec is read without torch.
"""
