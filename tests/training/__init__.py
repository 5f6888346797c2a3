"""The loop, loss, optimizer, scheduler, checkpoints, logging, export (fsdp2_backend/training/)."""
