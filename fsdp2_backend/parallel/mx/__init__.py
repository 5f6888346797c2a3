"""MXFP8 quantised training pieces used by the `quantize` plan stage (`fsdp2_backend.parallel.quantize`)."""
