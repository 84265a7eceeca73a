"""OpenAI-style chat messages checked and turned into what a chat template takes (`TemplateChat`):
each image part becomes `{"type": "image"}` and its image is collected, in order (a video part
likewise: `{"type": "video"}`). Every error
names the message and part it is about. The HTTP routes build a `TemplateChat` straight from the
messages their schema already validated; the Python API's dicts are validated here."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mm_engine.vision.image_io import ImageError


@dataclass(slots=True)
class TemplateChat:
    """Messages as the chat template takes them, and their images in order: `data:` URLs or
    encoded bytes (a fetched remote image), decoded in an input worker."""

    messages: list[dict]
    images: list[str | bytes]
    videos: list[str | bytes] = field(default_factory=list)  # `data:` URLs or encoded clips, likewise

    def text_chars(self) -> int:
        return sum(text_chars(m["content"]) for m in self.messages)


def to_template_messages(messages: Any) -> TemplateChat:
    """Validate the Python API's messages (dicts) into a `TemplateChat`. An assistant message may
    carry `tool_calls` (its content then may be None) and a `tool` message its `tool_call_id`."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    converted, images, videos = [], [], []
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
            elif kind == "video_url":
                url = part.get("video_url")
                url = url.get("url") if isinstance(url, Mapping) else url
                if not isinstance(url, str) or not url.startswith("data:"):
                    message = "video_url must be a data: URL here (remote videos are not fetched)"
                    raise ValueError(f"video {len(videos)}: {message}")
                videos.append(url)
                parts.append({"type": "video"})
            else:
                raise ValueError(
                    f"messages[{i}].content[{j}]: unsupported part type {kind!r}; use 'text', "
                    "'image_url' or 'video_url'"
                )
        converted.append({"role": m["role"], "content": parts, **extra})
    return TemplateChat(converted, images, videos)


def _template_call(call: Any, where: str) -> dict:
    """An OpenAI tool call as chat templates take it: arguments as a dict where they parse."""
    function = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str):
        raise ValueError(f"{where} must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}")
    arguments = function.get("arguments", {})
    if not isinstance(arguments, str | Mapping):
        raise ValueError(f"{where}.function.arguments must be a JSON string or an object")
    call_id = call.get("id")
    return template_call(function["name"], arguments, call_id if isinstance(call_id, str) else None)


def template_call(name: str, arguments: str | Mapping, call_id: str | None) -> dict:
    """A tool call as chat templates take it: JSON arguments as a dict where they parse (as
    templates expect), else as given."""
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except (ValueError, RecursionError):  # not JSON, or nested too deep to be arguments
            parsed = None
        arguments = parsed if isinstance(parsed, dict) else arguments
    out = {"type": "function", "function": {"name": name, "arguments": arguments}}
    if call_id is not None:
        out["id"] = call_id
    return out


def text_chars(content: str | list[dict] | None) -> int:
    """Characters of text in a converted message's content."""
    if content is None:
        return 0
    if isinstance(content, str):
        return len(content)
    return sum(len(part.get("text", "")) for part in content)
