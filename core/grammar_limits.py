"""Bounds on a structured-output spec, checked before anything compiles it.

Compiling a grammar walks the vocabulary for every state of it, so its cost grows with the spec: a
JSON schema of a few thousand optional properties, or an enum of 100,000 values, takes minutes and
gigabytes. These limits refuse such a spec by name, cheaply (one parse of the spec's text), before
it reaches the compiler: its size in bytes, its entries (object properties, enum values, union
branches, choices) and its nesting depth.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class GrammarLimits:
    max_bytes: int = 64 * 1024  # the spec's text (a JSON schema, a regex, a grammar, the choices)
    max_entries: int = 1000  # properties, enum values, anyOf/oneOf/allOf branches, choices
    max_depth: int = 64  # nesting of the JSON value (an object property is two levels: name, schema)

    def check(self, kind: str, text: str) -> None:
        """Raise a ValueError naming the limit `kind`'s spec `text` breaks (see `StructuredOutputs.key`)."""
        size = len(text.encode())
        if size > self.max_bytes:
            raise ValueError(
                f"structured_outputs.{kind} is {size} bytes, more than the limit of {self.max_bytes}"
            )
        if kind not in ("json", "choice"):
            return
        try:
            value = json.loads(text)
        except RecursionError:
            raise ValueError(f"structured_outputs.{kind} is nested more than {self.max_depth} deep") from None
        except ValueError:
            return  # the compiler says what is wrong with it
        entries, depth = _measure(value)
        if kind == "choice":
            entries = len(value) if isinstance(value, list) else entries
        if depth > self.max_depth:
            raise ValueError(f"structured_outputs.{kind} is nested {depth} deep, more than {self.max_depth}")
        if entries > self.max_entries:
            raise ValueError(
                f"structured_outputs.{kind} has {entries} properties, enum values or alternatives, "
                f"more than the limit of {self.max_entries}"
            )


_COUNTED = ("properties", "patternProperties", "$defs", "definitions")
_BRANCHES = ("enum", "anyOf", "oneOf", "allOf", "prefixItems")


def _measure(schema: Any) -> tuple[int, int]:
    """(entries, depth) of a JSON value, without recursion (a deep one must not overflow the stack)."""
    entries, deepest = 0, 0
    todo = [(schema, 1)]
    while todo:
        value, depth = todo.pop()
        deepest = max(deepest, depth)
        if isinstance(value, dict):
            for key in _COUNTED:
                if isinstance(value.get(key), dict):
                    entries += len(value[key])
            for key in _BRANCHES:
                if isinstance(value.get(key), list):
                    entries += len(value[key])
            todo.extend((v, depth + 1) for v in value.values() if isinstance(v, dict | list))
        elif isinstance(value, list):
            todo.extend((v, depth + 1) for v in value if isinstance(v, dict | list))
    return entries, deepest
