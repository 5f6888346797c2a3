"""The fine-tuning data path (fsdp2_backend/data/sft/)."""
