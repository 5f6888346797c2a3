"""The FSDP2 training engine: config, distributed setup, parallel plans, models, data, training."""
from fsdp2_backend import known_noise as _known_noise

_known_noise.install()  # before any entry point or tool imports transformers (and through it, torchao)
