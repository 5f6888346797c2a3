#!/usr/bin/env python
"""Writes the generated reference pages in docs/: the Megatron → native migration table and the native config
reference. Both come from the code (the translation and the config dataclasses), so they cannot drift.

    python -m fsdp2_backend.cli.update_docs          # rewrite docs/migration_table.md and docs/config_reference.md
    python -m fsdp2_backend.cli.update_docs --check  # exit 1, naming the stale files, if either is out of date

tests/tools/test_readme.py runs the check; run the first command after changing a flag, a translation rule or a
config field.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Dict, List

from fsdp2_backend.cli.gen_config_reference import config_reference_markdown
from fsdp2_backend.cli.gen_migration_table import migration_table_markdown

DOCS = Path(__file__).resolve().parents[2] / "docs"


def generated_docs() -> Dict[Path, str]:
    """Each generated file and the text it must hold now."""
    return {DOCS / "migration_table.md": migration_table_markdown(),
            DOCS / "config_reference.md": config_reference_markdown()}


def stale_docs() -> List[Path]:
    """The generated files that are missing or differ from what the code generates now."""
    return [path for path, text in generated_docs().items()
            if not path.is_file() or path.read_text(encoding="utf-8") != text]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only check; exit 1 if a file is out of date")
    args = parser.parse_args()
    if args.check:
        stale = stale_docs()
        for path in stale:
            print(f"{path.relative_to(DOCS.parent)} is out of date — run: python -m fsdp2_backend.cli.update_docs",
                  file=sys.stderr)
        return 1 if stale else 0
    DOCS.mkdir(exist_ok=True)
    for path, text in generated_docs().items():
        path.write_text(text, encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
