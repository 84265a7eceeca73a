"""Batch captioning on a Ray cluster: a pool of actors, each with its own engine, captions blocks
of inputs into one JSONL shard per block; a rerun captions only what no shard has yet.

    from mm_engine.ray import caption_on_ray
    summary = caption_on_ray(["/data/photos"], "/data/captions", model="path/to/model", num_workers=8)

The driver lists the inputs (as `mm-engine caption` does), drops the ids any shard in `out_dir`
already holds, and cuts the rest into blocks of `block_size`, each with a shard file of its own
(`part-00012.jsonl`, numbered after the existing ones). An actor writes a block's records as they
finish, flushed one by one, so a worker killed mid-block leaves a shard of whole lines (a cut
last line is dropped when it is read again). A block whose actor dies goes to a fresh actor (up to
`max_worker_restarts` in all), which skips the ids the shard already has; without a restart left,
the block stays for the next run. So every input ends up in exactly one line across the shards,
however often the job is killed and rerun.

Needs Ray (`pip install 'mm-engine[ray]'`). `ray.init()` is called when no cluster is joined yet.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mm_engine.jobs.caption import DEFAULT_MAX_TOKENS, DEFAULT_PROMPT
from mm_engine.jobs.caption_inputs import CaptionInput, discover, read_done_ids

_SHARD = re.compile(r"^part-(\d+)\.jsonl$")


@dataclass(slots=True)
class RaySummary:
    total: int  # inputs listed
    already_done: int  # found in the shards before this run
    captioned: int = 0  # lines written by this run (errors included)
    failed: int = 0  # of those, inputs that could not be captioned (a bad image, say)
    blocks: int = 0
    unfinished_blocks: list[str] = field(default_factory=list)  # shards to complete on a rerun
    worker_restarts: int = 0
    seconds: float = 0.0

    @property
    def images_per_second(self) -> float:
        return self.captioned / self.seconds if self.seconds else 0.0

    @property
    def complete(self) -> bool:
        return not self.unfinished_blocks


class CaptionWorker:
    """One engine in a Ray actor: captions a block into its shard, skipping ids it already has."""

    def __init__(self, model: str | None, prompt: str, sampling: dict, engine_args: dict) -> None:
        from mm_engine import LLM, SamplingParams
        from mm_engine.jobs.caption import Captioner

        self.captioner = Captioner(LLM(model, **engine_args), prompt, SamplingParams(**sampling))

    def pid(self) -> int:
        return os.getpid()

    def caption_block(self, shard: str, items: list[tuple[str, str | None, str | None]]) -> dict:
        path = Path(shard)
        done = read_done_ids(path) if path.exists() else set()
        todo = [CaptionInput(i, image, p) for i, image, p in items if i not in done]
        captioned = failed = 0
        with open(path, "a", encoding="utf-8") as f:
            for record in self.captioner.run(todo):
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
                f.flush()  # a kill loses at most the line being written
                captioned += 1
                failed += record.get("error") is not None
        # `resumed`: lines an earlier attempt at this block wrote (its actor died) and this one kept.
        return {"captioned": captioned, "failed": failed, "resumed": len(done)}


def caption_on_ray(
    inputs: Iterable[str],
    out_dir: str | os.PathLike,
    model: str | None = None,
    *,
    prompt: str = DEFAULT_PROMPT,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    temperature: float = 0.0,
    num_workers: int = 2,
    block_size: int = 256,
    num_cpus_per_worker: float = 1,
    num_gpus_per_worker: float = 0,
    engine_args: dict[str, Any] | None = None,
    max_worker_restarts: int = 3,
    progress: Callable[[dict], None] | None = None,
) -> RaySummary:
    """Caption every image named by `inputs` (folders, files, manifests) into `out_dir`'s shards.
    `progress(report)` is called after each block with the done/total counts, images/s, blocks
    left and worker restarts; by default a line goes to stderr."""
    try:
        import ray
    except ImportError:
        raise ImportError("caption_on_ray needs Ray: pip install 'mm-engine[ray]'") from None
    if num_workers < 1 or block_size < 1:
        raise ValueError("num_workers and block_size must be at least 1")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    listed = discover(inputs)
    done = _done_ids(out)
    todo = [inp for inp in listed if inp.id not in done]
    summary = RaySummary(total=len(listed), already_done=len(listed) - len(todo))
    first = _next_shard_index(out)
    blocks = [
        (
            str(out / f"part-{first + k:05d}.jsonl"),
            [(i.id, i.image, i.path) for i in todo[s : s + block_size]],
        )
        for k, s in enumerate(range(0, len(todo), block_size))
    ]
    summary.blocks = len(blocks)
    if not blocks:
        return summary
    if not ray.is_initialized():
        ray.init()
    actor_cls = ray.remote(num_cpus=num_cpus_per_worker, num_gpus=num_gpus_per_worker)(CaptionWorker)
    sampling = {"max_tokens": max_tokens, "temperature": temperature}

    def start() -> Any:
        return actor_cls.remote(model, prompt, sampling, engine_args or {})

    report = progress or _print_progress
    started = time.perf_counter()
    queue = list(reversed(blocks))  # popped from the end: in order
    idle = [start() for _ in range(min(num_workers, len(blocks)))]
    running: dict[Any, tuple[Any, tuple[str, list]]] = {}  # future -> (actor, block)
    restarts = 0
    while queue or running:
        while idle and queue:
            actor, block = idle.pop(), queue.pop()
            running[actor.caption_block.remote(*block)] = (actor, block)
        ready, _ = ray.wait(list(running), num_returns=1)
        actor, block = running.pop(ready[0])
        try:
            result = ray.get(ready[0])
        except (ray.exceptions.RayActorError, ray.exceptions.WorkerCrashedError):
            ray.kill(actor)
            if restarts < max_worker_restarts:  # a fresh engine takes the block from where it stopped
                restarts += 1
                idle.append(start())
                queue.append(block)
            else:
                summary.unfinished_blocks.append(block[0])
            continue
        idle.append(actor)
        summary.captioned += result["captioned"] + result["resumed"]
        summary.failed += result["failed"]
        elapsed = time.perf_counter() - started
        report({
            "done": summary.already_done + summary.captioned, "total": summary.total,
            "images_per_second": summary.captioned / elapsed if elapsed else 0.0,
            "blocks_left": len(queue) + len(running), "worker_restarts": restarts,
        })  # fmt: skip
    for actor in idle:
        ray.kill(actor)
    # Lines a worker wrote before it died, in a block left for the rerun, count with this run's.
    summary.captioned = len(_done_ids(out)) - summary.already_done
    summary.worker_restarts = restarts
    summary.seconds = time.perf_counter() - started
    return summary


def _done_ids(out: Path) -> set[str]:
    done: set[str] = set()
    for shard in sorted(out.glob("part-*.jsonl")):
        done |= read_done_ids(shard)
    return done


def _next_shard_index(out: Path) -> int:
    taken = [int(m.group(1)) for p in out.iterdir() if (m := _SHARD.match(p.name))]
    return max(taken, default=-1) + 1


def _print_progress(report: dict) -> None:
    print(
        f"{report['done']}/{report['total']} images, {report['images_per_second']:.1f} images/s, "
        f"{report['blocks_left']} blocks left",
        file=sys.stderr,
        flush=True,
    )
