"""Which transformers tokenizer class `AutoTokenizer.from_pretrained(path)` would load, read off the files, for
the common case where the answer is the generic `TokenizersBackend` (a `tokenizer.json`).

Why: transformers 5.25's `AutoTokenizer` imports its config machinery, which imports torch (~1.8 s of a
preprocessing run that never needs torch); `TokenizersBackend` itself does not. So where the files settle
the choice, `HuggingFaceTokenizer` loads that class directly (0.9 s instead of 3.0 s for the tokenizer's
load, imports included); anywhere else it asks `AutoTokenizer`, which is always right.

The rules followed (transformers 5.25, models/auto/tokenization_auto.py, `AutoTokenizer.from_pretrained`):
`TokenizersBackend` is what it loads when tokenizer_config.json names the generic class (`TokenizersBackend`
or `PreTrainedTokenizerFast`) with no `auto_map` (no custom code), unless config.json's `model_type` overrides
the file: a type listed in `MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS` (its registered class wins) or one
registered to `MistralCommonBackend` (tekken files). Those two tables are read from transformers' own source
(parsed, not imported); a type found in either, a config.json with `auto_map` or that cannot be read, or a
source that cannot be parsed, leaves the choice to `AutoTokenizer`.
"""
from __future__ import annotations

import ast
import importlib.util
import json
import os
from functools import lru_cache
from typing import Optional, Set, Tuple

GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _read_json(path: str) -> Optional[dict]:
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f)
    except (OSError, ValueError):
        return None
    return value if isinstance(value, dict) else None


@lru_cache(maxsize=1)
def _auto_tables() -> Optional[Tuple[Set[str], Set[str]]]:
    """(model types whose hub tokenizer class transformers overrides, model types registered to
    MistralCommonBackend), parsed from transformers' tokenization_auto.py; None when it cannot be read."""
    try:
        spec = importlib.util.find_spec("transformers")
        source_path = os.path.join(os.path.dirname(spec.origin), "models", "auto", "tokenization_auto.py")
        with open(source_path, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (AttributeError, ImportError, OSError, SyntaxError, ValueError, TypeError):
        return None
    overridden, mistral = None, None
    for node in tree.body:
        target, value = None, None
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            target, value = node.target.id, node.value
        elif isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            target, value = node.targets[0].id, node.value
        if target == "MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS" and isinstance(value, ast.Set):
            overridden = {e.value for e in value.elts if isinstance(e, ast.Constant)}
        elif target == "TOKENIZER_MAPPING_NAMES" and isinstance(value, ast.Call) and value.args \
                and isinstance(value.args[0], ast.List):
            mistral = set()
            for entry in value.args[0].elts:
                if not (isinstance(entry, ast.Tuple) and entry.elts and isinstance(entry.elts[0], ast.Constant)):
                    return None  # a shape this reader does not know: let AutoTokenizer decide
                names = {n.value for n in ast.walk(entry) if isinstance(n, ast.Constant)}
                if "MistralCommonBackend" in names:
                    mistral.add(entry.elts[0].value)
    if overridden is None or mistral is None:
        return None
    return overridden, mistral


def generic_backend_applies(path: str) -> bool:
    """Whether `AutoTokenizer.from_pretrained(path)` loads `TokenizersBackend` from this local directory, as
    decided by its files alone (False: unknown, ask AutoTokenizer)."""
    if not (os.path.isdir(path) and os.path.isfile(os.path.join(path, "tokenizer.json"))):
        return False
    tokenizer_config = _read_json(os.path.join(path, "tokenizer_config.json"))
    if tokenizer_config is None or "auto_map" in tokenizer_config:
        return False
    if tokenizer_config.get("tokenizer_class") not in GENERIC_CLASSES:
        return False
    config_path = os.path.join(path, "config.json")
    if not os.path.exists(config_path):
        return True
    config = _read_json(config_path)
    if config is None or "auto_map" in config:
        return False
    model_type = config.get("model_type")
    if not model_type:
        return True
    tables = _auto_tables()
    if tables is None:
        return False
    overridden, mistral = tables
    return model_type not in overridden and model_type not in mistral
