"""The server under test for bench.serve: `mm-engine serve` started on 127.0.0.1, waited for, and
stopped (SIGTERM, then harder) whatever happens; its log kept and shown only when it fails."""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx

from bench.vlm import resolve_model


def _log_tail(path: str, n: int = 30) -> str:
    return "".join(Path(path).read_text(errors="replace").splitlines(keepends=True)[-n:])


def _wait_ready(proc: subprocess.Popen, log_path: str, timeout: float) -> str:
    """The base URL once the server printed its port and `/health` answers 200."""
    deadline, url = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"mm-engine serve exited with {proc.returncode} during start-up")
        if url is None:
            match = re.search(r"serving .* on (http://\S+:\d+)", Path(log_path).read_text(errors="replace"))
            url = match.group(1) if match else None
        if url is not None:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    return url
        time.sleep(0.5)
    raise RuntimeError(f"mm-engine serve was not healthy within {timeout:g} s")


def _stop(proc: subprocess.Popen) -> None:
    # The first SIGTERM drains (running requests may finish), a second one exits at once.
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGTERM, 10), (signal.SIGKILL, 10)):
        if proc.poll() is not None:
            return
        proc.send_signal(sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(wait)


@contextlib.contextmanager
def running_server(args: argparse.Namespace) -> Iterator[str]:
    """`mm-engine serve` on 127.0.0.1, its log in a temporary file (kept, and shown, if it fails)."""
    model = resolve_model(args.model)
    cmd = [sys.executable, "-m", "mm_engine.cli", "serve", model, "--host", "127.0.0.1",
           "--port", str(args.port), "--no-access-log", *shlex.split(args.server_args)]  # fmt: skip
    print("starting:", shlex.join(cmd[2:]), flush=True)
    with tempfile.NamedTemporaryFile("w", prefix="mm-engine-serve-", suffix=".log", delete=False) as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        failed = True
        try:
            yield _wait_ready(proc, log.name, args.startup_timeout)
            if proc.poll() is not None:
                raise RuntimeError(f"mm-engine serve exited with {proc.returncode} during the run")
            failed = False
        finally:
            died = proc.poll() is not None
            _stop(proc)
            if failed:
                print(f"server log kept at {log.name}", file=sys.stderr)
                if died:
                    print(_log_tail(log.name), file=sys.stderr)
            else:
                os.unlink(log.name)
