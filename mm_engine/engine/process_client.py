"""Talking to an engine-core process: one PUSH socket to it, one PULL socket from it (ZMQ over
ipc:// sockets in a private temporary folder), msgspec messages both ways.

`CoreProcess` starts its core and owns it; `AttachedCore` talks to a core that someone else (the
supervisor of several API servers, api/supervisor.py) started, restarts and stops. The process is
`python -m mm_engine.core.process` (a fresh interpreter: no fork of a process that holds threads
or a CUDA context), given its settings as JSON on stdin. `send` may be called from any thread;
`recv` from one thread only.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import msgspec
import torch
import zmq

from mm_engine.config import EngineConfig
from mm_engine.core import messages as m
from mm_engine.core.process import StartUp


def core_config(config: EngineConfig, index: int, count: int) -> EngineConfig:
    """The settings of engine core `index` of `count`: its data-parallel rank (with tensor
    parallelism on CUDA, its own GPUs) and, on a CPU, its share of the cores (several processes
    with a thread per core each oversubscribe them)."""
    threads = config.cpu_threads
    ranks = count * config.tensor_parallel_size
    if threads is None and ranks > 1 and config.torch_device().type == "cpu":
        threads = max(1, torch.get_num_threads() // ranks)
    return dataclasses.replace(config, data_parallel_rank=index, cpu_threads=threads)


def start_cores(config: EngineConfig, max_image_tokens: int, n: int) -> list[CoreProcess]:
    """Start `n` core processes at once (each loads the model) and wait for all."""
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        configs = [core_config(config, i, n) for i in range(n)]
        futures = [pool.submit(CoreProcess, c, max_image_tokens) for c in configs]
        clients, errors = [], []
        for f in futures:
            try:
                clients.append(f.result())
            except Exception as exc:
                errors.append(exc)
    if errors:
        for c in clients:
            c.close()
        raise errors[0]
    return clients


def spawn_core(start: StartUp) -> subprocess.Popen:
    """Start an engine-core process with these settings (it connects to the addresses in them)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "mm_engine.core.process"], stdin=subprocess.PIPE, env=os.environ.copy()
    )
    proc.stdin.write(msgspec.json.encode(start))
    proc.stdin.close()
    return proc


class _Link:
    """The frontend's end of one core's socket pair: both bound here, the core connects."""

    def __init__(self, in_addr: str, out_addr: str) -> None:
        self._ctx = zmq.Context()
        self._push, self._pull = self._ctx.socket(zmq.PUSH), self._ctx.socket(zmq.PULL)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.bind(in_addr)
        self._pull.bind(out_addr)
        self._send_lock = threading.Lock()  # the PUSH socket: sends, and closing it
        self._open = True
        self._closed = False

    @property
    def alive(self) -> bool:
        raise NotImplementedError

    def send(self, msg: msgspec.Struct, timeout_s: float | None = None) -> None:
        """Send `msg`; a link whose sockets are closed, or whose core is gone, drops it (as does a
        send that waited `timeout_s`). While no core is connected (it died, not yet noticed) a send
        waits without holding the lock that closing takes: a blocking send there kept a dead core's
        reader thread from closing the link, and the sender and the reader waited on each other
        for good."""
        data = m.encode(msg)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while deadline is None or time.monotonic() < deadline:
            with self._send_lock:
                if not self._open:
                    return
                try:
                    self._push.send(data, zmq.NOBLOCK, copy=False)
                    return
                except zmq.Again:  # no core connected, or its queue is full
                    pass
            if not self.alive:
                return
            time.sleep(0.002)

    def recv(self, timeout_s: float) -> m.FromCore | None:
        """The next message from the core, or None when none came within `timeout_s`."""
        if not self._pull.poll(int(timeout_s * 1000)):
            return None
        return m.decode_from_core(self._pull.recv(copy=False).buffer)

    def _close_sockets(self) -> None:
        with self._send_lock:
            self._open = False
            self._push.close(0)
        self._pull.close(0)
        self._ctx.term()


class CoreProcess(_Link):
    def __init__(self, config: EngineConfig, max_image_tokens: int, startup_timeout: float = 600.0) -> None:
        self._dir = tempfile.mkdtemp(prefix="mm-engine-")
        in_addr, out_addr = f"ipc://{self._dir}/in", f"ipc://{self._dir}/out"
        super().__init__(in_addr, out_addr)
        self._args = (config, max_image_tokens, startup_timeout)
        self.proc = spawn_core(StartUp(dataclasses.replace(config), max_image_tokens, [in_addr], [out_addr]))
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

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def exit_message(self) -> str:
        return f"the engine core process exited (code {self.proc.returncode})"

    def restarted(self) -> CoreProcess:
        """A new core in place of this dead one (closed by now)."""
        return CoreProcess(*self._args)

    def close(self, timeout: float = 10.0) -> None:
        """Ask the core to stop, then make sure it has; free the sockets. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.proc.poll() is None:
            try:
                self.send(m.Shutdown(), timeout)
                self.proc.wait(timeout)
            except (subprocess.TimeoutExpired, zmq.ZMQError):
                self.proc.kill()
                self.proc.wait()
        self._close_sockets()
        shutil.rmtree(self._dir, ignore_errors=True)


class AttachedCore(_Link):
    """A core started by someone else: alive while its process (the pid it said Ready with) is;
    when a new core comes up on the same sockets, it says Ready again, and that is the restart."""

    def __init__(self, in_addr: str, out_addr: str, startup_timeout: float = 600.0) -> None:
        super().__init__(in_addr, out_addr)
        self._timeout = startup_timeout
        self._next: m.Ready | None = None  # a new core's Ready, seen before the old one was missed
        self.ready = self._wait_ready()

    def _wait_ready(self) -> m.Ready:
        deadline = time.monotonic() + self._timeout
        while time.monotonic() < deadline:
            msg = super().recv(0.2)
            if isinstance(msg, m.Ready):
                return msg
            if isinstance(msg, m.Dead):
                raise ValueError(msg.reason)
        raise RuntimeError(f"the engine core did not say it was ready within {self._timeout:g} s")

    def recv(self, timeout_s: float) -> m.FromCore | None:
        msg = super().recv(timeout_s)
        if isinstance(msg, m.Ready) and msg.pid != self.ready.pid:  # ours died and was replaced
            self._next = msg
            return m.Dead("the engine core process exited")
        return msg

    @property
    def alive(self) -> bool:
        if self._next is not None:
            return False
        try:
            os.kill(self.ready.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # alive, under another user
            pass
        return True

    def exit_message(self) -> str:
        return "the engine core process exited"

    def restarted(self) -> AttachedCore:
        """This link again, once the new core (the supervisor's to start) says Ready."""
        self.ready, self._next = self._next or self._wait_ready(), None
        return self

    def close(self, timeout: float = 10.0) -> None:
        """Only the sockets: the core is its supervisor's to stop. Idempotent."""
        if not self._closed:
            self._closed = True
            self._close_sockets()
