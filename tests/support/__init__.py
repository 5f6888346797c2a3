"""Shared test builders (no tests here): what several test modules build the same way, so that no test module
imports another."""
