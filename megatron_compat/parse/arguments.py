"""The Megatron command line: an argparse parser that knows every Megatron-LM argument and the MindSpeed dialects.

The parser is built from data, not hand-written `add_argument` calls: `megatron_lm_arguments.json` (all 839
Megatron-LM arguments with their option strings, action, nargs, type, choices and default) and
`mindspeed_flags.json` (MindSpeed-LLM's arguments, the MindSpeed core features its scripts pass, the extra
arguments of Megatron-LM's inference example scripts and its ModelOpt post-training arguments). Both files ship as package data next to this module.

Parse errors never print argparse's usage: every problem becomes one `UsageError` message
`--flag: <why> — <what to do>`, and unknown flags are all listed at once. No torch import here (dry-run speed).
"""
from __future__ import annotations

import argparse
import ast
import difflib
import json
import re
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Dict, FrozenSet, List, Optional, Sequence, Tuple

from fsdp2_backend.usage_errors import UsageError

from megatron_compat.argument_tables import DIALECT_TABLE, MEGATRON_TABLE, MINDSPEED_NAMES  # noqa: F401 — re-read here

# Which table an argument came from, for reports and the migration table.
SOURCE_MEGATRON = "megatron-lm"
DIALECT_SOURCES = {"mindspeed_llm": "mindspeed-llm", "mindspeed": "mindspeed", "megatron_inference_scripts":
                   "megatron-inference-script", "megatron_post_training": "megatron-lm-post-training"}

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


@lru_cache(maxsize=None)
def megatron_table() -> Tuple[Dict[str, Any], ...]:
    """The Megatron-LM argument records (flags, dest, group, action, nargs, default, type, choices)."""
    with open(MEGATRON_TABLE, encoding="utf-8") as f:
        return tuple(json.load(f))


@lru_cache(maxsize=None)
def dialect_table() -> Dict[str, Any]:
    """The dialect specs: {'extend_choices': {...}, 'mindspeed_llm': {...}, 'mindspeed': {...}, ...}."""
    with open(DIALECT_TABLE, encoding="utf-8") as f:
        return json.load(f)


def mindspeed_llm_names() -> List[str]:
    """Every MindSpeed-LLM flag name, as listed in the shipped names file."""
    return MINDSPEED_NAMES.read_text(encoding="utf-8").split()


# --- value types -------------------------------------------------------------------------------------------------

def _bool(text: str) -> bool:
    if text.lower() in _TRUE:
        return True
    if text.lower() in _FALSE:
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _freq(text: str) -> Any:
    """Megatron's layer-frequency arguments: an integer N (every N-th layer) or a Python list expression."""
    try:
        return int(text)
    except ValueError:
        pass
    try:
        value = _eval_list_expression(text)
    except (ValueError, SyntaxError, TypeError):
        raise argparse.ArgumentTypeError(f"expected an integer or a list such as ([0]*3+[1]*11), got {text!r}")
    return value


def _eval_list_expression(text: str) -> List[int]:
    """Evaluates `([0]*3+[1]*11)`-style expressions (lists of ints, `*` with an int, `+`) without eval()."""
    def ev(node: ast.AST) -> Any:
        if isinstance(node, ast.Expression):
            return ev(node.body)
        if isinstance(node, ast.List):
            return [ev(e) for e in node.elts]
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Mult, ast.Add)):
            left, right = ev(node.left), ev(node.right)
            return left * right if isinstance(node.op, ast.Mult) else left + right
        raise ValueError("unsupported expression")
    value = ev(ast.parse(text.strip(), mode="eval"))
    if not isinstance(value, list) or not all(isinstance(v, int) for v in value):
        raise ValueError("not a list of integers")
    return value


def _int_tuple(text: str) -> Tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.strip("()[] ").split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 127,0, got {text!r}")


