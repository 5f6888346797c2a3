"""Megatron-shaped front end: argument parser, translation to the native Config, and Megatron data formats."""
