"""OpenAI-style chat messages checked and turned into what a chat template takes: each image part
becomes `{"type": "image"}` and its data URL is collected, in order. Every error names the
message and part it is about."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from mm_engine.vision.image_io import ImageError


def to_template_messages(messages: Any) -> tuple[list[dict], list[str]]:
    """The messages for the chat template, and the data URLs of their images in order. An
    assistant message may carry `tool_calls` (its content then may be None) and a `tool` message
    its `tool_call_id`; a call's JSON arguments reach the template as a dict, as templates expect."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    converted, images = [], []
    for i, m in enumerate(messages):
        calls = m.get("tool_calls") if isinstance(m, Mapping) else None
        if not isinstance(m, Mapping) or "role" not in m or ("content" not in m and not calls):
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content'")
        if not isinstance(m["role"], str):
            raise ValueError(f"messages[{i}].role must be a string, got {type(m['role']).__name__}")
        extra = {}
        if calls:
            if m["role"] != "assistant":
                raise ValueError(f"messages[{i}]: only an assistant message has tool_calls")
            extra["tool_calls"] = [
                _template_call(c, f"messages[{i}].tool_calls[{k}]") for k, c in enumerate(calls)
            ]
        if m.get("tool_call_id") is not None:
            if not isinstance(m["tool_call_id"], str):
                raise ValueError(f"messages[{i}].tool_call_id must be a string")
            extra["tool_call_id"] = m["tool_call_id"]
        content = m.get("content")
        if content is None and calls:
            converted.append({"role": m["role"], "content": None, **extra})
            continue
        if isinstance(content, str):
            converted.append({"role": m["role"], "content": content, **extra})
            continue
        if not isinstance(content, list | tuple):
            raise ValueError(
                f"messages[{i}].content must be a string or a list of parts, got {type(content).__name__}"
            )
        parts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind == "text":
                if not isinstance(part.get("text"), str):
                    raise ValueError(f"messages[{i}].content[{j}].text must be a string")
                parts.append({"type": "text", "text": part["text"]})
            elif kind == "image_url":
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, Mapping) else url
                if not isinstance(url, str) or not url.startswith("data:"):
                    message = "image_url must be a data: URL here (remote images are not fetched)"
                    raise ImageError(f"image {len(images)}: {message}", len(images))
                images.append(url)  # decoded with the others, so that an error names it
                parts.append({"type": "image"})
            else:
                raise ValueError(
                    f"messages[{i}].content[{j}]: unsupported part type {kind!r}; use 'text' or 'image_url'"
                )
        converted.append({"role": m["role"], "content": parts, **extra})
    return converted, images


def _template_call(call: Any, where: str) -> dict:
    """An OpenAI tool call as chat templates take it: arguments as a dict where they parse."""
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise ValueError(f"{where} must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}")
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            parsed = None
        arguments = parsed if isinstance(parsed, dict) else arguments
    elif not isinstance(arguments, Mapping):
        raise ValueError(f"{where}.function.arguments must be a JSON string or an object")
    out = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out


def text_chars(content: str | list[dict] | None) -> int:
    """Characters of text in a converted message's content."""
    if content is None:
        return 0
    if isinstance(content, str):
        return len(content)
    return sum(len(part.get("text", "")) for part in content)
