"""Command-line tools run as scripts (`python tools/NAME.py`); importable for the tests and the demo."""
