"""The batch API's `serve` flags, and where batches live by default (the user's cache)."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from mm_engine.api.settings import ServerSettings

_D = ServerSettings()


def default_batch_dir() -> str:
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(cache) / "mm-engine" / "batches")


def add_batch_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("batch API (/v1/files, /v1/batches)")
    g.add_argument("--batch-dir", default=None,
                   help=f"folder of uploaded files and batches, kept across restarts (default: "
                   f"{default_batch_dir()}); 'none' turns the batch API off")  # fmt: skip
    g.add_argument("--max-batch-file-bytes", type=int, default=_D.max_batch_file_bytes)
    g.add_argument("--max-batch-storage-bytes", type=int, default=_D.max_batch_storage_bytes,
                   help="what the batch folder may hold in all (uploads and results)")  # fmt: skip
    g.add_argument("--batch-priority", type=int, default=_D.batch_priority,
                   help="priority of batch requests (lower first; at or above the engine's "
                   "--background-priority they only fill idle capacity)")  # fmt: skip
    g.add_argument("--batch-max-in-flight", type=int, default=_D.batch_max_in_flight,
                   help="sequences the batch API keeps in the engine at once")  # fmt: skip


def batch_settings(args: argparse.Namespace) -> dict:
    folder = args.batch_dir
    if folder is None:  # the default: a home that cannot hold it turns the API off, not the server
        folder = default_batch_dir()
        try:
            Path(folder).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            logging.getLogger("mm_engine.batch").warning("the batch API is off: %s (give --batch-dir)", exc)
            folder = "none"
    return dict(
        batch_dir=None if folder.lower() == "none" else folder,
        max_batch_file_bytes=args.max_batch_file_bytes,
        max_batch_storage_bytes=args.max_batch_storage_bytes,
        batch_priority=args.batch_priority,
        batch_max_in_flight=args.batch_max_in_flight,
    )
