"""The FSDP2 training engine: config, distributed setup, parallel plans, models, data, training."""
