"""The docs stay true: the generated pages in docs/ equal what the code generates now, and the README's
commands, flags, links and YAML example agree with the code."""
import re
from pathlib import Path

import pytest

from fsdp2_backend.config.loading import field_help
from fsdp2_backend.launch import parse_command_line
from megatron_compat.parse.arguments import build_parser as megatron_parser
from fsdp2_backend.cli.preprocess_data import build_parser as preprocess_parser
from fsdp2_backend.cli.update_docs import DOCS, generated_docs, stale_docs

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"

# Flags the README uses that belong to neither parser: torchrun's, the entry point's, the tools' own, and the
# README's placeholders.
OTHER_FLAGS = {"--nproc_per_node", "--dry-run", "--check", "--prompt", "--dtype", "--flag", "--group.field"}
OTHER_FLAGS |= {"--help", "--help-flags", "--help-config"}  # pretrain_fsdp2.py's own (fsdp2_backend/launch.py)
OTHER_FLAGS |= {"--hf-config", "--max-shard-size"}  # tools/convert_checkpoint.py's own


def readme() -> str:
    return README.read_text(encoding="utf-8")


def test_generated_docs_up_to_date():
    stale = [str(path.relative_to(REPO)) for path in stale_docs()]
    assert not stale, f"out of date: {', '.join(stale)} — run: python -m fsdp2_backend.cli.update_docs"


def test_readme_gives_the_two_setup_commands():
    text = readme()
    assert "make demo" in text and "make test" in text


def test_readme_links_the_generated_docs_and_holds_no_copy_of_them():
    text = readme()
    for path in generated_docs():
        assert f"]({path.relative_to(REPO)})" in text
    assert "<!--" not in text and "|---|" not in text, "generated tables belong in docs/, not in the README"
    for target in re.findall(r"\]\(([^)#]+)\)", text):
        if "://" not in target:
            assert (REPO / target).exists(), f"README links to a missing file: {target}"
    assert sorted(p.name for p in DOCS.glob("*.md")) == sorted(p.name for p in generated_docs()), \
        "docs/ holds a page no generator writes (an untested copy?)"


def test_readme_flags_exist():
    known = set(OTHER_FLAGS)
    from torch.distributed.run import get_args_parser  # torchrun's own (the multi-node launch)

    for parser in (megatron_parser(), preprocess_parser(), get_args_parser()):
        known.update(o for action in parser._actions for o in action.option_strings)
    known.update(f"--{group}.{name}" for group, name, *_ in field_help())
    used = set(re.findall(r"(?<![\w-])--[a-z][\w.-]*[a-z_]", readme()))
    assert used - known == set(), f"the README names flags the code does not know: {sorted(used - known)}"


def test_readme_yaml_example_validates(tmp_path):
    """The README's native YAML passes validation as it is (what `pretrain_fsdp2.py FILE --dry-run` does)."""
    blocks = re.findall(r"```yaml\n(.*?)```", readme(), re.S)
    assert len(blocks) == 1
    path = tmp_path / "pt.yaml"
    path.write_text(blocks[0], encoding="utf-8")
    config, _ = parse_command_line([str(path)], world_size=None)
    assert config.training.stage == "pt" and config.data.data_manager_type == "mg"
