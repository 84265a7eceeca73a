"""Benchmarks: `python -m bench.<name>`, each printing figures measured side by side in one run."""
