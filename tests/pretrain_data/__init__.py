"""Pretraining data: Megatron's datasets, samplers, batch ramp-up (fsdp2_backend/data/pretrain.py)."""
