"""Megatron data: indexed files, GPT datasets and blending, with megatron-core's public names."""
