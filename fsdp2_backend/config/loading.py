"""Loading the native configuration: YAML files, `--group.field value` overrides, typed coercion, YAML output.

Why our own and not transformers' HfArgumentParser: that parser flattens every dataclass into one namespace
of `--field` flags; it has neither the grouped `--group.field` form nor YAML files organised by group, and
it raises on bad input instead of collecting every problem. The mapping here is small: one coercion function
driven by the dataclasses' type hints.
"""
from __future__ import annotations

import difflib
import json
import typing
from dataclasses import fields
from typing import Any, Dict, List, Literal, Tuple, Union

import yaml

from fsdp2_backend.config.schema import GROUPS, Config
from fsdp2_backend.usage_errors import UsageError

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}
_NONE = {"none", "null", "~"}


def field_types(group: str) -> Dict[str, Any]:
    """Resolved type hints of one group's fields."""
    return typing.get_type_hints(GROUPS[group])


def _describe(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if origin is Union:
        return " or ".join("null" if a is type(None) else _describe(a) for a in args)
    if origin in (list, List):
        return f"a list of {_describe(args[0])}"
    if origin in (dict, Dict):
        return "a mapping (YAML or JSON)"
    return getattr(tp, "__name__", str(tp))


def coerce(value: Any, tp: Any) -> Any:
    """Converts a YAML value or a command-line string to `tp`; raises ValueError with what was expected."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Union:
        if value is None or (isinstance(value, str) and value.strip().lower() in _NONE and type(None) in args):
            if type(None) in args:
                return None
        members = [a for a in args if a is not type(None)]
        # A dict-or-string field: YAML/JSON text that looks like a mapping is a mapping.
        if isinstance(value, str) and any(typing.get_origin(a) in (dict, Dict) for a in members):
            if value.lstrip().startswith("{"):
                return coerce(value, next(a for a in members if typing.get_origin(a) in (dict, Dict)))
        for member in members:
            try:
                return coerce(value, member)
            except ValueError:
                continue
        raise ValueError(f"expected {_describe(tp)}, got {value!r}")
    if origin is Literal:
        for choice in args:
            if value == choice or (isinstance(value, str) and str(choice) == value):
                return choice
        raise ValueError(f"expected {_describe(tp)}, got {value!r}")
    if origin in (list, List):
        if isinstance(value, str):
            text = value.strip()
            value = json.loads(text) if text.startswith("[") else text.split()
        if not isinstance(value, (list, tuple)):
            value = [value]
        return [coerce(v, args[0]) for v in value]
    if origin in (dict, Dict):
        if isinstance(value, str):  # YAML (a flow mapping `{a: 1}` or `a: 1`), hence JSON too, as the help says
            try:
                value = yaml.safe_load(value)
            except yaml.YAMLError as exc:
                why = getattr(exc, "problem", None) or str(exc).splitlines()[0]
                raise ValueError(f"expected a YAML or JSON mapping, got {value!r} ({why})") from None
        if not isinstance(value, dict):
            raise ValueError(f"expected a mapping, got {value!r}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, int) and value in (0, 1):  # MindSpeed's YAMLs write booleans as 1 / 0
            return bool(value)
        if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
            return value.strip().lower() in _TRUE
        raise ValueError(f"expected true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ValueError(f"expected an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                pass
        raise ValueError(f"expected an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            raise ValueError(f"expected a number, got {value!r}")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            try:
                return float(value.strip())
            except ValueError:
                pass
        raise ValueError(f"expected a number, got {value!r}")
    if tp is str:
        if isinstance(value, (dict, list)):
            raise ValueError(f"expected a string, got {value!r}")
        return value if isinstance(value, str) else str(value)
    if tp is Any:
        return value
    raise ValueError(f"unsupported field type {tp}")


def _unknown(name: str, known) -> str:
    close = difflib.get_close_matches(name, list(known), n=1)
    return f" (did you mean {close[0]}?)" if close else ""


def load_yaml(path: str) -> Dict[str, Dict[str, Any]]:
    """Reads a grouped YAML config file; a malformed file names the file and the line."""
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise UsageError(f"{path}: config file not found — check the path") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise UsageError(f"{path}{where}: malformed YAML: {problem} — fix the YAML syntax") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise UsageError(f"{path}: expected a mapping of groups ({', '.join(GROUPS)}) — see the README")
    errors, groups = [], {}
    for group, values in data.items():
        if group not in GROUPS:
            errors.append(f"{path}: unknown group '{group}'{_unknown(str(group), GROUPS)} — groups are "
                          f"{', '.join(GROUPS)}")
        elif values is not None and not isinstance(values, dict):
            errors.append(f"{path}: group '{group}' must be a mapping of field: value")
        else:
            groups[group] = dict(values or {})
    if errors:
        raise UsageError(errors)
    return groups


def split_native_overrides(argv: List[str]) -> Tuple[Dict[str, Dict[str, Any]], List[str]]:
    """Takes `--group.field value...` out of argv; returns ({group: {field: raw}}, the other arguments).

    A value is every following token up to the next `--option` (so list fields take space-separated values);
    a flag with no value means true.
    """
    overrides: Dict[str, Dict[str, Any]] = {}
    rest: List[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        head = token[2:].split("=", 1)[0] if token.startswith("--") else ""
        if "." in head and head.split(".", 1)[0] in GROUPS:
            group, name = head.split(".", 1)
            if "=" in token:
                values = [token.split("=", 1)[1]]
                i += 1
            else:
                j = i + 1
                while j < len(argv) and not argv[j].startswith("--"):
                    j += 1
                values, i = argv[i + 1:j], j
            raw: Any = values[0] if len(values) == 1 else (values if values else "true")
            overrides.setdefault(group, {})[name] = raw
        else:
            rest.append(token)
            i += 1
    return overrides, rest


def build_config(layers: List[Tuple[str, Dict[str, Dict[str, Any]]]]) -> Config:
    """Builds a Config from layers applied in order (later layers override), each named for error messages.

    Every unknown field and every badly typed value is reported at once.
    """
    config = Config()
    errors: List[str] = []
    for origin, groups in layers:
        for group, values in groups.items():
            if group not in GROUPS:
                errors.append(f"{group}: unknown group{_unknown(group, GROUPS)} ({origin})")
                continue
            types = field_types(group)
            target = getattr(config, group)
            for name, value in values.items():
                if name not in types:
                    errors.append(f"{group}.{name}: unknown field{_unknown(name, types)} ({origin}) — see the "
                                  f"README's native config reference")
                    continue
                try:
                    setattr(target, name, coerce(value, types[name]))
                except ValueError as exc:
                    errors.append(f"{group}.{name}: {exc} ({origin})")
    if errors:
        raise UsageError(errors)
    return config


def to_yaml(config: Config) -> str:
    """The whole config as grouped YAML that `build_config([("yaml", load_yaml(...))])` reads back unchanged."""
    return yaml.safe_dump(config.to_dict(), sort_keys=False, default_flow_style=False, allow_unicode=True)


def field_help() -> List[Tuple[str, str, str, Any, str]]:
    """(group, field, type, default, help) for every field: the README's native config reference."""
    rows = []
    defaults = Config().to_dict()
    for group, cls in GROUPS.items():
        types = field_types(group)
        for f in fields(cls):
            rows.append((group, f.name, _describe(types[f.name]), defaults[group][f.name], f.metadata["help"]))
    return rows
