"""Model id `qwen3_next`: Qwen3-Next with stacked experts, the project's router and Gated DeltaNet kernels
(`modeling.py`). Imports nothing: the spec is read without torch.
"""
