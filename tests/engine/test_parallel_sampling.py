"""`n` > 1: a prompt's n samples run as n requests that share its KV blocks through the prefix
cache (its last, partial block by copy; and its image's encoder output), each reproducible from
`seed + i`; offline one output with n choices, over HTTP n choices (streamed by index), usage
counting the prompt once."""

from __future__ import annotations

import pytest

from helpers.api import served_in_process
from helpers.images import make_image
from mm_engine import LLM, SamplingParams

KW = dict(kv_cache_memory_bytes=8 * 1024**2, block_size=8)
PROMPT = {"prompt": "USER: <image> describe the picture in many words ASSISTANT:",
          "multi_modal_data": {"image": [make_image(7)]}}  # fmt: skip


def test_n_samples_share_the_prompt_and_each_is_reproducible(clip_llama):
    llm = LLM(clip_llama, **KW)
    params = SamplingParams(n=4, temperature=0.9, seed=10, max_tokens=8, ignore_eos=True)
    out = llm.generate(PROMPT, params)
    assert len(out) == 1 and [c.index for c in out[0].outputs] == [0, 1, 2, 3]
    one = [SamplingParams(temperature=0.9, seed=10 + i, max_tokens=8, ignore_eos=True) for i in range(4)]
    singles = [llm.generate(PROMPT, p) for p in one]
    assert [c.token_ids for c in out[0].outputs] == [s[0].outputs[0].token_ids for s in singles]
    assert len({tuple(c.token_ids) for c in out[0].outputs}) > 1  # different samples

    fresh = LLM(clip_llama, **KW)
    fresh.generate(PROMPT, params)
    report = fresh.kv_report()
    prompt_blocks, tail = divmod(len(out[0].prompt_token_ids) - 1, KW["block_size"])  # last token: computed
    hits = report["text"]["prefix_cache_hits"] + report["image"]["prefix_cache_hits"]
    assert hits == 3 * prompt_blocks  # every full prompt block computed once, taken by the other three
    assert tail > 0 and report["text"]["partial_block_copies"] == 3  # the partial one copied on write
    assert fresh.engine.core.runner.num_encoded_images == 1
    assert report["text"]["used_blocks"] == report["image"]["used_blocks"] == 0


def test_n_over_http(clip_llama):
    messages = [{"role": "user", "content": "what is red"}]
    with served_in_process(clip_llama, **KW) as (client, http):
        kw = dict(model="m", messages=messages, max_tokens=5, temperature=0.9, seed=3)
        one = client.chat.completions.create(**kw)
        r = client.chat.completions.create(**kw, n=3)
        assert [c.index for c in r.choices] == [0, 1, 2]
        assert r.choices[0].message.content == one.choices[0].message.content  # sample 0 uses the seed
        assert r.usage.prompt_tokens == one.usage.prompt_tokens  # the prompt counts once
        assert r.usage.completion_tokens > one.usage.completion_tokens
        texts = ["", "", ""]
        for chunk in client.chat.completions.create(**kw, n=3, stream=True):
            for c in chunk.choices:
                texts[c.index] += c.delta.content or ""
        assert texts == [c.message.content for c in r.choices]
        two = ["USER: a ASSISTANT:", "USER: b ASSISTANT:"]
        cmpl = client.completions.create(model="m", prompt=two, n=2, max_tokens=4, temperature=0.9, seed=1)
        assert [c.index for c in cmpl.choices] == [0, 1, 2, 3]
        alone = client.completions.create(model="m", prompt=two[1], max_tokens=4, temperature=0.9, seed=2)
        assert cmpl.choices[3].text == alone.choices[0].text  # prompt 1, sample 1: seed + 1


def test_n_is_validated():
    with pytest.raises(ValueError, match="n must be"):
        SamplingParams(n=0)
