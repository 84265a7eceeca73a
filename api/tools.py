"""Chat requests with `tools`: what the template is shown, what the output is held to, and how
the tool calls come out of each choice's text (whole, or as it streams).

tool_choice:
- "auto" (the default when tools are given): the template describes the tools and the model's
  answer is parsed in its family's format (mm_engine.frontend.tool_calls); what is not a call is content.
- "none": the tools are not shown and nothing is parsed (as vLLM does by default).
- "required": the answer is held by a grammar to a JSON array of one or more calls, each
  `{"name": one of the tools, "arguments": that tool's parameters}` (one only without
  `parallel_tool_calls`).
- a named function: the answer is held to that function's parameters schema, and is its call.
A model whose family has no tool-call format gets a 400 for `tools` (never silently ignored).
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from mm_engine.api.errors import APIError
from mm_engine.api.openai_schemas import (
    CalledFunction,
    ChatCompletionRequest,
    DeltaFunction,
    DeltaToolCall,
    MessageToolCall,
    NamedToolChoice,
)
from mm_engine.frontend.tool_calls import PARSERS, ToolCall, as_call, new_call, parse_whole
from mm_engine.sampling_params import StructuredOutputs


@dataclass(frozen=True, slots=True)
class ToolPlan:
    tools: list[dict] | None  # for the chat template; None: none shown
    mode: str  # "off" (no tools or tool_choice none), "auto", "required", "named"
    fmt: str | None = None  # the family's format, for "auto"
    name: str | None = None  # the named function
    parallel: bool = True
    structured: StructuredOutputs | None = None  # the grammar of "required" and "named"

    def extractor(self) -> CallExtractor:
        return CallExtractor(self)


def plan_tools(data: ChatCompletionRequest, tool_format: str | None) -> ToolPlan:
    choice = data.tool_choice
    if not data.tools:
        if choice not in (None, "none"):
            raise APIError(400, "tool_choice needs tools", param="tool_choice")
        return ToolPlan(None, "off")
    if tool_format is None:
        raise APIError(
            400, "tools: tool calling is not supported for this model (no tool-call format for its family)",
            param="tools", code="unsupported_parameter",
        )  # fmt: skip
    names = [t.function.name for t in data.tools]
    if len(set(names)) != len(names):
        raise APIError(400, "tools: two tools have the same name", param="tools")
    if choice == "none":
        return ToolPlan(None, "off")
    tools = [_tool_dict(t) for t in data.tools]
    if choice in (None, "auto"):
        return ToolPlan(tools, "auto", tool_format, parallel=data.parallel_tool_calls)
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            message = f"tool_choice names {choice.function.name!r}, which is not one of the tools"
            raise APIError(400, message, param="tool_choice")
        schema = _parameters(data.tools[names.index(choice.function.name)])
        return ToolPlan(tools, "named", name=choice.function.name, structured=StructuredOutputs(json=schema))
    calls = {
        "type": "array",
        "minItems": 1,
        "items": {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {"name": {"const": t.function.name}, "arguments": _parameters(t)},
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
                for t in data.tools
            ]
        },
    }
    if not data.parallel_tool_calls:
        calls["maxItems"] = 1
    structured = StructuredOutputs(json=calls)
    return ToolPlan(tools, "required", parallel=data.parallel_tool_calls, structured=structured)


class CallExtractor:
    """One choice's text in, (content, tool calls) out; `feed` as it streams, `flush` at its end."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self._parser = PARSERS[plan.fmt]() if plan.mode == "auto" else None
        self._text = ""  # the whole answer, for "required" and "named" (JSON: parsed at the end)
        self.num_calls = 0

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        if self.plan.mode == "off":
            return delta, []
        if self._parser is not None:
            return self._limit(*self._parser.feed(delta))
        self._text += delta
        return "", []

    def flush(self) -> tuple[str, list[ToolCall]]:
        if self.plan.mode == "off":
            return "", []
        if self._parser is not None:
            return self._limit(*self._parser.flush())
        text, self._text = self._text, ""
        if self.plan.mode == "named":  # the arguments themselves (cut short if the length ran out)
            return self._limit("", [new_call(self.plan.name, text.strip())])
        try:
            items = json.loads(text)
        except ValueError:  # cut short by max_tokens: no call to make of it
            return text, []
        calls = [as_call(json.dumps(item)) for item in items] if isinstance(items, list) else []
        return self._limit("", [c for c in calls if c is not None])

    def whole(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """A non-streamed answer: (its content, None when empty beside calls; the calls)."""
        return parse_whole(self, text)

    def _limit(self, content: str, calls: list[ToolCall]) -> tuple[str, list[ToolCall]]:
        if not self.plan.parallel:  # one call only: later ones are dropped
            calls = calls[: max(0, 1 - self.num_calls)]
        self.num_calls += len(calls)
        return content, calls


def message_calls(calls: list[ToolCall]) -> list[MessageToolCall]:
    return [MessageToolCall(c.id, CalledFunction(c.name, c.arguments)) for c in calls]


def delta_calls(calls: list[ToolCall], first_index: int) -> list[DeltaToolCall]:
    """Each call whole in one delta (name and arguments together; clients accumulate either way)."""
    return [
        DeltaToolCall(first_index + k, c.id, "function", DeltaFunction(c.name, c.arguments))
        for k, c in enumerate(calls)
    ]


def _tool_dict(tool) -> dict:
    function = {"name": tool.function.name, "parameters": _parameters(tool)}
    if tool.function.description is not None:
        function["description"] = tool.function.description
    return {"type": "function", "function": function}


def _parameters(tool) -> dict:
    return tool.function.parameters if tool.function.parameters is not None else {"type": "object"}
