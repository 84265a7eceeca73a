"""OpenAI-style chat messages checked and turned into what a chat template takes: each image part
becomes `{"type": "image"}` and its data URL is collected, in order. Every error names the
message and part it is about."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def to_template_messages(messages: Any) -> tuple[list[dict], list[str]]:
    """The messages for the chat template, and the data URLs of their images in order."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    converted, images = [], []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
            raise ValueError(f"messages[{i}] must be a dict with 'role' and 'content'")
        if not isinstance(m["role"], str):
            raise ValueError(f"messages[{i}].role must be a string, got {type(m['role']).__name__}")
        content = m["content"]
        if isinstance(content, str):
            converted.append({"role": m["role"], "content": content})
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
                    raise ValueError(
                        f"image {len(images)}: image_url must be a data: URL here "
                        "(remote images are not fetched)"
                    )
                images.append(url)  # decoded with the others, so that an error names it
                parts.append({"type": "image"})
            else:
                raise ValueError(
                    f"messages[{i}].content[{j}]: unsupported part type {kind!r}; use 'text' or 'image_url'"
                )
        converted.append({"role": m["role"], "content": parts})
    return converted, images


def text_chars(content: str | list[dict]) -> int:
    """Characters of text in a converted message's content."""
    if isinstance(content, str):
        return len(content)
    return sum(len(part.get("text", "")) for part in content)
