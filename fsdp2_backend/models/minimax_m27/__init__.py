"""Model id `minimax_m27`: MiniMax-M2 (HF model_type minimax_m2): grouped experts, sigmoid router + checkpoint bias
(`modeling.py`). Imports nothing: the spec is read without torch.
"""
