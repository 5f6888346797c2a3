"""Model id `deepseek_v4`: DeepSeek-V4 with grouped experts (`modeling.py`) and its MTP depth module and checkpoint
layout (`mtp.py`). Imports nothing: the spec is read without torch.
"""
