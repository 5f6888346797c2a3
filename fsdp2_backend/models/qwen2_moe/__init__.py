"""Model id `qwen2_moe`: transformers' model with stacked experts and this project's router
(models/moe/family_swap.py, shared with the other family-swap ids). Imports nothing: the spec is read without
torch.
"""
