"""Logprobs: the sampled token's and the top k, from the logits it was drawn from (after the logit
adjustments and temperature), against transformers' logits over the same tokens; the same with
async scheduling; and in OpenAI's shape through the official client, streamed and not."""

from __future__ import annotations

import pytest
import torch

from helpers.api import served_in_process
from helpers.images import make_image
from mm_engine import LLM, SamplingParams

PROMPT = "USER: <image> what is this ASSISTANT:"
KW = dict(kv_cache_memory_bytes=8 * 1024**2)


@torch.inference_mode()
def _reference_logprobs(ref, image, out_ids: list[int], temperature: float) -> torch.Tensor:
    """transformers' log-softmax over each generated position, by teacher forcing: [tokens, vocab]."""
    inputs = ref.processor(text=PROMPT, images=[image], return_tensors="pt")
    n = inputs["input_ids"].shape[1]
    ids = torch.cat([inputs["input_ids"], torch.tensor([out_ids])], dim=1)
    logits = ref.model(
        input_ids=ids, pixel_values=inputs["pixel_values"], attention_mask=torch.ones_like(ids)
    ).logits
    return torch.log_softmax(logits[0, n - 1 : n - 1 + len(out_ids)] / temperature, dim=-1)


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_logprobs_equal_transformers_logits(clip_llama, ref_clip_llama, temperature):
    image = make_image(5)
    params = SamplingParams(temperature=temperature, seed=3, max_tokens=6, ignore_eos=True, logprobs=4)
    out = LLM(clip_llama, **KW).generate({"prompt": PROMPT, "multi_modal_data": {"image": [image]}}, params)
    c = out[0].outputs[0]
    want = _reference_logprobs(ref_clip_llama, image, c.token_ids, temperature or 1.0)
    assert len(c.logprobs) == len(c.token_ids) == 6
    total = 0.0
    for i, (token, entry) in enumerate(zip(c.token_ids, c.logprobs, strict=True)):
        sampled = entry[token]
        assert next(iter(entry)) == token  # the sampled token first
        assert sampled.logprob == pytest.approx(want[i, token].item(), abs=1e-4)
        assert sampled.rank == int((want[i] > want[i, token]).sum()) + 1
        top = sorted(entry.items(), key=lambda kv: kv[1].rank)[:4]
        assert [t for t, _ in top] == want[i].topk(4).indices.tolist()
        assert [lp.rank for _, lp in top] == [1, 2, 3, 4]
        assert all(a[1].logprob >= b[1].logprob for a, b in zip(top, top[1:], strict=False))
        if temperature == 0.0:
            assert sampled.rank == 1
        total += sampled.logprob
    assert c.cumulative_logprob == pytest.approx(total)


def test_logprobs_are_the_same_with_async_scheduling_and_in_deltas(clip_llama):
    prompts = [f"USER: what is {i} ASSISTANT:" for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, logprobs=2)
    plain = [o.outputs[0] for o in LLM(clip_llama, **KW).generate(prompts, params)]
    both = LLM(clip_llama, **KW, async_scheduling=True, async_launch="thread").generate(prompts, params)
    for a, b in zip(plain, [o.outputs[0] for o in both], strict=True):
        assert [list(e) for e in a.logprobs] == [list(e) for e in b.logprobs]
        assert [e[t].logprob for t, e in zip(a.token_ids, a.logprobs, strict=True)] == pytest.approx(
            [e[t].logprob for t, e in zip(b.token_ids, b.logprobs, strict=True)]
        )
    no = LLM(clip_llama, **KW).generate(prompts[0], SamplingParams(max_tokens=3))[0].outputs[0]
    assert no.logprobs is None and no.cumulative_logprob is None


