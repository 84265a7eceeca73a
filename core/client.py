"""Starts an engine-core process and talks to it: one PUSH socket to it, one PULL socket from it
(ZMQ over ipc:// sockets in a private temporary folder), msgspec messages both ways.

The process is `python -m mm_engine.core.process` (a fresh interpreter: no fork of a process
that holds threads or a CUDA context), given its settings as JSON on stdin. `send` may be called
from any thread; `recv` from one thread only.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import msgspec
import zmq

from mm_engine.config import EngineConfig
from mm_engine.core import messages as m
from mm_engine.core.process import StartUp


class CoreClient:
    def __init__(self, config: EngineConfig, max_image_tokens: int, startup_timeout: float = 600.0) -> None:
        self._dir = tempfile.mkdtemp(prefix="mm-engine-")
        self._ctx = zmq.Context()
        self._push, self._pull = self._ctx.socket(zmq.PUSH), self._ctx.socket(zmq.PULL)
        self._push.setsockopt(zmq.LINGER, 0)
        in_addr, out_addr = f"ipc://{self._dir}/in", f"ipc://{self._dir}/out"
        self._push.bind(in_addr)
        self._pull.bind(out_addr)
        self._send_lock = threading.Lock()
        self._closed = False
        start = StartUp(dataclasses.replace(config), max_image_tokens, in_addr, out_addr)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mm_engine.core.process"], stdin=subprocess.PIPE, env=os.environ.copy()
        )
        self.proc.stdin.write(msgspec.json.encode(start))
        self.proc.stdin.close()
        self.ready = self._wait_ready(startup_timeout)

    def _wait_ready(self, timeout: float) -> m.Ready:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            msg = self.recv(0.2)
            if isinstance(msg, m.Ready):
                return msg
            if isinstance(msg, m.Dead):
                self.close()
                raise ValueError(msg.reason)
            if self.proc.poll() is not None:
                self.close()
                code = self.proc.returncode
                raise RuntimeError(f"the engine core process exited while starting (code {code})")
        self.close()
        raise RuntimeError(f"the engine core process did not start within {timeout:g} s")

    def send(self, msg: msgspec.Struct) -> None:
        data = m.encode(msg)
        with self._send_lock:
            self._push.send(data, copy=False)

    def recv(self, timeout_s: float) -> m.FromCore | None:
        """The next message from the core, or None when none came within `timeout_s`."""
        if not self._pull.poll(int(timeout_s * 1000)):
            return None
        return m.decode_from_core(self._pull.recv(copy=False).buffer)

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self, timeout: float = 10.0) -> None:
        """Ask the core to stop, then make sure it has; free the sockets. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.proc.poll() is None:
            try:
                self.send(m.Shutdown())
                self.proc.wait(timeout)
            except (subprocess.TimeoutExpired, zmq.ZMQError):
                self.proc.kill()
                self.proc.wait()
        self._push.close(0)
        self._pull.close(0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)