_TYPES = {"int": int, "float": float, "str": str, None: None, "bool": _bool, "moe_freq_type": _freq,
          "no_rope_freq_type": _freq, "la_freq_type": _freq, "tuple_type": _int_tuple,
          "_parse_cuda_graph_modules_arg": str, "enum_type_handler": str}


# String arguments whose value has spaces ('0:384 200B:768'): a script that leaves it unquoted (or a YAML launcher
# that splits it) passes several words; they are joined by the translation.
_SEVERAL_WORDS = frozenset({"step_batch_size_schedule"})


def _default(record: Dict[str, Any]) -> Any:
    """The JSON stores some defaults as their repr ('[]', "['p2p']", '<AttnBackend.auto: 5>')."""
    value = record["default"]
    if isinstance(value, str) and value.startswith("[") and value.endswith("]"):
        return ast.literal_eval(value)
    match = re.fullmatch(r"<\w+\.(\w+): .*>", value) if isinstance(value, str) else None
    return match.group(1) if match else value


def _choices(record: Dict[str, Any], extra: Sequence[str]) -> Optional[List[Any]]:
    choices = record["choices"]
    if choices is None:
        return None
    if record["type"] == "enum_type_handler":
        if not all(isinstance(c, str) for c in choices):
            return None  # --exit-signal: signal names or numbers, checked by nobody here (no effect anyway)
        choices = [c.split(".", 1)[1] for c in choices]  # 'AttnBackend.flash' → 'flash', as users type it
    return list(choices) + list(extra)


# --- the parser --------------------------------------------------------------------------------------------------

class _ParseFailure(Exception):
    """argparse's error(), caught and turned into UsageError messages."""


class MegatronArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser that raises instead of printing usage and exiting."""

    def error(self, message: str):  # noqa: D401 — argparse's hook
        raise _ParseFailure(message)


def _add_megatron(parser: argparse.ArgumentParser, extend: Dict[str, List[str]]) -> None:
    for record in megatron_table():
        action, flags = record["action"], record["flags"]
        if action == "_HelpAction":
            continue  # argparse's own -h/--help
        kwargs: Dict[str, Any] = {"dest": record["dest"], "default": _default(record)}
        if action == "_StoreTrueAction":
            kwargs["action"] = "store_true"
        elif action == "_StoreFalseAction":
            kwargs["action"] = "store_false"
        elif action == "BooleanOptionalAction":
            kwargs["action"] = argparse.BooleanOptionalAction
            flags = [flags[0]]  # argparse derives the --no- form itself
        else:
            kwargs["type"] = _TYPES[record["type"]]
            if record["nargs"] is not None:
                kwargs["nargs"] = record["nargs"]
            if record["dest"] in _SEVERAL_WORDS:  # one quoted string in Megatron; its words unquoted taken too
                kwargs["nargs"] = "+"
            kwargs["choices"] = _choices(record, extend.get(flags[0], ()))
        parser.add_argument(*flags, **kwargs)


def _add_dialect(parser: argparse.ArgumentParser, specs: Dict[str, Any]) -> None:
    known = parser._option_string_actions  # the public API has no lookup by option string
    for flag, spec in specs.items():
        if flag in known:
            continue  # a Megatron-LM argument under the same name: Megatron's definition wins
        if spec == "store_true":
            parser.add_argument(flag, action="store_true", default=False)
            continue
        spec = {"type": spec} if isinstance(spec, str) else dict(spec)
        spec["type"] = _TYPES[spec.get("type")]
        spec.setdefault("default", None)
        parser.add_argument(flag, **spec)


@lru_cache(maxsize=None)
def _cached_parser() -> MegatronArgumentParser:
    return build_parser()


def build_parser() -> MegatronArgumentParser:
    """A parser knowing every Megatron-LM argument plus the MindSpeed-LLM, MindSpeed and inference-script ones."""
    parser = MegatronArgumentParser(prog="pretrain_fsdp2.py", description="Megatron-LM / MindSpeed-LLM arguments",
                                    allow_abbrev=False)  # Megatron disables abbreviations too
    dialects = dialect_table()
    _add_megatron(parser, dialects["extend_choices"])
    for section in DIALECT_SOURCES:
        _add_dialect(parser, dialects[section])
    return parser


@lru_cache(maxsize=None)
def megatron_groups() -> Dict[str, str]:
    """dest → the Megatron-LM argument group it belongs to."""
    return {record["dest"]: record["group"] for record in megatron_table()}


def flag_sources() -> Dict[str, str]:
    """dest → which table defines it (megatron-lm, mindspeed-llm, mindspeed, megatron-inference-script)."""
    sources = {record["dest"]: SOURCE_MEGATRON for record in megatron_table()}
    megatron_flags = {flag for record in megatron_table() for flag in record["flags"]}
    for section, name in DIALECT_SOURCES.items():
        for flag in dialect_table()[section]:
            if flag not in megatron_flags:
                sources.setdefault(flag[2:].replace("-", "_"), name)
    return sources


# --- parsing -----------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ParsedArgs:
    """The parsed namespace and the dests the command line named explicitly."""

    namespace: argparse.Namespace
    given: FrozenSet[str]


def _friendly(message: str) -> str:
    """argparse's 'argument --x/--y: why' → '--x: why — what to do'."""
    match = re.match(r"argument (\S+?)(?:/\S+)?: (.*)", message)
    if not match:
        return f"{message} — check the command line"
    flag, why = match.groups()
    if "expected" in why and "argument" in why:
        hint = "give it a value"
    elif "invalid choice" in why:
        hint = "use one of the listed values"
    elif "ignored explicit argument" in why:
        hint = "this flag takes no value; drop the '=...'"
    else:
        hint = "fix the value"
    return f"{flag}: {why} — {hint}"


