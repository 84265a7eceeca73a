"""Input work across threads: no tokenizer object is ever entered by two threads (input workers
tokenize long prompts while the engine thread detokenizes streams; transformers' fast tokenizers
fail with "Already borrowed" when two threads meet inside one), and big inputs holding every
heavy worker do not stall a small one."""

from __future__ import annotations

import asyncio
import collections
import threading

from mm_engine import SamplingParams
from mm_engine.async_llm import AsyncLLM


def test_each_thread_tokenizes_with_its_own_tokenizer(clip_llama, monkeypatch):
    llm = AsyncLLM.from_engine_args(clip_llama, kv_cache_memory_bytes=8 * 1024**2, input_workers=2)
    cls = type(llm.engine.tokenizer)
    threads: dict[int, set[str]] = collections.defaultdict(set)  # tokenizer object -> thread names
    for name in ("__call__", "apply_chat_template", "decode", "convert_ids_to_tokens"):
        original = getattr(cls, name)

        def spy(self, *args, _original=original, **kwargs):
            threads[id(self)].add(threading.current_thread().name)
            return _original(self, *args, **kwargs)

        monkeypatch.setattr(cls, name, spy)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    long_text = " ".join(["what is the red square near the circle"] * 30)

    async def one(k: int) -> int:
        messages = [{"role": "user", "content": f"{k} {long_text}"}]
        inputs = await llm.process_chat(messages)
        n = 0
        async for out in llm.generate(inputs, params):
            n = len(out.outputs[0].token_ids)
        return n

    async def scenario():
        try:
            return await asyncio.gather(*(one(k) for k in range(8)))
        finally:
            await llm.shutdown()

    assert asyncio.run(scenario()) == [12] * 8
    used_by = {name for names in threads.values() for name in names}
    assert any(n.startswith("mm-inputs") for n in used_by) and "mm-engine-loop" in used_by
    shared = {obj: names for obj, names in threads.items() if len(names) > 1}
    assert not shared, f"tokenizer objects used by several threads: {shared}"


def test_big_inputs_do_not_stall_small_ones(clip_llama, monkeypatch):
    """Two big prompts hold every input worker (their tokenizing is made to wait); a small one
    is still processed and answered meanwhile."""
    llm = AsyncLLM.from_engine_args(clip_llama, kv_cache_memory_bytes=8 * 1024**2, input_workers=2)
    release = threading.Event()
    started = threading.Semaphore(0)
    chat = llm.engine.inputs.chat

    def slow_for_big(messages, *args, **kwargs):
        if len(messages[0]["content"]) > 100_000:
            started.release()
            release.wait(60)
        return chat(messages, *args, **kwargs)

    monkeypatch.setattr(llm.engine.inputs, "chat", slow_for_big)
    big = [{"role": "user", "content": "what " * 40_000}]
    small = [{"role": "user", "content": "what is the red square"}]

    async def scenario():
        try:
            held = [asyncio.ensure_future(llm.process_chat(big)) for _ in range(2)]
            for _ in range(2):  # both heavy workers are inside the big prompts now
                assert await asyncio.to_thread(started.acquire, True, 60)
            inputs = await asyncio.wait_for(llm.process_chat(small), 30)
            outs = [o async for o in llm.generate(inputs, SamplingParams(max_tokens=3, ignore_eos=True))]
            assert outs[-1].finished and not any(h.done() for h in held)
            release.set()
            await asyncio.gather(*held, return_exceptions=True)
        finally:
            release.set()
            await llm.shutdown()

    asyncio.run(scenario())
