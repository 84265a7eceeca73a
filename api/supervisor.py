"""`mm-engine serve --api-server-count N`: N API-server processes on one port, sharing the cores.

    supervisor ── listening socket (inherited) ──> N API servers (api/frontend_worker.py)
               ── starts, watches, restarts ────> D engine cores (--data-parallel-size)
    API server j <── ZMQ pair per core ──> core i       (outputs go back to the server that sent)

Each API server parses, decodes images, tokenizes, detokenizes and streams for the connections it
accepts, and talks to every core over a socket pair of its own; a core sends each request's
outputs to the server it came from, and its stats to all. The supervisor binds the port once and
starts the cores, then the servers; it restarts a core that dies (at most --max-core-restarts
times: the servers fail that core's requests, answer 503 while none is up, and take the new core
when it says it is ready), and stops everything with exit code 1 when a server dies, or a core
dies for good. SIGTERM and Ctrl-C are passed on: the servers drain, then the cores stop.
Metrics add up over the servers through prometheus-client's multiprocess mode.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from mm_engine.cli import engine_kwargs
from mm_engine.config import EngineConfig
from mm_engine.core.process import StartUp
from mm_engine.engine.process_client import core_config, spawn_core
from mm_engine.frontend.frontend import Frontend
from mm_engine.models.loader import load_config, resolve_model_path

POLL_S = 0.2


def core_addresses(run_dir: str, core: int, servers: int) -> tuple[list[str], list[str]]:
    """The socket pair of each API server with one core: (server -> core, core -> server)."""
    ins = [f"ipc://{run_dir}/c{core}-s{j}-in" for j in range(servers)]
    outs = [f"ipc://{run_dir}/c{core}-s{j}-out" for j in range(servers)]
    return ins, outs


def listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


class Supervisor:
    def __init__(self, args: argparse.Namespace, banner: str) -> None:
        self.args, self.banner = args, banner
        self.servers_n, self.cores_n = args.api_server_count, args.data_parallel_size
        config = EngineConfig.from_kwargs(args.model, **engine_kwargs(args))
        path = resolve_model_path(config.model)
        # The per-image token cap depends on the family's processing: the frontend's to resolve.
        self.max_image_tokens = Frontend(config, path, load_config(path)).max_image_tokens
        self.config = dataclasses.replace(config, model=str(path))
        self.run_dir = tempfile.mkdtemp(prefix="mm-engine-serve-")
        self.metrics_dir = Path(self.run_dir) / "metrics"
        self.metrics_dir.mkdir()
        self.sock = listen(args.host, args.port)
        self.cores: list[subprocess.Popen] = []
        self.servers: list[subprocess.Popen] = []
        self.restarts = [0] * self.cores_n
        self.stopping = False

    def _start_core(self, i: int) -> subprocess.Popen:
        ins, outs = core_addresses(self.run_dir, i, self.servers_n)
        return spawn_core(
            StartUp(core_config(self.config, i, self.cores_n), self.max_image_tokens, ins, outs)
        )

    def _start_server(self, j: int) -> subprocess.Popen:
        fd = self.sock.fileno()
        cores = [[ins[j], outs[j]] for ins, outs in (core_addresses(self.run_dir, i, self.servers_n)
                                                     for i in range(self.cores_n))]  # fmt: skip
        job = {
            "args": {k: v for k, v in vars(self.args).items() if k != "func"},
            "index": j, "fd": fd, "cores": cores, "ready_file": f"{self.run_dir}/server{j}.ready",
        }  # fmt: skip
        env = os.environ | {"PROMETHEUS_MULTIPROC_DIR": str(self.metrics_dir)}
        proc = subprocess.Popen(
            [sys.executable, "-m", "mm_engine.api.frontend_worker"], stdin=subprocess.PIPE, env=env,
            pass_fds=[fd],
        )  # fmt: skip
        proc.stdin.write(json.dumps(job).encode())
        proc.stdin.close()
        return proc

    def run(self) -> int:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)
        try:
            self.cores = [self._start_core(i) for i in range(self.cores_n)]
            self.servers = [self._start_server(j) for j in range(self.servers_n)]
            code = self._wait_ready()
            if code is not None:
                return code
            host, port = self.sock.getsockname()[:2]
            print(f"{self.banner} on http://{host}:{port} ({self.servers_n} API servers)", flush=True)
            return self._watch()
        finally:
            self._stop_all()

    def _wait_ready(self) -> int | None:
        """None once every server (each waits for every core) is ready; else the exit code."""
        ready = [Path(f"{self.run_dir}/server{j}.ready") for j in range(self.servers_n)]
        while not all(p.exists() for p in ready):
            if self.stopping:
                return 0
            if any(p.poll() is not None for p in [*self.cores, *self.servers]):
                print("mm-engine serve: error: a process exited while the server started", file=sys.stderr)
                return 1
            time.sleep(POLL_S)
        return None

    def _watch(self) -> int:
        while True:
            if self.stopping:
                return self._drain()
            for j, proc in enumerate(self.servers):
                if proc.poll() is not None:
                    print(f"mm-engine serve: API server {j} exited (code {proc.returncode})", file=sys.stderr)
                    return 1
            for i, proc in enumerate(self.cores):
                if proc.poll() is None:
                    continue
                if not self.args.engine_core_restart or self.restarts[i] >= self.args.max_core_restarts:
                    code = proc.returncode
                    print(f"mm-engine serve: engine core {i} exited (code {code})", file=sys.stderr)
                    return 1
                self.restarts[i] += 1
                self.cores[i] = self._start_core(i)  # the servers take it when it says Ready
            time.sleep(POLL_S)

    def _on_signal(self, sig: int, frame) -> None:
        if self.stopping:  # a second signal: stop at once
            for proc in self.servers:
                _signal(proc, signal.SIGKILL)
            raise SystemExit(1)
        self.stopping = True

    def _drain(self) -> int:
        """Let the servers drain (they got SIGTERM) and exit; then the cores go."""
        for proc in self.servers:
            _signal(proc, signal.SIGTERM)
        deadline = time.monotonic() + self.args.shutdown_timeout + 15
        codes = [_wait(proc, deadline) for proc in self.servers]
        for j, code in enumerate(codes):
            if code != 0:
                print(f"mm-engine serve: API server {j} exited (code {code}) while draining", file=sys.stderr)
        return 0 if all(c == 0 for c in codes) else 1

    def _stop_all(self) -> None:
        for proc in self.servers:
            _signal(proc, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in self.servers:
            _wait(proc, deadline)
        for proc in self.cores:
            _signal(proc, signal.SIGTERM)
        for proc in self.cores:
            _wait(proc, time.monotonic() + 10)
        self.sock.close()
        shutil.rmtree(self.run_dir, ignore_errors=True)


def _signal(proc: subprocess.Popen, sig: int) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)


def _wait(proc: subprocess.Popen, deadline: float) -> int:
    try:
        return proc.wait(max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.wait()


def run_api_servers(args: argparse.Namespace, banner: str) -> int:
    if args.engine_core != "process":
        raise ValueError("--api-server-count needs --engine-core process")
    return Supervisor(args, banner).run()
