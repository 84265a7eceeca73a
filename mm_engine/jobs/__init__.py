"""Batch work on top of `LLM`: the captioning job (inputs, report, CLI) and its Ray runner."""
