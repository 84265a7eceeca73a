"""Tool calling: the Hermes parser (whole and streamed, cut anywhere), and `tools` / `tool_choice`
through `/v1/chat/completions` with the official openai client on a byte-level Qwen3.5
checkpoint whose template shows the tools. A random model never calls a tool by itself, so the
"auto" tests hold it to a call with a regex (vLLM's `structured_outputs` extra) and check what the
server makes of the text; "required" and a named tool_choice hold it with their own grammars."""

from __future__ import annotations

import json

import pytest

from helpers.api import served_in_process
from mm_engine import LLM
from mm_engine.frontend.tool_calls import HermesToolParser
from mm_engine.testing import build_checkpoint

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "the weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}},
}
ASK = [{"role": "user", "content": "what is the weather in paris"}]
CALL_REGEX = r'Sure\. <tool_call>\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,8}"\}\}</tool_call>'
KW = dict(kv_cache_memory_bytes=16 * 1024**2, max_model_len=512)


@pytest.fixture(scope="module")
def qwen_bytes(tmp_path_factory) -> str:
    # Qwen3.5 (its hybrid model under the tool grammars; Qwen2.5-VL's template is the same).
    return str(build_checkpoint("qwen3_5", tmp_path_factory.mktemp("qwen_tools") / "q", byte_level=True))


# ---- the parser ----------------------------------------------------------------------------------

TEXT = (
    'Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    '<tool_call>{"name": "get_time", "arguments": {}}</tool_call> and <tool_call>not json</tool_call> '
    "<tool_ca"
)


def test_hermes_parser_takes_the_calls_and_keeps_the_rest():
    content, calls = HermesToolParser().parse(TEXT)
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    assert content == "Let me check.  and <tool_call>not json</tool_call> <tool_ca"  # a bad block is text
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    assert HermesToolParser().parse("no calls here") == ("no calls here", [])
    assert HermesToolParser().parse('<tool_call>{"name": "f", "arguments": {}}</tool_call>')[0] is None


@pytest.mark.parametrize("step", [1, 2, 5, 11])
def test_hermes_parser_streamed_in_any_pieces_gives_the_same(step):
    parser = HermesToolParser()
    content, calls = "", []
    for i in range(0, len(TEXT), step):
        text, new = parser.feed(TEXT[i : i + step])
        assert "<tool_call>{" not in text  # a call never leaks into the content
        content, calls = content + text, calls + new
    rest, _ = parser.flush()
    whole_content, whole_calls = HermesToolParser().parse(TEXT)
    assert [(c.name, c.arguments) for c in calls] == [(c.name, c.arguments) for c in whole_calls]
    assert (content + rest).strip() == whole_content


# ---- over HTTP -----------------------------------------------------------------------------------


def test_auto_tool_calls_whole_and_streamed(qwen_bytes):
    with served_in_process(qwen_bytes, **KW) as (client, _):
        kw = dict(model="m", messages=ASK, tools=[WEATHER, TIME], max_tokens=80, temperature=0,
                  extra_body={"structured_outputs": {"regex": CALL_REGEX}})  # fmt: skip
        r = client.chat.completions.create(**kw)
        choice = r.choices[0]
        assert choice.finish_reason == "tool_calls"
        assert choice.message.content == "Sure."
        (call,) = choice.message.tool_calls
        assert call.type == "function" and call.function.name == "get_weather"
        assert set(json.loads(call.function.arguments)) == {"city"}

        content, calls, reasons = "", {}, []
        for chunk in client.chat.completions.create(**kw, stream=True):
            delta = chunk.choices[0].delta
            content += delta.content or ""
            for tc in delta.tool_calls or []:
                entry = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
                entry["name"] += tc.function.name or ""
                entry["arguments"] += tc.function.arguments or ""
            reasons.append(chunk.choices[0].finish_reason)
        assert content.strip() == "Sure." and reasons[-1] == "tool_calls"
        assert [(c["name"], c["arguments"]) for c in calls.values()] == [
            ("get_weather", call.function.arguments)
        ]
        assert calls[0]["id"].startswith("call_")


