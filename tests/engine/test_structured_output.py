"""Structured output (xgrammar): JSON schema, any JSON object, regex, choice and EBNF grammars
mask every sampled token, on a tiny random checkpoint with a byte-level tokenizer; the same with
async scheduling; bad specs are refused by name; and through the official openai client
(`response_format` and vLLM's `guided_*` extras)."""

from __future__ import annotations

import json
import re

import pytest

from helpers.api import served_in_process
from mm_engine import LLM, SamplingParams
from mm_engine.sampling_params import StructuredOutputs
from mm_engine.testing import build_checkpoint

KW = dict(kv_cache_memory_bytes=8 * 1024**2)
SCHEMA = {
    "type": "object",
    "properties": {
        "caption": {"type": "string", "enum": ["a red circle", "a blue square", "two green triangles"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
        "tags": {
            "type": "array",
            "items": {"type": "string", "enum": ["red", "blue", "green"]},
            "maxItems": 3,
        },
    },
    "required": ["caption", "count", "tags"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def bytelevel(tmp_path_factory) -> str:
    return str(build_checkpoint("llava", tmp_path_factory.mktemp("bytelevel"), byte_level=True))


def _valid(obj) -> bool:
    return (
        set(obj) == {"caption", "count", "tags"}
        and obj["caption"] in SCHEMA["properties"]["caption"]["enum"]
        and isinstance(obj["count"], int) and 0 <= obj["count"] <= 9
        and len(obj["tags"]) <= 3 and all(t in ("red", "blue", "green") for t in obj["tags"])
    )  # fmt: skip


def _params(i: int, **spec) -> SamplingParams:
    return SamplingParams(
        temperature=0.9, seed=i, max_tokens=120, structured_outputs=StructuredOutputs(**spec)
    )


@pytest.mark.parametrize("mode", [None, "thread"])
def test_every_kind_of_grammar_is_followed(bytelevel, mode):
    kw = KW if mode is None else dict(KW, async_scheduling=True, async_launch=mode)
    llm = LLM(bytelevel, **kw)
    prompts = ["USER: describe it ASSISTANT:"] * 4
    outs = llm.generate(prompts, [_params(i, json=SCHEMA) for i in range(4)])
    for o in outs:
        assert o.outputs[0].finish_reason == "stop", o.outputs[0].text  # ended by the grammar's EOS
        assert _valid(json.loads(o.outputs[0].text))
    so = StructuredOutputs(json_object=True)
    any_json = llm.generate(prompts[0], SamplingParams(max_tokens=200, temperature=0, structured_outputs=so))
    text = any_json[0].outputs[0].text
    assert text.startswith("{")
    if any_json[0].outputs[0].finish_reason == "stop":
        assert isinstance(json.loads(text, strict=False), dict)
    regex = llm.generate(prompts[0], _params(1, regex=r"[a-c]{3}-[0-9]{2}"))[0].outputs[0].text
    assert re.fullmatch(r"[a-c]{3}-[0-9]{2}", regex)
    choice = llm.generate(prompts, [_params(i, choice=["red circle", "blue square"]) for i in range(4)])
    assert {o.outputs[0].text for o in choice} <= {"red circle", "blue square"}
    ebnf = 'root ::= "count: " [0-9] [0-9]?'
    grammar = llm.generate(prompts[0], _params(2, grammar=ebnf))[0].outputs[0].text
    assert re.fullmatch(r"count: [0-9][0-9]?", grammar)
    assert all(pool.num_used == 0 for pool in llm.engine.core.blocks.pools.values())


def test_the_same_tokens_with_async_scheduling(bytelevel):
    params = [_params(i, json=SCHEMA) for i in range(3)]
    prompts = [f"USER: describe {i} ASSISTANT:" for i in range(3)]
    want = [o.outputs[0].token_ids for o in LLM(bytelevel, **KW).generate(prompts, params)]
    llm = LLM(bytelevel, **KW, async_scheduling=True, async_launch="thread")
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want


def test_bad_specs_are_refused_by_name(bytelevel):
    llm = LLM(bytelevel, **KW)
    with pytest.raises(ValueError, match="structured_outputs.regex cannot be compiled") as info:
        llm.generate("USER: hi ASSISTANT:", _params(0, regex="[a-"))
    assert not re.search(r"\.cc\b|/project/", str(info.value))  # no path of the library's build
    with pytest.raises(ValueError, match="exactly one"):
        SamplingParams(structured_outputs=StructuredOutputs(regex="a", choice=["b"]))
    with pytest.raises(ValueError, match="structured_outputs.json cannot be compiled"):
        llm.generate("USER: hi ASSISTANT:", _params(0, json={"type": "no such type"}))
    assert (
        llm.generate("USER: hi ASSISTANT:", SamplingParams(max_tokens=2))[0].outputs[0].token_ids
    )  # serving


def test_the_openai_client_gets_schema_valid_json(bytelevel):
    messages = [{"role": "user", "content": "describe it"}]
    fmt = {"type": "json_schema", "json_schema": {"name": "caption", "schema": SCHEMA, "strict": True}}
    with served_in_process(bytelevel, **KW) as (client, http):
        for seed in range(3):
            r = client.chat.completions.create(model="m", messages=messages, max_tokens=120, temperature=0.9,
                                               seed=seed, response_format=fmt)  # fmt: skip
            assert _valid(json.loads(r.choices[0].message.content))
        chunks = client.chat.completions.create(model="m", messages=messages, max_tokens=120, seed=5,
                                                response_format=fmt, stream=True)  # fmt: skip
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert _valid(json.loads(text))
        r = client.chat.completions.create(model="m", messages=messages, max_tokens=20,
                                           extra_body={"guided_choice": ["yes", "no"]})  # fmt: skip
        assert r.choices[0].message.content in ("yes", "no")
        r = client.completions.create(model="m", prompt="USER: hi ASSISTANT:", max_tokens=20,
                                      extra_body={"guided_regex": "[0-9]{4}"})  # fmt: skip
        assert re.fullmatch("[0-9]{4}", r.choices[0].text)
        for body, param in [
            ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
            ({"guided_regex": "[a-"}, None),
            ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_choice"),
            ({"response_format": {"type": "xml"}}, None),
        ]:
            bad = http.post("/v1/chat/completions", json={"messages": messages, **body})
            assert bad.status_code == 400, bad.text
            if param is not None:
                assert bad.json()["error"]["param"] == param


def test_caption_json_schema_writes_the_parsed_object(bytelevel, tmp_path):
    from helpers.images import make_image
    from mm_engine.jobs.caption_cli import main

    folder = tmp_path / "images"
    folder.mkdir()
    for i in range(3):
        make_image(i).save(folder / f"img{i}.png")
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(SCHEMA))
    out = tmp_path / "captions.jsonl"
    argv = [str(folder), "--out", str(out), "--model", bytelevel, "--json-schema", str(schema),
            "--max-tokens", "120", "--temperature", "0.9", "--progress", "none",
            "--prompt", "USER: <image> describe it ASSISTANT:",
            "--kv-cache-memory-bytes", str(8 * 1024**2)]  # fmt: skip
    assert main(argv) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(lines) == 3
    for line in lines:
        assert line["json"] == json.loads(line["caption"]) and _valid(line["json"])
    bad = tmp_path / "bad.json"
    bad.write_text('{"type": "no such type"}')
    assert main([*argv[:6], str(bad), *argv[7:], "--overwrite"]) == 2  # refused before any image


def test_a_schema_never_lets_a_raw_control_character_in(bytelevel):
    """xgrammar's length-bounded strings accept raw control bytes (invalid JSON); the engine
    forbids every token holding one under a JSON schema."""
    from transformers import AutoTokenizer

    from mm_engine.core.structured_output import Grammars, GrammarState, allocate_bitmask

    tok = AutoTokenizer.from_pretrained(bytelevel)
    grammars = Grammars(lambda: tok, len(tok))
    schema = {"type": "object", "properties": {"a": {"type": "string", "maxLength": 20}}, "required": ["a"]}
    state = GrammarState(grammars.compile(StructuredOutputs(json=schema)))
    for t in tok('{"a": "x', add_special_tokens=False)["input_ids"]:
        assert state.accept(t)
    mask = allocate_bitmask(1, len(tok))
    state.fill(mask, 0)

    def allowed(token: int) -> bool:
        return bool((int(mask[0, token // 32]) >> (token % 32)) & 1)

    (control,) = tok("\x11", add_special_tokens=False)["input_ids"]
    (letter,) = tok("y", add_special_tokens=False)["input_ids"]
    assert allowed(letter) and not allowed(control)


def test_specs_over_the_limits_are_refused_before_compiling(bytelevel, monkeypatch):
    llm = LLM(bytelevel, **KW, max_grammar_entries=50, max_grammar_bytes=4096, max_grammar_depth=16)
    grammars = llm.engine.inputs.grammars
    compiled = []
    monkeypatch.setattr(grammars, "_compile", lambda key: compiled.append(key))
    wide = {"type": "object", "properties": {f"p{i}": {"type": "integer"} for i in range(60)}}
    enum = {"type": "string", "enum": [f"v{i}" for i in range(60)]}
    deep: dict = {"type": "integer"}
    for _ in range(10):
        deep = {"type": "object", "properties": {"a": deep}}
    cases = [
        ({"json": wide}, "60 properties, enum values or alternatives, more than the limit of 50"),
        ({"json": enum}, "more than the limit of 50"),
        ({"json": deep}, "nested 21 deep, more than 16"),
        ({"choice": [f"c{i}" for i in range(51)]}, "structured_outputs.choice has 51"),
        ({"regex": "a" * 5000}, "structured_outputs.regex is 5000 bytes, more than the limit of 4096"),
    ]
    for spec, message in cases:
        with pytest.raises(ValueError, match=re.escape(message)):
            llm.generate("USER: hi ASSISTANT:", _params(0, **spec))
    assert compiled == []  # none of them reached the compiler
    assert llm.kv_report()["text"]["used_blocks"] == 0


def test_a_grammar_no_token_can_begin_is_refused(bytelevel, clip_llama):
    llm = LLM(bytelevel, **KW)
    with pytest.raises(ValueError, match="accepts no output that this model's vocabulary can begin"):
        llm.generate("USER: hi ASSISTANT:", _params(0, regex="[^\\s\\S]"))  # the empty language
    # A word-level vocabulary without "{" cannot begin any JSON: refused, not padding to max_tokens.
    words = LLM(clip_llama, **KW)
    if "{" not in "".join(words.tokenizer.get_vocab()):
        with pytest.raises(ValueError, match="can begin"):
            words.generate("USER: hi ASSISTANT:", _params(0, json_object=True))


# Within every limit, yet its compile takes a second or more, and tens of MiB (a 2-core EPYC).
MANY = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(900)}}


def _grammars(path: str, **kw):
    from transformers import AutoTokenizer

    from mm_engine.core.structured_output import Grammars

    tok = AutoTokenizer.from_pretrained(path)
    return Grammars(lambda: tok, len(tok), **kw)


def test_a_trial_compile_past_its_deadline_or_memory_is_stopped_and_refused(bytelevel):
    """core/grammar_probe.py: the trial process is killed at the deadline or the memory cap, the
    spec refused by name, and the next spec gets a fresh process."""
    slow = _grammars(bytelevel, timeout_s=0.05, trial_memory_bytes=1024**3)
    with pytest.raises(ValueError, match=r"structured_outputs.json took longer than 0.05 s"):
        slow.compile(StructuredOutputs(json=MANY))
    small = _grammars(bytelevel, timeout_s=60, trial_memory_bytes=8 * 1024**2)
    with pytest.raises(ValueError, match=r"structured_outputs.json needs more than 8 MiB"):
        small.compile(StructuredOutputs(json=MANY))
    assert small.compile(StructuredOutputs(regex="[a-c]+")) is not None
    roomy = _grammars(bytelevel, timeout_s=60, trial_memory_bytes=1024**3)
    assert roomy.compile(StructuredOutputs(json=MANY)) is not None
    with pytest.raises(ValueError, match="cannot be compiled"):  # xgrammar's refusal, from the trial
        roomy.compile(StructuredOutputs(regex="a{2}{3}"))


def test_a_trial_compile_whose_every_client_left_is_stopped(bytelevel):
    import asyncio

    grammars = _grammars(bytelevel, timeout_s=60, trial_memory_bytes=1024**3)
    spec = StructuredOutputs(json=MANY)

    async def leave_during_the_trial():
        waiter = asyncio.ensure_future(grammars.ready(spec))
        while grammars._trying is None:
            assert not waiter.done(), waiter.exception()
            await asyncio.sleep(0.005)
        future = grammars._cache[spec.key()]
        waiter.cancel()  # the client went away
        with pytest.raises(asyncio.CancelledError):
            await waiter
        return future

    future = asyncio.run(leave_during_the_trial())
    with pytest.raises(ValueError, match="compile stopped, its every client left"):
        future.result(30)
    assert spec.key() not in grammars._cache  # not kept: the next request compiles it anew


def test_the_grammar_cache_is_bounded_by_bytes(bytelevel):
    llm = LLM(bytelevel, **KW, grammar_cache_bytes=1)
    grammars = llm.engine.inputs.grammars
    for i in range(3):
        grammars.compile(StructuredOutputs(choice=[f"x{i}", "y"]))
    assert len(grammars._cache) == 1 and grammars.cached_bytes > 0  # only the latest stays
    grammars.compile(StructuredOutputs(regex="[0-9]+"))
    assert len(grammars._cache) == 1


def test_a_compile_over_the_timeout_is_a_400_and_others_are_served(bytelevel, monkeypatch):
    import threading

    from helpers.api import served_in_process

    release, started = threading.Event(), []
    with served_in_process(bytelevel, **KW, grammar_compile_timeout_s=0.5) as (_, http):
        grammars = http.app.state.ctx.llm.inputs.grammars
        # Start the trial process first: while it is not running, a waiter adds its start-up time to
        # the timeout (alone in a worker this test was the first to compile, and got a 200).
        grammars.compile(StructuredOutputs(regex="[0-9]"))
        slow = grammars._compile
        monkeypatch.setattr(
            grammars, "_compile", lambda key: (started.append(key), release.wait(30), slow(key))[2]
        )
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        for regex in ("[0-9]{3}", "[a-z]{3}"):  # the second waits behind the first's compile
            r = http.post("/v1/chat/completions", json={**body, "guided_regex": regex})
            assert (
                r.status_code == 400 and "took longer than 0.5 s to compile" in r.json()["error"]["message"]
            )
        assert http.post("/v1/chat/completions", json=body).status_code == 200  # the lanes are free
        release.set()
        # The first compile had started and finishes (cached); the second, abandoned before it
        # started, was dropped rather than left to hold the compile thread.
        assert http.post("/v1/chat/completions", json={**body, "guided_regex": "[0-9]{3}"}).status_code == 200
        assert [text for _, text in started] == ["[0-9]{3}"]


def test_an_in_process_engine_compiles_a_spec_once(bytelevel, monkeypatch):
    llm = LLM(bytelevel, **KW)
    grammars = llm.engine.inputs.grammars
    assert llm.engine.core.grammars is grammars  # the frontend's, shared with the core
    compiled = []
    compile_ = grammars._compile
    monkeypatch.setattr(grammars, "_compile", lambda key: (compiled.append(key), compile_(key))[1])
    out = llm.generate(["USER: hi ASSISTANT:"] * 2, _params(0, regex="[0-9]{4}"))
    assert [len(o.outputs[0].text) for o in out] == [4, 4]
    assert len(compiled) == 1  # checked by the frontend, then reused by the core
