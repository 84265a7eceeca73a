"""A step that fails fails only the requests it held; a device fault stops the engine, and
`/health` says so. Each injected by replacing the runner's `execute` for one batch."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from mm_engine import LLM, SamplingParams
from mm_engine.api.app import create_app
from mm_engine.api.settings import ServerSettings
from mm_engine.async_llm import AsyncLLM
from mm_engine.core.faults import StepFailedError, is_device_fault
from mm_engine.engine.async_types import EngineDeadError, EngineStepError

KW = dict(kv_cache_memory_bytes=4 * 1024**2, max_num_seqs=1)  # one request per batch
PARAMS = SamplingParams(max_tokens=5, ignore_eos=True)
PROMPT = "USER: what ASSISTANT:"


def _poison(engine, message: str) -> None:
    """Batches holding request "bad" raise `message` inside the forward."""
    execute = engine.core.runner.execute

    def faulty(batch):
        if any(req.request_id == "bad" for req, _ in batch.items):
            raise RuntimeError(message)
        return execute(batch)

    engine.core.runner.execute = faulty


async def _run(llm: AsyncLLM, rid: str):
    """The request's output ids, or the engine error it ended with."""
    inputs = await llm.process_prompt(PROMPT)
    try:
        async for out in llm.generate(inputs, PARAMS, request_id=rid):
            last = out
        return last.outputs[0].token_ids
    except (EngineStepError, EngineDeadError) as exc:
        return exc


def test_a_failing_step_drops_only_the_requests_it_held(clip_llama):
    expected = LLM(clip_llama, **KW).generate(PROMPT, PARAMS)[0].outputs[0].token_ids
    engine = LLM(clip_llama, **KW).engine
    _poison(engine, "shape mismatch")
    engine.add_request(PROMPT, PARAMS, request_id="bad")
    engine.add_request(PROMPT, PARAMS, request_id="good")  # waits: one seat
    with pytest.raises(StepFailedError) as info:
        engine.step()
    assert info.value.request_ids == ["bad"] and not info.value.device_lost
    assert "bad" not in engine.core.requests and "good" in engine.core.requests
    finals = []
    while engine.has_unfinished():
        finals += [o for o in engine.step() if o.finished]
    assert [o.request_id for o in finals] == ["good"]
    assert finals[0].outputs[0].token_ids == expected
    assert all(pool.num_used == 0 for pool in engine.core.blocks.pools.values())


def test_the_async_engine_fails_the_batch_and_serves_the_rest(clip_llama):
    llm = AsyncLLM.from_engine_args(clip_llama, **KW)
    _poison(llm.engine, "shape mismatch")

    async def scenario():
        try:
            return await asyncio.gather(_run(llm, "bad"), _run(llm, "good"))
        finally:
            await llm.shutdown()

    bad, good = asyncio.run(scenario())
    assert isinstance(bad, EngineStepError) and len(good) == 5
    health = llm.health()
    assert health.faults_total == 1 and health.last_error == "engine step failed (RuntimeError)"


def test_a_device_fault_stops_the_engine_and_health_says_why(clip_llama):
    llm = AsyncLLM.from_engine_args(clip_llama, **KW)
    _poison(llm.engine, "CUDA error: an illegal memory access was encountered")

    async def scenario():
        try:
            failed = await asyncio.gather(_run(llm, "bad"), _run(llm, "good"))
            later = await _run(llm, "later")
            transport = httpx.ASGITransport(app=create_app(llm, ServerSettings(served_model_names=["m"])))
            async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
                health = await client.get("/health")
                chat = await client.post(
                    "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}
                )
            return failed, later, health, chat
        finally:
            await llm.shutdown()

    failed, later, health, chat = asyncio.run(scenario())
    assert all(isinstance(f, EngineDeadError | EngineStepError) for f in failed)
    assert isinstance(later, EngineDeadError)  # nothing runs on a lost device
    assert health.status_code == 503 and health.json()["status"] == "dead"
    assert health.json()["last_error"] == "device fault (RuntimeError); the engine stopped"
    assert chat.status_code == 503 and chat.json()["error"]["code"] == "engine_dead"


def test_which_faults_are_the_devices():
    import torch

    assert is_device_fault(RuntimeError("CUDA error: device-side assert triggered"))
    assert is_device_fault(torch.AcceleratorError("anything"))
    assert not is_device_fault(torch.OutOfMemoryError("CUDA out of memory"))
    assert not is_device_fault(RuntimeError("shape mismatch"))
