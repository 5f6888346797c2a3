"""The command-line tools, the README and docs, the test helpers."""