def test_the_openai_client_gets_logprobs_streamed_and_not(clip_llama):
    messages = [{"role": "user", "content": "what is red"}]
    with served_in_process(clip_llama, **KW) as (client, http):
        kw = dict(model="m", messages=messages, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3)
        full = client.chat.completions.create(**kw)
        content = full.choices[0].logprobs.content
        generated = full.usage.completion_tokens
        ended_on_eos = full.choices[0].finish_reason == "stop"
        assert len(content) == generated - ended_on_eos  # the EOS that ended it is not content
        for item in content:
            assert len(item.top_logprobs) == 3
            assert item.token == item.top_logprobs[0].token  # greedy: the best one
            assert item.logprob == pytest.approx(item.top_logprobs[0].logprob)
            assert item.bytes == list(item.token.encode())
            assert (
                item.top_logprobs[0].logprob >= item.top_logprobs[1].logprob >= item.top_logprobs[2].logprob
            )
        streamed = [
            item for chunk in client.chat.completions.create(**kw, stream=True) for choice in chunk.choices
            if choice.logprobs is not None for item in choice.logprobs.content
        ]  # fmt: skip
        assert [(i.token, round(i.logprob, 5)) for i in streamed] == [
            (i.token, round(i.logprob, 5)) for i in content
        ]
        plain = client.chat.completions.create(model="m", messages=messages, max_tokens=3)
        assert plain.choices[0].logprobs is None
        bad = http.post("/v1/chat/completions", json={"messages": messages, "top_logprobs": 2})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "top_logprobs"
        bad = http.post(
            "/v1/chat/completions", json={"messages": messages, "logprobs": True, "top_logprobs": 21}
        )
        assert bad.status_code == 400


@pytest.mark.slow
@pytest.mark.subprocess
def test_logprobs_cross_from_the_core_process(clip_llama):
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=2)
    want = LLM(clip_llama, **KW).generate("USER: hi ASSISTANT:", params)[0].outputs[0]
    mp = LLM(clip_llama, multiprocess=True, **KW)
    try:
        got = mp.generate("USER: hi ASSISTANT:", params)[0].outputs[0]
    finally:
        mp.close()
    assert got.token_ids == want.token_ids
    assert got.cumulative_logprob == pytest.approx(want.cumulative_logprob)
    assert [{t: lp.rank for t, lp in e.items()} for e in got.logprobs] == [
        {t: lp.rank for t, lp in e.items()} for e in want.logprobs
    ]


@pytest.mark.parametrize("mode", [None, "thread"])
def test_prompt_logprobs_equal_transformers(clip_llama, ref_clip_llama, mode):
    image = make_image(6)
    kw = KW if mode is None else dict(KW, async_scheduling=True, async_launch=mode)
    llm = LLM(clip_llama, **kw, max_num_batched_tokens=16)  # the prompt spans chunks
    params = SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2)
    prompt = {"prompt": PROMPT, "multi_modal_data": {"image": [image]}}
    for _ in range(2):  # the second time its prefix is cached, but must not be taken
        out = llm.generate(prompt, params)[0]
    inputs = ref_clip_llama.processor(text=PROMPT, images=[image], return_tensors="pt")
    with torch.inference_mode():
        logits = ref_clip_llama.model(**inputs).logits[0]
    want = torch.log_softmax(logits, dim=-1)
    ids = out.prompt_token_ids
    assert len(out.prompt_logprobs) == len(ids) and out.prompt_logprobs[0] is None
    image_id = llm.engine.inputs.image_token_id
    checked = 0
    for p in range(1, len(ids)):
        entry = out.prompt_logprobs[p]
        if ids[p] == image_id:
            assert entry is None
            continue
        assert next(iter(entry)) == ids[p]
        assert entry[ids[p]].logprob == pytest.approx(want[p - 1, ids[p]].item(), abs=1e-4)
        top = sorted(entry.items(), key=lambda kv: kv[1].rank)[:2]
        assert [t for t, _ in top] == want[p - 1].topk(2).indices.tolist()
        checked += 1
    assert checked >= 4
