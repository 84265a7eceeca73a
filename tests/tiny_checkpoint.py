"""Tests build their checkpoints with the package's own builder (also used by the benchmarks)."""

from mm_engine.testing import CHAT_TEMPLATE, WORDS, build_checkpoint, build_tokenizer

__all__ = ["CHAT_TEMPLATE", "WORDS", "build_checkpoint", "build_tokenizer"]
