"""The README's generated tables equal what the code generates now, so they cannot drift."""
from pathlib import Path

from tools.update_readme import updated_readme

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_tables_up_to_date():
    text = README.read_text(encoding="utf-8")
    assert updated_readme(text) == text, "run: python -m tools.update_readme"


def test_readme_gives_the_two_setup_commands():
    text = README.read_text(encoding="utf-8")
    assert "make demo" in text and "make test" in text
