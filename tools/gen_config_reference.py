#!/usr/bin/env python
"""Prints the native configuration reference (every group and field) as Markdown, from fsdp2_backend.config."""
from __future__ import annotations

import json

from fsdp2_backend.config.loading import field_help


def config_reference_markdown() -> str:
    lines, current = [], None
    for group, name, type_text, default, help_text in field_help():
        if group != current:
            lines += ["", f"#### `{group}:`", "", "| field | type | default | meaning |", "|---|---|---|---|"]
            current = group
        lines.append(f"| `{name}` | {type_text.replace('|', '/')} | `{json.dumps(default)}` | "
                     f"{help_text.replace('|', '/')} |")
    return "\n".join(lines).strip() + "\n"


if __name__ == "__main__":
    print(config_reference_markdown(), end="")
