"""Unexpanded shell syntax in launch lines that were read off a script instead of run through bash.

A launch line copied out of a `.sh` file still holds what bash would have expanded or consumed: `${VAR:-x}`
defaults, `$((8*1))` arithmetic, `if [ ... ]; then ... fi` keywords, `ARGS+=(` array syntax, `<PLACEHOLDER>`
markers and the options of an `nsys profile` command the script runs the launcher under. bash gives these the values below when the variables are unset; anything else (`$1`, `${DATA_PATH}/x`)
is kept as written, since only the user knows its value. Every change is reported as a warning, never silently.
"""
from __future__ import annotations

import re
from typing import Callable, List, Sequence, Tuple

_DEFAULT = re.compile(r"\$\{[A-Za-z0-9_]+:?-([^}]*)\}")
_ARITH = re.compile(r"\$\(\(([0-9+\-*/ ()]+)\)\)")
_KEYWORDS = {"if", "then", "else", "elif", "fi", "[", "]", "];", "[[", "]]", "]];", "!", "((", "))", "(()", "()",
             "(", ")", "do", "done", ";"}
_ARRAY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\+?=\(+\)?$")
_PLACEHOLDER = re.compile(r"^<[A-Z0-9_]+>$")
_TEST_OPERATORS = {"-f", "-n", "-z", "-d", "-e"}
# Options of NVIDIA Nsight Systems' `nsys profile` (each with its value), which scripts keep in a profiling
# command put before the launcher; read off the script they land in the line. None is a Megatron argument.
_NSYS_OPTIONS = {"--sample", "-s", "--cpuctxsw", "--trace", "-t", "--capture-range", "-c", "--capture-range-end",
                 "--cuda-graph-trace", "--cuda-memory-usage", "--force-overwrite", "-f", "--stop-on-exit", "-x",
                 "--output", "-o", "--delay", "-y", "--duration", "-d", "--trace-fork-before-exec",
                 "--cudabacktrace", "--python-sampling", "--gpu-metrics-devices", "--nic-metrics"}


def _expand(token: str) -> str:
    token = _DEFAULT.sub(lambda m: m.group(1), token)

    def arith(match: re.Match) -> str:
        expr = match.group(1)
        if not re.fullmatch(r"[0-9+\-* ()]+", expr):
            return match.group(0)
        return str(_arith(expr))
    return _ARITH.sub(arith, token)


def _arith(expr: str) -> int:
    """Integer + - * with parentheses, as bash's $(( )) does for these launch-line sizes."""
    tokens = re.findall(r"\d+|[+\-*()]", expr)
    pos = 0

    def atom() -> int:
        nonlocal pos
        tok = tokens[pos]
        pos += 1
        if tok == "(":
            value = total()
            pos += 1
            return value
        return int(tok)

    def product() -> int:
        nonlocal pos
        value = atom()
        while pos < len(tokens) and tokens[pos] == "*":
            pos += 1
            value *= atom()
        return value

    def total() -> int:
        nonlocal pos
        value = product()
        while pos < len(tokens) and tokens[pos] in "+-":
            op = tokens[pos]
            pos += 1
            value = value + product() if op == "+" else value - product()
        return value
    return total()


def clean(argv: Sequence[str], takes_value: Callable[[str], bool] = lambda flag: False
          ) -> Tuple[List[str], List[str]]:
    """(argv with shell residue expanded or dropped, warnings saying what was changed).

    A `<PLACEHOLDER>` right after a flag that takes a value is that value (kept); elsewhere it stood for a
    whole group of arguments (dropped).
    """
    out: List[str] = []
    dropped: List[str] = []
    expanded: List[str] = []
    nsys: List[str] = []
    in_test = nsys_value = False
    for token in argv:
        if nsys_value and not token.startswith("-"):  # the value of an nsys option
            nsys.append(token)
            nsys_value = False
            continue
        nsys_value = False
        if in_test and not token.startswith("--"):  # `if [ ... ]`: up to the bracket (a --flag ends it too)
            dropped.append(token)
            in_test = token not in ("]", "];", "]]", "]];")
            continue
        in_test = False
        if token.split("=", 1)[0] in _NSYS_OPTIONS and not takes_value(token.split("=", 1)[0]):
            nsys.append(token)
            nsys_value = "=" not in token
            continue
        if token in ("[", "[["):
            dropped.append(token)
            in_test = True
            continue
        placeholder_value = _PLACEHOLDER.match(token) and out and takes_value(out[-1])
        if token in _KEYWORDS or _ARRAY.match(token) or (_PLACEHOLDER.match(token) and not placeholder_value):
            dropped.append(token)
            continue
        new = _expand(token)
        if new != token:
            expanded.append(f"{token} → {new}")
        out.append(new)
    warnings = []
    if nsys:
        warnings.append("ignored Nsight Systems options (nsys profile's, from the script's profiling command; "
                        "give them to nsys before the launcher): " + " ".join(nsys))
    if dropped:
        warnings.append("ignored shell syntax left in the launch line: " + " ".join(dropped))
    if expanded:
        warnings.append("expanded unset shell variables to their defaults: " + ", ".join(expanded))
    return out, warnings
