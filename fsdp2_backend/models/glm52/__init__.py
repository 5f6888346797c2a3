"""Model id `glm52`: transformers' glm_moe_dsa with stacked experts and this project's router
(models/moe/family_swap.py), DSA context parallel (parallel/context_parallel/dsa_glm.py). Imports nothing: the
spec is read without torch.
"""
