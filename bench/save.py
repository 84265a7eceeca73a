"""Where a benchmark's figures go: one JSON file, its folder made if need be."""

from __future__ import annotations

import json
from pathlib import Path


def save_json(path: Path | str | None, result: object) -> None:
    """Write `result` to `path` as indented JSON; nothing when no path was asked for."""
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
