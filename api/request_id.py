"""`x-request-id` on every HTTP response: the client's own (when it sent a sane one) or a fresh
one, kept in the ASGI scope's state for handlers and logs to use."""

from __future__ import annotations

import re
import uuid

from litestar.types import ASGIApp, Message, Receive, Scope, Send

HEADER = b"x-request-id"
_SANE = re.compile(rb"[A-Za-z0-9._:/+=@-]{1,128}")  # printable, no spaces or control characters


def request_id_middleware(app: ASGIApp) -> ASGIApp:
    async def middleware(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        sent = next((v for k, v in scope.get("headers", []) if k.lower() == HEADER), None)
        rid = sent if sent is not None and _SANE.fullmatch(sent) else uuid.uuid4().hex.encode()
        scope.setdefault("state", {})["request_id"] = rid.decode()

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != HEADER]
                message["headers"] = [*headers, (HEADER, rid)]
            await send(message)

        await app(scope, receive, send_with_id)

    return middleware
