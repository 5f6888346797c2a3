"""The launch-corpus figure: how many real Megatron / MindSpeed launch lines pass `pretrain_fsdp2.py --dry-run`.

Each line of a corpus JSON ({"source:path": [argv...]}) goes through the same parse → translate → validate as
`--dry-run` (in-process: `fsdp2_backend.launch.parse_command_line` at the smallest world its layout fits). Prints
lines translated / declined and the decline reasons ranked by how many lines they stop (a line counts once per
flag, or per validation field, that it names), training lines only: a line of Megatron's inference scripts is
declined as such and counted apart.

    python benchmarks/corpus_declines.py [CORPUS.json] [--lines]
(default corpus: tests/data/launch_corpus.json, a copy of shared/megatron/launch_corpus.json).
"""
import collections
import json
import sys
from pathlib import Path

from fsdp2_backend.launch import parse_command_line
from fsdp2_backend.usage_errors import UsageError

DEFAULT = Path(__file__).resolve().parents[1] / "tests" / "data" / "launch_corpus.json"


_INFERENCE = "an argument of Megatron's inference/generation scripts"


def _reason_key(message: str) -> str:
    """The flag or field a message names: `--fp8-format: ...` → `--fp8-format`; a validation field likewise."""
    head = message.split(": ", 1)[0]
    return head if len(head) < 80 else message[:80]


def measure(lines):
    """{key: None | [messages]} for every line (None: it translated and validated)."""
    out = {}
    for key, argv in lines.items():
        try:
            parse_command_line(list(argv), None)
            out[key] = None
        except UsageError as exc:
            out[key] = list(exc.messages)
    return out


def main(argv):
    paths = [a for a in argv if not a.startswith("--")]
    lines = json.loads(Path(paths[0] if paths else DEFAULT).read_text())
    results = measure(lines)
    declined = {k: v for k, v in results.items() if v is not None}
    ok = len(results) - len(declined)
    print(f"translated: {ok} / {len(results)} ({100.0 * ok / len(results):.0f}%), declined: {len(declined)}")
    inference = {k for k, msgs in declined.items() if all(_INFERENCE in m for m in msgs)}
    training = len(results) - len(inference)
    print(f"training lines (without the {len(inference)} inference-script lines, declined as such): {ok} / "
          f"{training} ({100.0 * ok / training:.1f}%)")
    declined = {k: v for k, v in declined.items() if k not in inference}
    counts = collections.Counter(key for msgs in declined.values() for key in {_reason_key(m) for m in msgs})
    for reason, n in counts.most_common():
        print(f"  {n:3d}  {reason}")
    if "--lines" in argv:
        for key, msgs in sorted(declined.items()):
            print(f"\n{key}")
            for message in msgs:
                print(f"    {message}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
