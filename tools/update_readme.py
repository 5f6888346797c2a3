#!/usr/bin/env python
"""Writes the generated tables into README.md: the migration table and the native config reference.

    python tools/update_readme.py          # rewrite the sections between the README's markers
    python tools/update_readme.py --check  # exit 1 if README.md is out of date

Both tables come from the code (the translation and the config dataclasses), so the README cannot drift.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from tools.gen_config_reference import config_reference_markdown
from tools.gen_migration_table import table_rows

README = Path(__file__).resolve().parents[1] / "README.md"


def _replace(text: str, name: str, body: str) -> str:
    begin, end = f"<!-- {name}:begin -->", f"<!-- {name}:end -->"
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    return f"{head}{begin}\n{body.rstrip()}\n{end}{tail}"


def updated_readme(text: str) -> str:
    migration = "<details><summary>Every flag (click to open)</summary>\n\n" + "\n".join(table_rows()) + \
        "\n\n</details>"
    text = _replace(text, "migration-table", migration)
    return _replace(text, "config-reference", config_reference_markdown())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    current = README.read_text(encoding="utf-8")
    wanted = updated_readme(current)
    if args.check:
        if wanted != current:
            print("README.md is out of date — run python tools/update_readme.py", file=sys.stderr)
            return 1
        return 0
    README.write_text(wanted, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
