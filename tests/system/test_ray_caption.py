"""Batch captioning on a real local Ray cluster (`ray.init(num_cpus=2)`, two actors with the demo
model): a worker killed mid-run either hands its block to a fresh one, or (with no restart left)
leaves it for the rerun; either way every generated scene ends up captioned in exactly one line
across the shards."""

from __future__ import annotations

import json
import os
import random
import signal
from pathlib import Path

import pytest

from mm_engine.demo import scenes

ray = pytest.importorskip("ray")

from mm_engine.ray import caption_on_ray  # noqa: E402 - after the skip

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

KW = {"kv_cache_memory_bytes": 32 * 1024**2, "max_num_seqs": 8}


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


def _scenes(folder: Path, n: int) -> set[str]:
    folder.mkdir()
    rng = random.Random(7)
    for i in range(n):
        scenes.random_scene(rng).image.save(folder / f"scene{i:03d}.png")
    return {str(folder / f"scene{i:03d}.png") for i in range(n)}  # ids: the paths as listed


def _lines(out: Path) -> list[dict]:
    return [
        json.loads(line)
        for shard in sorted(out.glob("part-*.jsonl"))
        for line in shard.read_text().splitlines()
    ]


def _parent(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def _worker_pids() -> set[int]:
    """Main processes of this test process's caption actors. Ray titles an actor's process after
    its class; the raylet that starts it is a child of the driver, so an actor of this cluster is a
    grandchild of this process. That rules out a process an actor forks (it keeps the title) and
    the actors of another pytest worker's cluster (the module's tests may run side by side, and
    killing the other's actor once left this run whole)."""
    me = os.getpid()
    pids: set[int] = set()
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            titled = b"ray::CaptionWorker" in Path(f"/proc/{pid}/cmdline").read_bytes()
            if titled and _parent(_parent(int(pid))) == me:
                pids.add(int(pid))
        except (OSError, ValueError, IndexError):
            continue  # gone meanwhile
    return pids


def _kill_one_worker(killed: list[int]):
    """A progress callback that SIGKILLs one caption actor's process of this run, once: not one of
    an earlier run's actors, which `ray.kill` ends asynchronously (killing one of those, still
    exiting, once left this run whole and the test failing)."""
    earlier = _worker_pids()

    def progress(report: dict) -> None:
        if killed:
            return
        for pid in sorted(_worker_pids() - earlier):
            os.kill(pid, signal.SIGKILL)
            killed.append(pid)
            return

    return progress


def test_a_killed_worker_and_a_rerun_caption_every_image_once(cluster, tmp_path):
    ids = _scenes(tmp_path / "photos", 16)
    out = tmp_path / "captions"
    killed: list[int] = []
    kill = _kill_one_worker(killed)
    first = caption_on_ray([str(tmp_path / "photos")], out, num_workers=2, block_size=2, max_tokens=8,
                           engine_args=KW, max_worker_restarts=0, progress=kill)  # fmt: skip
    assert killed and not first.complete  # its block (or the next it was given) is left
    assert first.total == 16 and first.captioned < 16
    rerun = caption_on_ray([str(tmp_path / "photos")], out, num_workers=2, block_size=2, max_tokens=8,
                           engine_args=KW)  # fmt: skip
    assert rerun.complete and rerun.already_done == first.captioned
    lines = _lines(out)
    assert sorted(r["id"] for r in lines) == sorted(ids)  # each exactly once
    assert all(r["caption"] and r.get("error") is None for r in lines)
    again = caption_on_ray([str(tmp_path / "photos")], out, engine_args=KW)
    assert again.blocks == 0 and again.already_done == 16  # nothing left to do


def test_a_killed_worker_is_replaced_within_the_run(cluster, tmp_path):
    ids = _scenes(tmp_path / "photos", 12)
    out = tmp_path / "captions"
    killed: list[int] = []
    reports: list[dict] = []

    def progress(report: dict) -> None:
        reports.append(report)
        kill(report)

    kill = _kill_one_worker(killed)
    summary = caption_on_ray([str(tmp_path / "photos")], out, num_workers=2, block_size=2, max_tokens=8,
                             engine_args=KW, progress=progress)  # fmt: skip
    assert killed and summary.complete and summary.worker_restarts >= 1
    assert sorted(r["id"] for r in _lines(out)) == sorted(ids)
    assert reports[-1]["done"] == 12 and reports[-1]["images_per_second"] > 0
