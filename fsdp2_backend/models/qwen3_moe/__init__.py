"""Model id `qwen3_moe`: Qwen3-MoE with stacked experts and this project's router (`modeling.py`; its `configure_moe`
and expert checkpoint keys are shared by the other MoE ids). Imports nothing: the spec is read without torch.
"""
