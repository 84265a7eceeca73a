"""Strict parameters: an unknown field is a 400 naming it (never silently ignored), a string is
not a number, logit_bias keys are decimal token ids, inputs that used to be 500s are 400s, one
request cannot start more sequences than the cap, and vLLM's extras that are implemented act."""

from __future__ import annotations

import pytest

from helpers.api import data_url, image_bytes, served_in_process
from mm_engine import LLM, SamplingParams

KW = dict(kv_cache_memory_bytes=8 * 1024**2, max_model_len=256)
CHAT = {"messages": [{"role": "user", "content": "what is red"}], "max_tokens": 4, "temperature": 0}
IMAGE = {"type": "image_url", "image_url": {"url": data_url(image_bytes(1))}}
ODD_IMAGE = {"type": "image_url", "image_url": {"url": "data:", "x": 1}}


@pytest.fixture(scope="module")
def http(clip_llama):
    with served_in_process(clip_llama, **KW) as (_, http):
        yield http


@pytest.fixture(scope="module")
def offline(clip_llama):
    return LLM(clip_llama, **KW)


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {**CHAT, "temprature": 0.5}, "temprature"),
        ("/v1/chat/completions", {**CHAT, "bad_word": ["x"]}, "bad_word"),
        ("/v1/chat/completions", {**CHAT, "functions": []}, "functions"),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "x", "foo": 1}]},
         "messages[0].foo"),
        ("/v1/chat/completions",
         {**CHAT, "messages": [{"role": "user", "content": [ODD_IMAGE]}]},
         "messages[0].content[0].image_url.x"),
        ("/v1/chat/completions", {**CHAT, "stream_options": {"x": 1}}, "stream_options.x"),
        ("/v1/completions", {"prompt": "x", "guided_jsn": {}}, "guided_jsn"),
        ("/tokenize", {"prompt": "x", "add_special_token": False}, "add_special_token"),
        ("/detokenize", {"tokens": [1], "skip": True}, "skip"),
    ],
)  # fmt: skip
def test_an_unknown_parameter_is_a_400_naming_it(http, path, body, param):
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
    assert r.json()["error"]["code"] == "unknown_parameter"


