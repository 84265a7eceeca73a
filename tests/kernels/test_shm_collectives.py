"""The shared-memory collectives of CPU tensor parallelism (parallel/shm_collectives.py), with two
ranks as two threads over one file: all-reduce, all-gather and broadcast give every rank the same
result, calls in a row never read each other's slots, and a peer that is gone is an error, not a
wait."""

from __future__ import annotations

import sys
import threading

import pytest
import torch

from mm_engine.parallel.group import ParallelError
from mm_engine.parallel.shm_collectives import ShmCollectives, supported

pytestmark = pytest.mark.skipif(not supported(), reason="the shared-memory collectives are x86 only")


def _pair(tmp_path, alive=lambda: True):
    path = str(tmp_path / "shm")
    first = ShmCollectives(path, 0, 2, True, alive, timeout_s=30)
    return first, ShmCollectives(path, 1, 2, False, alive, timeout_s=30)


def test_two_ranks_reduce_gather_and_broadcast_alike(tmp_path):
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # the spinning rank hands the GIL over quickly
    try:
        ranks = _pair(tmp_path)
        results: dict[int, list] = {0: [], 1: []}

        def run(rank: int) -> None:
            shm = ranks[rank]
            for i in range(20):  # many calls in a row: both slot sets reused
                x = torch.full((3, 5), float(rank + 1) * (i + 1))
                shm.all_reduce(x)
                results[rank].append(x.clone())
            results[rank].append(torch.cat(shm.all_gather(torch.full((2,), float(rank))), dim=0))
            b = torch.arange(6.0) if rank == 0 else torch.zeros(6)
            shm.broadcast(b)
            results[rank].append(b)

        threads = [threading.Thread(target=run, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert all(not t.is_alive() for t in threads)
        for i in range(20):
            assert torch.equal(results[0][i], torch.full((3, 5), 3.0 * (i + 1)))
            assert torch.equal(results[1][i], results[0][i])
        assert results[0][20].tolist() == results[1][20].tolist() == [0.0, 0.0, 1.0, 1.0]
        assert results[0][21].tolist() == results[1][21].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0, 5.0]
    finally:
        sys.setswitchinterval(old)


def test_a_peer_that_is_gone_is_an_error(tmp_path):
    first, _ = _pair(tmp_path, alive=lambda: False)
    with pytest.raises(ParallelError, match="peer is gone"):
        first.all_reduce(torch.ones(4))  # rank 1 never comes