def _unknown_messages(parser: argparse.ArgumentParser, extras: List[str]) -> List[str]:
    known = list(parser._option_string_actions)
    messages, strays = [], []
    for token in extras:
        if token.startswith("-") and not _is_number(token):
            flag = token.split("=", 1)[0]
            close = difflib.get_close_matches(flag, known, n=1)
            hint = f"did you mean {close[0]}?" if close else "remove it"
            messages.append(f"{flag}: not a Megatron-LM or MindSpeed-LLM argument — {hint}")
        else:
            strays.append(token)
    if strays:
        shown = " ".join(repr(s) for s in strays[:8]) + (" ..." if len(strays) > 8 else "")
        messages.append(f"{shown}: value(s) that no flag takes — quote values containing spaces, or remove them")
    return messages


def _is_number(token: str) -> bool:
    try:
        float(token)
        return True
    except ValueError:
        return False


def given_dests(parser: argparse.ArgumentParser, argv: Sequence[str]) -> FrozenSet[str]:
    """Dests whose option string appears in argv (abbreviations are off, so an exact match is the rule)."""
    actions = parser._option_string_actions
    return frozenset(actions[t.split("=", 1)[0]].dest for t in argv
                     if t.startswith("--") and t.split("=", 1)[0] in actions)


_BRACKETED = re.compile(r"^\[(.*)\]$", re.S)


