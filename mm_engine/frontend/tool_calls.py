"""Tool calls in generated text: which format a model family answers with, and a parser for it,
over the whole text or fed as it streams.

The Hermes format (Qwen2-VL, Qwen2.5-VL, Qwen3-VL: their chat templates describe the tools and
ask for it) puts each call in tags, between or around ordinary text:

    Let me look. <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

A block that is not a JSON object with a string `name` (and an object of `arguments`) is not a
call: it stays in the content, as the model wrote it.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

# Families whose chat templates ask for tool calls in a format we parse, and that format.
FAMILY_FORMATS = {
    "qwen2_vl": "hermes",
    "qwen2_5_vl": "hermes",
    "qwen3_vl": "hermes",
    "qwen3_vl_moe": "hermes",
}


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # the arguments object as JSON text (OpenAI's shape)
    id: str


def new_call(name: str, arguments: str) -> ToolCall:
    return ToolCall(name, arguments, f"call_{uuid.uuid4().hex[:24]}")


def tool_format_for(model_type: str, chat_template: str | None) -> str | None:
    """The tool-call format of a model, or None when it has none we parse (or its chat template
    cannot show it the tools)."""
    fmt = FAMILY_FORMATS.get(model_type)
    if fmt is None and chat_template is not None and HermesToolParser.START in chat_template:
        fmt = "hermes"  # a template that shows the model Hermes' tags, whatever the family
    if fmt is None or chat_template is None or "tools" not in chat_template:
        return None
    return fmt


def as_call(block: str) -> ToolCall | None:
    """`{"name": ..., "arguments": {...}}` as a call; None when it is not one."""
    try:
        value = json.loads(block)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if not isinstance(arguments, dict):
        return None
    return new_call(value["name"], json.dumps(arguments, ensure_ascii=False))


class HermesToolParser:
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self._held = ""  # text not handed out yet: a possible start tag, or an open call
        self._in_call = False

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The whole text: (its content outside the calls; the calls)."""
        return parse_whole(self, text)

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        """The next piece of a stream: (content to hand out now, calls it completed). Text that may
        be the start of a call tag is held until the next piece tells."""
        self._held += delta
        content, calls = [], []
        while True:
            if not self._in_call:
                at = self._held.find(self.START)
                if at < 0:
                    keep = _partial_suffix(self._held, self.START)
                    content.append(self._held[: len(self._held) - keep])
                    self._held = self._held[len(self._held) - keep :]
                    break
                content.append(self._held[:at])
                self._held, self._in_call = self._held[at + len(self.START) :], True
            end = self._held.find(self.END)
            if end < 0:
                break
            block, self._held, self._in_call = self._held[:end], self._held[end + len(self.END) :], False
            call = as_call(block.strip())
            if call is None:
                content.append(self.START + block + self.END)
            else:
                calls.append(call)
        return "".join(content), calls

    def flush(self) -> tuple[str, list[ToolCall]]:
        """At the end of the stream: what is still held (an unclosed call is content)."""
        held = (self.START if self._in_call else "") + self._held
        self._held, self._in_call = "", False
        return held, []


PARSERS = {"hermes": HermesToolParser}


def parse_whole(parser, text: str) -> tuple[str | None, list[ToolCall]]:
    """A whole answer through a streaming parser (`feed`, then `flush`): (the content, stripped
    and None when nothing is left beside calls; the calls)."""
    content, calls = parser.feed(text)
    rest, more = parser.flush()
    content, calls = content + rest, calls + more
    if calls:
        return content.strip() or None, calls
    return content, calls


def _partial_suffix(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (a tag cut by the stream)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0
