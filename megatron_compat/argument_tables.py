"""Where Megatron-LM's and MindSpeed-LLM's argument tables are (data files shipped in `megatron_compat/parse/`).

A torch-free fact both the flag parser (`parse.arguments`, which builds its parser from them) and the saved-args
mapping (`architecture.saved_args`, which tells a flag given in a checkpoint's args from Megatron's default) read;
here, below both, so neither reaches into the other's folder.
"""
from pathlib import Path

_PARSE_DATA = Path(__file__).resolve().parent / "parse"
MEGATRON_TABLE = _PARSE_DATA / "megatron_lm_arguments.json"  # Megatron-LM's own parser, dumped verbatim
DIALECT_TABLE = _PARSE_DATA / "mindspeed_flags.json"
MINDSPEED_NAMES = _PARSE_DATA / "mindspeed_llm_flag_names.txt"
