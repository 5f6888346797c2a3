"""Megatron's flags, translation, data formats and checkpoint formats (megatron_compat/)."""