def test_required_and_named_tool_choice_hold_the_answer_to_calls(qwen_bytes):
    with served_in_process(qwen_bytes, **KW) as (client, _):
        kw = dict(model="m", messages=ASK, tools=[WEATHER, TIME], max_tokens=120, temperature=0)
        named = client.chat.completions.create(
            **kw, tool_choice={"type": "function", "function": {"name": "get_weather"}}
        )
        (call,) = named.choices[0].message.tool_calls
        assert call.function.name == "get_weather" and named.choices[0].finish_reason == "tool_calls"
        assert set(json.loads(call.function.arguments)) == {"city"}
        assert named.choices[0].message.content is None

        required = client.chat.completions.create(**kw, tool_choice="required", parallel_tool_calls=False)
        calls = required.choices[0].message.tool_calls
        assert len(calls) == 1 and calls[0].function.name in {"get_weather", "get_time"}
        assert isinstance(json.loads(calls[0].function.arguments), dict)

        streamed = {}
        for chunk in client.chat.completions.create(
            **kw, tool_choice={"type": "function", "function": {"name": "get_weather"}}, stream=True
        ):
            for tc in chunk.choices[0].delta.tool_calls or []:
                streamed[tc.index] = (tc.function.name, tc.function.arguments)
        assert streamed == {0: ("get_weather", call.function.arguments)}  # greedy: the same call


def test_a_conversation_with_calls_and_their_results(qwen_bytes):
    with served_in_process(qwen_bytes, **KW) as (client, http):
        turns = [
            *ASK,
            {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": '{"city": "paris"}'}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        ]  # fmt: skip
        r = client.chat.completions.create(model="m", messages=turns, tools=[WEATHER], max_tokens=4)
        plain = client.chat.completions.create(model="m", messages=ASK, tools=[WEATHER], max_tokens=4)
        assert r.usage.prompt_tokens > plain.usage.prompt_tokens  # the call and its result were shown
        none = client.chat.completions.create(
            model="m", messages=ASK, tools=[WEATHER], tool_choice="none", max_tokens=4
        )
        bare = client.chat.completions.create(model="m", messages=ASK, max_tokens=4)
        assert none.usage.prompt_tokens == bare.usage.prompt_tokens < plain.usage.prompt_tokens
        assert none.choices[0].message.tool_calls is None


def _error(http, body: dict) -> tuple[int, str | None, str]:
    r = http.post("/v1/chat/completions", json={"messages": ASK, "max_tokens": 2, **body})
    err = r.json().get("error", {}) if r.status_code != 200 else {}
    return r.status_code, err.get("param"), err.get("message", "")


def test_bad_tool_requests_are_400s(qwen_bytes, clip_llama):
    with served_in_process(qwen_bytes, **KW) as (_, http):
        named = {"type": "function", "function": {"name": "nope"}}
        assert _error(http, {"tools": [WEATHER], "tool_choice": named})[:2] == (400, "tool_choice")
        assert _error(http, {"tool_choice": "required"})[:2] == (400, "tool_choice")
        assert _error(http, {"tools": [WEATHER, WEATHER]})[:2] == (400, "tools")
        bad_name = {"type": "function", "function": {"name": "has space"}}
        assert _error(http, {"tools": [bad_name]})[0] == 400
        both = {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}}
        assert _error(http, both)[:2] == (400, "tool_choice")
        no_content = {"messages": [{"role": "user", "content": None}]}
        assert _error(http, no_content)[0] == 400
    with served_in_process(clip_llama, **KW) as (_, http):  # LLaVA: no tool-call format
        status, param, message = _error(http, {"tools": [WEATHER]})
        assert (status, param) == (400, "tools") and "not supported for this model" in message
        assert _error(http, {"tools": [WEATHER], "tool_choice": "none"})[0] == 400


def test_python_chat_takes_tools(qwen_bytes, clip_llama):
    llm = LLM(qwen_bytes, **KW)
    with_tools = llm.chat(ASK, tools=[WEATHER])[0]
    without = llm.chat(ASK)[0]
    assert len(with_tools.prompt_token_ids) > len(without.prompt_token_ids)
    with pytest.raises(ValueError, match="tool calling is not supported for this model"):
        LLM(clip_llama, **KW).chat(ASK, tools=[WEATHER])
