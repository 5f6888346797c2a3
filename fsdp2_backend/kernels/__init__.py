"""Ops that models call: each op has a torch reference, and a triton / NPU implementation where one exists."""
