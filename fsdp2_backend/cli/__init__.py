"""The command-line tools' code (`tools/*.py` are thin scripts over these modules, as Megatron users expect
`tools/preprocess_data.py`): importable as `fsdp2_backend.cli.*`, never as a top-level `tools` package, a name
another PyPI project owns."""
