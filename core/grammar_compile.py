"""A structured-output spec (`StructuredOutputs.key()`: kind and text) as xgrammar's compiled
grammar: what the engine's grammars (structured_output.py) and the trial process
(grammar_probe.py) both run, with xgrammar's errors turned into a ValueError naming the spec."""

from __future__ import annotations

import json
import re
from typing import Any


def compile_spec(compiler: Any, kind: str, text: str) -> Any:
    """xgrammar's CompiledGrammar of a spec (`StructuredOutputs.key()`); ValueError naming a spec
    it cannot compile, MemoryError when it ran out of memory."""
    import xgrammar as xgr  # imported on first use, as in structured_output.py

    try:
        if kind == "json":
            return compiler.compile_json_schema(text, any_whitespace=False, strict_mode=True)
        if kind == "json_object":  # OpenAI's: a JSON object (the builtin grammar takes any value)
            return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
        if kind == "regex":
            return compiler.compile_regex(text)
        if kind == "choice":
            ebnf = "root ::= " + " | ".join(_ebnf_string(c) for c in json.loads(text))
            return compiler.compile_grammar(xgr.Grammar.from_ebnf(ebnf))
        return compiler.compile_grammar(text)
    except (ValueError, MemoryError):
        raise
    except Exception as exc:  # xgrammar reports bad specs as RuntimeError and the like
        if "bad_alloc" in str(exc):
            raise MemoryError(str(exc)) from None
        raise ValueError(f"structured_outputs.{kind} cannot be compiled: {_first_line(exc)}") from None


def _ebnf_string(s: str) -> str:
    return '"' + s.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


def _first_line(exc: Exception) -> str:
    """The library's message without its log prefix (a time and a source path of its build)."""
    lines = str(exc).strip().splitlines()
    if not lines:
        return type(exc).__name__
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", lines[0])[:300]
