"""Model id `gpt_oss`: gpt-oss: sink attention, grouped experts, the project's router (`modeling.py`).
Imports nothing: the spec is read without torch.
"""
