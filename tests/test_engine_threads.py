"""No tokenizer object is ever entered by two threads: input workers tokenize long prompts while
the engine thread detokenizes streams (transformers' fast tokenizers fail with "Already borrowed"
when two threads meet inside one)."""

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