def test_an_unknown_caption_form_field_is_a_400(http):
    r = http.post("/v1/caption", files=[("image", ("a", image_bytes(1)))], data={"max_tokenz": "2"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokenz", r.text


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({**CHAT, "max_tokens": "10"}, "max_tokens"),
        ({**CHAT, "n": 1.0}, "n"),
        ({**CHAT, "temperature": "0"}, "temperature"),
        ({**CHAT, "stream": "false"}, "stream"),
        ({**CHAT, "logit_bias": {"1_0": 5}}, "logit_bias"),
        ({**CHAT, "logit_bias": {"\u0661": 5}}, "logit_bias"),  # an Arabic-Indic one
        ({**CHAT, "logit_bias": {str(2**64): 5}}, "logit_bias"),
        ({**CHAT, "logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
        ({**CHAT, "stop_token_ids": [2**64]}, "stop_token_ids[0]"),
    ],
)
def test_strict_types_and_token_ids(http, body, param):
    r = http.post("/v1/chat/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param


def test_what_were_500s_are_400s(http):
    r = http.post("/tokenize", json={"prompt": "x" * 10**6})  # over the character bound
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    r = http.post("/v1/completions", json={"prompt": [1, 2**64], "max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    deep = "[" * 100_000 + "]" * 100_000
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": deep}}
    history = [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "user", "content": "hi"},
    ]
    r = http.post("/v1/chat/completions", json={**CHAT, "messages": history})
    assert r.status_code < 500, r.text


def test_one_request_cannot_start_more_sequences_than_the_cap(http, offline):
    r = http.post("/v1/completions", json={"prompt": ["a"] * 64, "n": 128, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text
    r = http.post("/v1/completions", json={"prompt": ["a"] * 65, "max_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
    ids = offline.tokenizer("USER: what is red " * 20 + "ASSISTANT:")["input_ids"]  # one flat prompt
    assert len(ids) > 64
    r = http.post("/v1/completions", json={"prompt": ids, "max_tokens": 3, "temperature": 0})
    assert r.status_code == 200, r.text
    want = offline.generate({"prompt_token_ids": ids}, SamplingParams(max_tokens=3, temperature=0))
    assert r.json()["choices"][0]["text"] == want[0].outputs[0].text


def test_one_client_cannot_hold_more_sequences_than_its_cap(http):
    clients = http.app.state.ctx.clients
    clients.cap = 3
    try:
        r = http.post("/v1/chat/completions", json={**CHAT, "n": 4})
        assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_requests", r.text
        assert "max_sequences_per_client=3" in r.json()["error"]["message"]
        assert http.post("/v1/chat/completions", json={**CHAT, "n": 3}).status_code == 200
        assert not clients.in_flight  # every unit given back
        with http.stream("POST", "/v1/chat/completions", json={**CHAT, "n": 3, "stream": True}) as r:
            assert r.status_code == 200
            next(r.iter_lines())  # then the client leaves
        body = {"prompt": ["a", "b"], "n": 2, "max_tokens": 2}
        assert http.post("/v1/completions", json=body).status_code == 429
        assert http.post("/v1/completions", json={**body, "n": 1}).status_code == 200
    finally:
        clients.cap = 0
    assert not clients.in_flight


def test_vllm_extras_act(http, offline):
    plain = offline.chat(CHAT["messages"], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    ids = plain.outputs[0].token_ids
    k = next(j for j in range(1, len(ids)) if ids[j] not in ids[:j])  # its first time out
    r = http.post(
        "/v1/chat/completions", json={**CHAT, "max_tokens": 8, "ignore_eos": True, "stop_token_ids": [ids[k]]}
    )
    assert r.status_code == 200, r.text
    assert (
        r.json()["usage"]["completion_tokens"] == k + 1 and r.json()["choices"][0]["finish_reason"] == "stop"
    )
    word = plain.outputs[0].text.split()[1]
    for include in (False, True):
        body = {
            **CHAT,
            "max_tokens": 8,
            "ignore_eos": True,
            "stop": [word],
            "include_stop_str_in_output": include,
        }
        text = http.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
        assert text.endswith(word) == include, text
    only = sorted(set(ids[1:3]))
    sampled = dict(max_tokens=6, ignore_eos=True, temperature=1.0, seed=1, allowed_token_ids=only)
    r = http.post("/v1/chat/completions", json={**CHAT, **sampled})
    assert r.status_code == 200, r.text
    want = offline.chat(CHAT["messages"], SamplingParams(**sampled))[0].outputs[0]
    assert set(want.token_ids) <= set(only) and r.json()["choices"][0]["message"]["content"] == want.text
    r = http.post("/v1/chat/completions", json={**CHAT, "allowed_token_ids": [10**8]})
    assert r.status_code == 400 and r.json()["error"]["param"] == "allowed_token_ids", r.text
    # bad_words: the word the plain answer starts its second word with is never written.
    r = http.post(
        "/v1/chat/completions", json={**CHAT, "max_tokens": 8, "ignore_eos": True, "bad_words": [word]}
    )
    assert r.status_code == 200, r.text
    assert word not in r.json()["choices"][0]["message"]["content"].split(), r.text
    for words, param in (([""], "bad_words[0]"), ([" "], "bad_words"), (["x"] * 129, "bad_words")):
        r = http.post("/v1/chat/completions", json={**CHAT, "bad_words": words})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    ok = http.post("/v1/chat/completions", json={**CHAT, "chat_template_kwargs": {"enable_thinking": False}})
    assert ok.status_code == 200, ok.text
    bad = http.post(
        "/v1/chat/completions", json={**CHAT, "chat_template_kwargs": {"chat_template": "{{ 1 }}"}}
    )
    assert bad.status_code == 400 and "chat_template" in bad.json()["error"]["message"], bad.text
    # LLaVA-1.5 takes no processor options: the request's reach the processing, which refuses them.
    with_image = {
        **CHAT,
        "messages": [{"role": "user", "content": [IMAGE, {"type": "text", "text": "what"}]}],
    }
    r = http.post("/v1/chat/completions", json={**with_image, "mm_processor_kwargs": {"max_pixels": 10}})
    assert r.status_code == 400 and "mm_processor_kwargs" in r.json()["error"]["message"], r.text