def unbracket_lists(parser: argparse.ArgumentParser, argv: Sequence[str]) -> List[str]:
    """A list flag's value written as one bracketed word, as Megatron's functional-test YAMLs write them
    (`--recompute-modules "[layernorm mlp]"`, `--hierarchical-context-parallel-sizes "[2 2]"`, also with commas),
    → its words; argparse would read the brackets as part of one value."""
    out: List[str] = []
    actions = parser._option_string_actions
    argv, index = list(argv), 0
    while index < len(argv):  # an unquoted `[2 2]` arrives as `[2` `2]`: joined back to one word
        token = argv[index]
        if token.startswith("[") and not token.endswith("]"):
            end = next((j for j in range(index + 1, len(argv)) if argv[j].endswith("]")), None)
            if end is not None and not any(t.startswith("-") and not _is_number(t) for t in argv[index:end + 1]):
                argv[index:end + 1] = [" ".join(argv[index:end + 1])]
        index += 1
    for token in argv:
        flag, eq, value = token.partition("=")
        action = actions.get(flag) if token.startswith("--") else None
        if eq and action is not None and action.nargs in ("+", "*") and _BRACKETED.match(value):
            out += [flag] + _BRACKETED.match(value).group(1).replace(",", " ").split()
            continue
        previous = actions.get(out[-1]) if out and out[-1].startswith("--") else None
        match = _BRACKETED.match(token)
        if match and previous is not None and previous.nargs in ("+", "*"):
            out += match.group(1).replace(",", " ").split()
            continue
        out.append(token)
    return out


def _without_failed(parser: argparse.ArgumentParser, argv: List[str], message: str) -> Optional[List[str]]:
    """argv without the flag argparse failed on (each of its occurrences, with the values it took), so that the
    parse can go on to the next problem; None when the flag cannot be told."""
    match = re.match(r"argument (\S+?)(?:/\S+)?: ", message)
    action = parser._option_string_actions.get(match.group(1)) if match else None
    if action is None:
        return None
    out, index = [], 0
    while index < len(argv):
        token = argv[index]
        index += 1
        if token.split("=", 1)[0] not in action.option_strings:
            out.append(token)
        elif "=" not in token and action.nargs != 0:  # its values: up to the next flag (one unless a list)
            takes = 1 if action.nargs in (None, "?") else (action.nargs if isinstance(action.nargs, int) else None)
            while index < len(argv) and (takes is None or takes > 0) and not (
                    argv[index].startswith("-") and not _is_number(argv[index])):
                index += 1
                takes = None if takes is None else takes - 1
    return out


def parse_megatron(argv: Sequence[str]) -> ParsedArgs:
    """Parses a Megatron/MindSpeed command line; raises UsageError listing every problem (argparse stops at the
    first bad value: the flag it names is set aside and the rest parsed again, for the next one)."""
    parser = _cached_parser()
    argv = unbracket_lists(parser, argv)
    messages: List[str] = []
    remaining = list(argv)
    while True:
        try:
            namespace, extras = parser.parse_known_args(remaining)
            break
        except _ParseFailure as exc:
            messages.append(_friendly(str(exc)))
            shorter = _without_failed(parser, remaining, str(exc))
            if shorter is None or len(shorter) == len(remaining):
                raise UsageError(messages) from None
            remaining = shorter
    if extras:
        messages += _unknown_messages(parser, extras)
    if messages:
        raise UsageError(messages)
    return ParsedArgs(namespace, given_dests(parser, argv))


def parse_megatron_args(argv: Sequence[str]) -> argparse.Namespace:
    """The namespace Megatron's parse_args would produce for argv (UsageError on bad input)."""
    return parse_megatron(argv).namespace


def takes_value(option: str) -> bool:
    """Whether the option (e.g. '--lr') consumes a value."""
    action = _cached_parser()._option_string_actions.get(option.split("=", 1)[0])
    return action is not None and action.nargs != 0 and "=" not in option


@lru_cache(maxsize=None)
def defaults() -> Dict[str, Any]:
    """dest → default of every known argument (shared: do not modify)."""
    out: Dict[str, Any] = {}
    for action in _cached_parser()._actions:  # the first action of a shared dest sets it, as in argparse
        if action.dest != "help":
            out.setdefault(action.dest, action.default)
    return out


@lru_cache(maxsize=None)
def option_strings() -> Dict[str, List[str]]:
    """dest → the option strings that set it, several for store_false twins and --no- forms (shared)."""
    out: Dict[str, List[str]] = {}
    for action in _cached_parser()._actions:
        if action.dest != "help":
            out.setdefault(action.dest, []).extend(action.option_strings)
    return out
