"""Processor options (`mm_processor_kwargs`) shared by several families, checked the same way."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def positive_option(key: str, value) -> int:
    """A processor option that must be a positive integer."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"mm_processor_kwargs {key} must be a positive integer, got {value!r}")
    return value


def longest_edge(default: int, options: Mapping[str, Any] | None) -> int:
    """The side an image is resized to (Idefics3, SmolVLM, Pixtral): `longest_edge`, or vLLM's
    spelling `size: {"longest_edge": N}`; the only option these processors take here."""
    edge = default
    for key, value in (options or {}).items():
        if key == "size" and isinstance(value, Mapping) and set(value) == {"longest_edge"}:
            value = value["longest_edge"]
        elif key != "longest_edge":
            raise ValueError(
                f"unknown mm_processor_kwargs option {key!r}; supported: longest_edge, "
                "size={'longest_edge': N}"
            )
        edge = positive_option("longest_edge", value)
    return edge
