"""Rank 0's side of tensor parallelism: it starts the worker processes, joins their group, tells
them the KV block count, hands them every forward's inputs and stops them at the end.

A worker that exits or a collective that fails leaves the group unusable: that is a
`ParallelError` (reported as a device fault, so the engine stops and says why, and nothing
hangs: a dead peer breaks the collective at once, a stuck one within COLLECTIVE_TIMEOUT).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable
from typing import BinaryIO

import torch

from mm_engine.config import EngineConfig
from mm_engine.core.step_inputs import StepInputs
from mm_engine.parallel.group import COLLECTIVE_TIMEOUT, ParallelError, TPGroup, destroy_group, init_group
from mm_engine.parallel.ranks import WorkerStart, rank_device, rank_threads
from mm_engine.parallel.step_wire import Blocks, Start, Stop, SwapDrop, SwapIn, SwapOut, send_step, write


class TensorParallel:
    def __init__(self, config: EngineConfig) -> None:
        self.world = config.tensor_parallel_size
        self.device = rank_device(config, 0)
        last = rank_device(config, self.world - 1)
        if last.type == "cuda" and last.index >= torch.cuda.device_count():
            found = torch.cuda.device_count()
            raise ValueError(f"tensor-parallel rank {self.world - 1} needs GPU {last.index}; {found} found")
        port = _free_port()
        threads = rank_threads(config)
        self._procs = [_spawn() for _ in range(1, self.world)]
        weakref.finalize(self, _kill, self._procs)  # an engine collected unclosed leaves no worker
        self._closed = False
        # A forward's or an encode's messages and collectives, as one unit: no other's interleave
        # (the thread launcher runs forwards beside the host, which encodes; parallel/vision_dp.py).
        self.turn = threading.Lock()
        try:
            for rank, proc in enumerate(self._procs, start=1):
                write(proc.stdin, Start(WorkerStart(config, rank, self.world, port, threads)))
            self.group = self._join(port)
        except BaseException:
            _kill(self._procs)
            raise

    def _join(self, port: int) -> TPGroup:
        """Rank 0 into the group, watching the workers: one that exits while the others wait is
        an error at once, not a wait for the rendezvous to time out."""
        result: dict[str, object] = {}

        def join() -> None:
            try:
                result["group"] = init_group(0, self.world, port, self.device, self._workers_alive)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller's thread
                result["error"] = exc

        t = threading.Thread(target=join, name="mm-tp-join", daemon=True)
        t.start()
        deadline = time.monotonic() + COLLECTIVE_TIMEOUT.total_seconds()
        while t.is_alive():
            t.join(0.1)
            self._check_workers()
            if time.monotonic() > deadline:
                raise ParallelError("the tensor-parallel workers did not join in time")
        if "error" in result:
            raise ParallelError(f"tensor-parallel group failed to start: {result['error']}")
        return result["group"]  # type: ignore[return-value]

    def share_num_blocks(self, num_blocks: int, state_slots: int = 0, state_snapshots: int = 0) -> None:
        """The pools' sizes (pools/setup.py's `on_count`): every rank holds its heads of them."""
        msg = Blocks(num_blocks, state_slots, state_snapshots)
        self._tell(lambda pipes: [write(p, msg) for p in pipes])

    def send(self, inputs: StepInputs, prev_tokens: torch.Tensor | None = None) -> None:
        """Before rank 0's forward: the workers get the same inputs and run theirs alongside."""
        self._tell(lambda pipes: send_step(pipes, inputs, self.group, prev_tokens))

    # Swap preemption (pools/swap.py's SwapMirror): each worker repeats rank 0's swaps on its heads.
    def swap_out(self, request_id: str, blocks: list[int], state_slot: int | None = None) -> None:
        self._tell(lambda pipes: [write(p, SwapOut(request_id, blocks, state_slot)) for p in pipes])

    def swap_in(self, request_id: str, blocks: list[int], state_slot: int | None = None) -> None:
        self._tell(lambda pipes: [write(p, SwapIn(request_id, blocks, state_slot)) for p in pipes])

    def drop(self, request_id: str) -> None:
        self._tell(lambda pipes: [write(p, SwapDrop(request_id)) for p in pipes])

    def tell(self, rank: int, fn: Callable[[BinaryIO], None]) -> None:
        """`fn(pipe)` with worker `rank`'s pipe (its share of a step's images)."""
        self._tell(lambda pipes: fn(pipes[rank - 1]))

    def _tell(self, fn: Callable[[list[BinaryIO]], object]) -> None:
        self._check_workers()
        try:
            fn([p.stdin for p in self._procs])
        except (BrokenPipeError, OSError) as exc:
            self._check_workers()
            raise ParallelError(f"a tensor-parallel worker is gone ({type(exc).__name__})") from None

    def _workers_alive(self) -> bool:
        return all(p.poll() is None for p in self._procs)

    def _check_workers(self) -> None:
        for rank, proc in enumerate(self._procs, start=1):
            code = proc.poll()
            if code is not None:
                raise ParallelError(f"tensor-parallel worker rank {rank} exited with code {code}")

    def broken(self, exc: BaseException) -> ParallelError:
        """Rank 0 failed between a step's collectives (out of memory in a forward, say): the
        workers wait in one that will never come, and the next step's would pair with it. The
        group cannot go on, so the workers stop now, and the engine with them (a device fault)."""
        _kill(self._procs)
        if isinstance(exc, ParallelError):
            return exc
        return ParallelError(
            f"rank 0 failed in the middle of a tensor-parallel step ({type(exc).__name__}: {exc})"
        )

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for proc in self._procs:
            try:
                write(proc.stdin, Stop())
                proc.stdin.close()
            except OSError:  # gone already
                pass
        try:
            for proc in self._procs:
                proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        finally:
            _kill(self._procs)
            destroy_group()


def _kill(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _spawn() -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "mm_engine.parallel.worker"], stdin=subprocess.PIPE, env=os.environ.copy()
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
