"""`POST /v1/completions`, `/tokenize` and `/detokenize` through the official `openai` client
(and plain HTTP where the client has no method): answers equal the offline engine's, streamed and
not, for strings, token ids and batches; logprobs in the legacy shape; bad input is a 400."""

from __future__ import annotations

import pytest

from helpers.api import served_in_process
from mm_engine import LLM, SamplingParams

KW = dict(kv_cache_memory_bytes=8 * 1024**2)
PROMPTS = ["USER: what is red ASSISTANT:", "USER: describe the circle ASSISTANT:"]


@pytest.fixture(scope="module")
def served(clip_llama):
    with served_in_process(clip_llama, **KW) as (client, http):
        yield client, http


@pytest.fixture(scope="module")
def offline(clip_llama):
    return LLM(clip_llama, **KW)


def test_strings_token_ids_and_batches_equal_the_offline_engine(served, offline):
    client, _ = served
    params = SamplingParams(temperature=0, max_tokens=6)
    want = [o.outputs[0].text for o in offline.generate(PROMPTS, params)]
    one = client.completions.create(model="m", prompt=PROMPTS[0], max_tokens=6, temperature=0)
    assert one.object == "text_completion" and one.choices[0].text == want[0]
    both = client.completions.create(model="m", prompt=PROMPTS, max_tokens=6, temperature=0)
    assert [c.index for c in both.choices] == [0, 1] and [c.text for c in both.choices] == want
    assert both.usage.completion_tokens == sum(
        len(o.outputs[0].token_ids) for o in offline.generate(PROMPTS, params)
    )
    ids = offline.generate(PROMPTS[1], params)[0].prompt_token_ids
    by_ids = client.completions.create(model="m", prompt=ids, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == want[1]
    batch_ids = client.completions.create(model="m", prompt=[ids, ids], max_tokens=6, temperature=0)
    assert [c.text for c in batch_ids.choices] == [want[1], want[1]]


def test_streaming_with_usage_echo_and_penalties(served, offline):
    client, _ = served
    params = SamplingParams(temperature=0, max_tokens=8, frequency_penalty=1.0, seed=1)
    want = [o.outputs[0].text for o in offline.generate(PROMPTS, params)]
    chunks = list(client.completions.create(
        model="m", prompt=PROMPTS, max_tokens=8, temperature=0, frequency_penalty=1.0, stream=True,
        stream_options={"include_usage": True},
    ))  # fmt: skip
    texts = ["", ""]
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == want
    assert chunks[-1].choices == [] and chunks[-1].usage.prompt_tokens > 0
    echoed = client.completions.create(model="m", prompt=PROMPTS[0], max_tokens=8, temperature=0,
                                       frequency_penalty=1.0, echo=True)  # fmt: skip
    assert echoed.choices[0].text == PROMPTS[0] + want[0]


def test_legacy_logprobs(served, offline):
    client, _ = served
    out = offline.generate(
        PROMPTS[0], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=3)
    )
    c = out[0].outputs[0]
    got = client.completions.create(model="m", prompt=PROMPTS[0], max_tokens=5, temperature=0, logprobs=3,
                                    extra_body={"ignore_eos": True}).choices[0]  # fmt: skip
    lp = got.logprobs
    assert lp.token_logprobs == pytest.approx(
        [e[t].logprob for t, e in zip(c.token_ids, c.logprobs, strict=True)]
    )
    assert lp.tokens == [e[t].decoded_token for t, e in zip(c.token_ids, c.logprobs, strict=True)]
    assert all(len(top) == 3 for top in lp.top_logprobs)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for token, offset in zip(lp.tokens, lp.text_offset, strict=True):
        assert got.text[offset:].lstrip().startswith(token)
    streamed = [ch.choices[0].logprobs for ch in client.completions.create(
        model="m", prompt=PROMPTS[0], max_tokens=5, temperature=0, logprobs=3, stream=True,
        extra_body={"ignore_eos": True}) if ch.choices and ch.choices[0].logprobs]  # fmt: skip
    assert [t for s in streamed for t in s.tokens] == lp.tokens


def test_tokenize_and_detokenize(served, offline):
    _, http = served
    ids = offline.generate(PROMPTS[0], SamplingParams(max_tokens=1))[0].prompt_token_ids
    r = http.post("/tokenize", json={"model": "m", "prompt": PROMPTS[0], "return_token_strs": True}).json()
    assert r["tokens"] == ids and r["count"] == len(ids) and len(r["token_strs"]) == len(ids)
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "what is red"}]}).json()
    want = offline.engine.inputs.chat([{"role": "user", "content": "what is red"}])[1]
    assert chat["tokens"] == want
    back = http.post("/detokenize", json={"model": "m", "tokens": r["tokens"]}).json()
    assert back["prompt"] == offline.tokenizer.decode(ids)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", {"prompt": [[1, 2], "x"]}, "prompt"),
        ("/v1/completions", {"prompt": "x", "n": 0}, "n"),
        ("/v1/completions", {"prompt": "x", "suffix": "y"}, "suffix"),
        ("/v1/completions", {"prompt": "x", "best_of": 3}, "best_of"),
        ("/v1/completions", {"prompt": "x", "echo": True, "logprobs": 1}, "echo"),
        ("/v1/completions", {"prompt": [10**8]}, "prompt"),
        ("/tokenize", {"prompt": "x", "messages": [{"role": "user", "content": "hi"}]}, "prompt"),
        ("/detokenize", {"tokens": [10**8]}, "tokens"),
    ],
)
def test_bad_input_is_a_400_naming_it(served, path, body, param):
    _, http = served
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
