"""The engine core in a process of its own: the same tokens as in-process (images, stop strings,
seeded sampling, preemption), pixels sent once per image, aborts freeing blocks, refusals raised
as in-process, and a core that dies failing its requests, answering 503 while it restarts, and
saying why in the health check."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import pytest
import torch

from helpers.images import make_image
from mm_engine import LLM, SamplingParams
from mm_engine.api.app import create_app
from mm_engine.api.settings import ServerSettings
from mm_engine.core import messages as m
from mm_engine.core import pixels
from mm_engine.engine.async_client import AsyncMPLLM
from mm_engine.engine.async_types import EngineDeadError

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

TIGHT = dict(kv_cache_memory_bytes=16 * 1024 * 20, block_size=8, image_pool_fraction=0.4)  # preempts


def _image(seed: int, text: str = "what is this") -> dict:
    return {"prompt": f"USER: <image> {text} ASSISTANT:", "multi_modal_data": {"image": make_image(seed)}}


PROMPTS = [_image(1), "USER: what is red ASSISTANT:", _image(1, "describe it"), _image(2), _image(1)]
PARAMS = [
    SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=12, stop=["a"]),
    SamplingParams(temperature=1.0, seed=7, max_tokens=16, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop_token_ids=[17]),
    SamplingParams(temperature=0.8, top_k=5, seed=3, max_tokens=18, ignore_eos=True),
]


def test_the_core_process_gives_the_in_process_tokens(clip_llama):
    expected = LLM(clip_llama, **TIGHT).generate(PROMPTS, PARAMS)
    mp = LLM(clip_llama, multiprocess=True, **TIGHT)
    try:
        got = mp.generate(PROMPTS, PARAMS)
        for a, b in zip(expected, got, strict=True):
            assert b.outputs[0].token_ids == a.outputs[0].token_ids
            assert b.outputs[0].text == a.outputs[0].text
            assert (b.outputs[0].finish_reason, b.outputs[0].stop_reason) == (
                a.outputs[0].finish_reason,
                a.outputs[0].stop_reason,
            )
        assert mp.engine.stats()["num_preemptions_total"] > 0  # the pools were tight
        pixels = mp.engine.client.pixels
        # Image 1 is used three times and crosses once; image 2 once: 2 sent, 2 saved.
        assert pixels.saved_bytes == pixels.sent_bytes > 0
        with pytest.raises(ValueError, match="not a token id of this model"):
            mp.generate({"prompt_token_ids": [1, 10**6]}, PARAMS[0])
        report = mp.kv_report()
        assert report["text"]["used_blocks"] == report["image"]["used_blocks"] == 0
    finally:
        mp.close()


def test_the_core_process_with_async_scheduling_gives_the_same_tokens(clip_llama):
    expected = LLM(clip_llama, **TIGHT).generate(PROMPTS, PARAMS)
    mp = LLM(clip_llama, multiprocess=True, async_scheduling=True, async_launch="thread", **TIGHT)
    try:
        got = mp.generate(PROMPTS, PARAMS)
        assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in expected]
        assert [o.outputs[0].finish_reason for o in got] == [o.outputs[0].finish_reason for o in expected]
        report = mp.kv_report()
        assert report["text"]["used_blocks"] == report["image"]["used_blocks"] == 0
    finally:
        mp.close()


def test_a_full_queue_and_an_abort_through_the_core_process(clip_llama):
    kw = dict(max_waiting_requests=1, kv_cache_memory_bytes=4 * 1024**2, max_num_seqs=1)
    # Greedy: which refused request is sent again first depends on timing, and with sampling the
    # engine's random stream would follow that order.
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = ["USER: what ASSISTANT:", "USER: what is red ASSISTANT:", "USER: red ASSISTANT:"]
    expected = [o.outputs[0].token_ids for o in LLM(clip_llama, **kw).generate(prompts, params)]
    mp = LLM(clip_llama, multiprocess=True, **kw)
    try:
        # One seat and one waiting place: the third is refused by the core, kept and sent again.
        assert [o.outputs[0].token_ids for o in mp.generate(prompts, params)] == expected
        engine = mp.engine
        long = SamplingParams(max_tokens=200, ignore_eos=True)
        engine.add_request("USER: what ASSISTANT:", long, request_id="a")
        while not engine.step():  # until "a" runs: it has the one seat
            pass
        engine.add_request("USER: what ASSISTANT:", long, request_id="b")  # the one waiting place
        engine.add_request("USER: what ASSISTANT:", long, request_id="c")  # refused: queue full
        engine.abort("c")  # before its refusal arrives, which must then be ignored
        for _ in range(5):
            engine.step()
        engine.abort("a")
        engine.abort("b")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and mp.kv_report()["text"]["used_blocks"]:
            engine.step()
        assert mp.kv_report()["text"]["used_blocks"] == 0 and not engine.has_unfinished()
    finally:
        mp.close()


def test_a_dead_core_fails_its_requests_is_restarted_and_health_says_why(clip_llama):
    llm = AsyncMPLLM.from_engine_args(clip_llama, kv_cache_memory_bytes=4 * 1024**2, max_restarts=1)
    params = SamplingParams(max_tokens=400, ignore_eos=True)

    async def run(text: str):
        inputs = await llm.process_prompt(f"USER: {text} ASSISTANT:")
        n, last = 0, None
        async for out in llm.generate(inputs, params):
            n, last = n + 1, out
            if n == 2 and text == "doomed":
                llm.client.proc.kill()  # the core dies mid-stream
        return last

    async def scenario():
        try:
            with pytest.raises(EngineDeadError):
                await run("doomed")
            refused = None
            try:
                llm.check_admission()
            except EngineDeadError as exc:
                refused = exc
            for _ in range(600):  # a fresh core starts in a few seconds
                if llm.health().alive:
                    break
                await asyncio.sleep(0.05)
            health = llm.health()
            params.max_tokens = 3
            after = await run("again")
            return refused, health, after
        finally:
            await llm.shutdown()

    refused, health, after = asyncio.run(scenario())
    assert isinstance(refused, EngineDeadError)  # new requests: 503 while it restarts
    assert health.alive and health.faults_total == 1
    assert health.last_error == "the engine core process exited (code -9); restarted (1 of 1)"
    assert after.finished and len(after.outputs[0].token_ids) == 3


def test_without_restart_a_dead_core_stays_dead_and_says_so(clip_llama):
    dead = []
    llm = AsyncMPLLM.from_engine_args(
        clip_llama, kv_cache_memory_bytes=4 * 1024**2, restart=False, on_dead=lambda: dead.append(1)
    )
    llm.client.proc.kill()
    for _ in range(600):
        if dead:
            break
        time.sleep(0.05)
    health = llm.health()
    assert dead == [1] and not health.alive and health.status == "dead"
    assert health.last_error == "the engine core process exited (code -9)"
    with pytest.raises(EngineDeadError):
        llm.check_admission()
    asyncio.run(llm.shutdown())


def test_messages_round_trip_tensors_of_every_dtype():
    for t in (torch.randn(2, 3), torch.randn(4).bfloat16(), torch.tensor([True, False]), torch.empty(0, 3)):
        msg = m.Add(
            "r", [1], [m.ImageMsg(0, 1, "h", 1, pixels=m.TensorMsg.of(t))], SamplingParams(), [], 0, 0.0
        )
        back = m.decode_to_core(m.encode(msg)).images[0].pixels.tensor()
        assert back.dtype == t.dtype and torch.equal(back, t)


def test_two_cores_route_by_load_and_image_and_one_dying_spares_the_other(clip_llama, monkeypatch):
    built_on = set()  # which threads copy pixels into messages: the outbox's, never an event loop
    image_messages = pixels.image_messages
    monkeypatch.setattr(
        pixels,
        "image_messages",
        lambda *a: (built_on.add(threading.current_thread().name), image_messages(*a))[1],
    )
    prompts = [_image(1), _image(1, "describe it"), "USER: what is red ASSISTANT:", _image(2)]
    # Long enough that the first is still running when the others are routed (each core has a
    # CPU core of its own, so a short one could be over before).
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    expected = [o.outputs[0].token_ids for o in LLM(clip_llama, **TIGHT).generate(prompts, params)]
    llm = AsyncMPLLM.from_engine_args(clip_llama, data_parallel_size=2, affinity_slack=4, **TIGHT)

    async def run(prompt, rid):
        inputs = await llm.process_prompt(prompt)
        outs = [out async for out in llm.generate(inputs, params, request_id=rid)]
        return outs[-1].outputs[0].token_ids

    async def scenario():
        try:
            first = asyncio.ensure_future(run(prompts[0], "img1-a"))
            await asyncio.sleep(0)  # the first is routed before the others arrive
            while llm.core_of("img1-a") is None:
                await asyncio.sleep(0.01)
            rest = [asyncio.ensure_future(run(p, f"r{k}")) for k, p in enumerate(prompts[1:], 1)]
            placed = {"img1-a": llm.core_of("img1-a")}
            while len(placed) < 4 and not all(t.done() for t in rest):  # where each went, once routed
                for rid in ("r1", "r2", "r3"):
                    if rid not in placed and llm.core_of(rid) is not None:
                        placed[rid] = llm.core_of(rid)
                await asyncio.sleep(0.001)
            got = await asyncio.gather(first, *rest)
            stats = llm.stats()
            transport = httpx.ASGITransport(app=create_app(llm, ServerSettings(served_model_names=["m"])))
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                metrics = (await client.get("/metrics")).text
            # Core 1 dies: a request on core 0 still runs; new ones go to core 0 meanwhile.
            llm.cores._cores[1].client.proc.kill()
            after = await run(prompts[2], "after")
            return placed, got, stats, after, metrics
        finally:
            await llm.shutdown()

    placed, got, stats, after, metrics = asyncio.run(scenario())
    assert 'mm_engine:core_num_requests_running{core="1"}' in metrics  # per core, and summed
    assert got == expected  # each core computes what one engine does
    assert placed["r1"] == placed["img1-a"]  # the same picture goes where its pixels are
    assert placed["r2"] != placed["img1-a"]  # a text request goes to the less loaded core
    assert len(stats["per_core"]) == 2
    assert stats["num_preemptions_total"] == sum(s["num_preemptions_total"] for s in stats["per_core"])
    assert after == expected[2]
    assert built_on == {"mm-outbox"}


def test_the_core_process_exits_when_its_frontend_is_killed(clip_llama, tmp_path):
    import os
    import signal
    import subprocess
    import sys

    script = tmp_path / "frontend.py"
    script.write_text(
        "import sys, time\n"
        "from mm_engine import LLM, SamplingParams\n"
        f"llm = LLM({clip_llama!r}, multiprocess=True, kv_cache_memory_bytes=4 * 1024**2, max_num_seqs=4)\n"
        "params = SamplingParams(max_tokens=400, ignore_eos=True)\n"
        "for k in range(64):  # minutes of work: the core is busy when its frontend dies\n"
        "    llm.engine.add_request('USER: what ASSISTANT:', params)\n"
        "llm.engine.step()\n"
        "print(llm.engine.client.process.proc.pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    frontend = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    core_pid = int(frontend.stdout.readline())
    frontend.send_signal(signal.SIGKILL)  # no clean-up runs: the core must notice on its own
    frontend.wait(30)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(core_pid, 0)
        except ProcessLookupError:
            return  # gone (reaped by init)
        with open(f"/proc/{core_pid}/stat") as f:
            if f.read().split()[2] == "Z":  # exited, not yet reaped
                return
        time.sleep(0.1)
    os.kill(core_pid, signal.SIGKILL)
    raise AssertionError("the engine-core process outlived its frontend")


def test_each_core_gets_its_rank_and_its_share_of_the_cpu(clip_llama):
    from mm_engine.config import EngineConfig
    from mm_engine.engine.process_client import core_config

    config = EngineConfig(clip_llama, device="cpu")
    one = core_config(config, 0, 1)
    assert one.cpu_threads is None and one.data_parallel_rank == 0  # alone: torch's default
    second = core_config(config, 1, 2)
    assert second.data_parallel_rank == 1 and second.cpu_threads == max(1, torch.get_num_threads() // 2)
    tp = core_config(EngineConfig(clip_llama, device="cpu", tensor_parallel_size=2), 0, 2)
    assert tp.cpu_threads == max(1, torch.get_num_threads() // 4)  # 2 cores x 2 ranks
    assert core_config(EngineConfig(clip_llama, device="cpu", cpu_threads=3), 1, 2).cpu_threads == 3
