"""Ops against sequential oracles: torch references and triton kernels (fsdp2_backend/kernels/)."""
