"""Imports go one way: nothing below the package root's public surface imports it back, the
kernels import nothing above them, and importing a low-level module loads only what it needs."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PUBLIC = ("mm_engine.llm", "mm_engine.async_llm", "mm_engine.cli", "mm_engine.ray", "mm_engine.api")
BELOW = ["core", "models", "vision", "kernels", "pools", "sched", "parallel",
         "mm_engine/frontend", "mm_engine/engine", "mm_engine/testing", "mm_engine/demo"]  # fmt: skip
ABOVE_KERNELS = tuple(
    f"mm_engine.{name}"
    for name in ("core", "models", "pools", "sched", "vision", "parallel", "frontend", "engine")
)


def imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names += (
                [node.module] if node.module != "mm_engine" else [f"mm_engine.{a.name}" for a in node.names]
            )
    return names


def under(folder: str) -> list[Path]:
    return sorted((ROOT / folder).rglob("*.py"))


@pytest.mark.parametrize("folder", BELOW)
def test_nothing_below_the_public_surface_imports_it(folder):
    bad = [
        f"{p.relative_to(ROOT)} imports {name}"
        for p in under(folder)
        for name in imports(p)
        if name.startswith(PUBLIC)
        or name in ("mm_engine.LLM", "mm_engine.AsyncLLM", "mm_engine.SamplingParams")
    ]
    assert not bad, bad


def test_the_kernels_import_nothing_above_them():
    bad = [
        f"{p.relative_to(ROOT)} imports {n}"
        for p in under("kernels")
        for n in imports(p)
        if n.startswith(ABOVE_KERNELS)
    ]
    assert not bad, bad


def test_the_package_root_holds_at_most_twelve_modules():
    assert len(list((ROOT / "mm_engine").glob("*.py"))) <= 12


@pytest.mark.subprocess
def test_importing_the_scheduler_loads_neither_transformers_nor_the_engine():
    code = (
        "import sys, mm_engine.sched.scheduler\n"
        "loaded = [m for m in sys.modules if m == 'transformers' or m.startswith(('mm_engine.core', "
        "'mm_engine.engine', 'mm_engine.frontend', 'mm_engine.models', 'mm_engine.llm', 'mm_engine.api'))]\n"
        "print(','.join(loaded))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == ""
