"""Who may call the API, checked before any route runs: the Host a request names (against DNS
rebinding, when the operator lists the allowed hosts), the Origin of a browser's state-changing
request (a page on another site may not post to us), and the API key.

The key is compared in constant time. `/health` and the playground's page never need it (the page
asks for the key and sends it with its own calls); `/metrics` needs it only when the operator says
so. Refusals are in OpenAI's error shape: 401 for the key, 403 for the origin, 400 for the host.
"""

from __future__ import annotations

import hmac
from urllib.parse import urlsplit

import msgspec
from litestar.types import ASGIApp, Receive, Scope, Send

from mm_engine.api.errors import APIError, error_body
from mm_engine.api.settings import ServerSettings

_OPEN = {"/health", "/"}  # never need the key: the health check and the playground page
_SAFE_METHODS = {"GET", "HEAD", "OPTIONS"}


def access_middleware(settings: ServerSettings):
    key = settings.api_key.encode() if settings.api_key else None
    hosts = {h.lower() for h in settings.allowed_hosts}
    origins = {o.lower().rstrip("/") for o in settings.allowed_origins}

    def refusal(scope: Scope) -> APIError | None:
        headers = {k.lower(): v for k, v in scope.get("headers", [])}
        host = headers.get(b"host", b"").decode("latin-1").lower()
        if hosts and _hostname(host) not in hosts:
            return APIError(400, "this server does not answer for that Host", code="invalid_host")
        if scope["method"] not in _SAFE_METHODS and b"origin" in headers:
            origin = headers[b"origin"].decode("latin-1").lower().rstrip("/")
            if origin not in origins and _netloc(origin) != host:
                message = f"cross-origin requests from {origin[:100]!r} are not allowed"
                return APIError(403, message, code="cross_origin")
        path = scope["path"]
        if key is None or path in _OPEN or (path == "/metrics" and not settings.api_key_metrics):
            return None
        auth = headers.get(b"authorization", b"")
        scheme, _, given = auth.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(given.strip(), key):
            return APIError(401, "a valid API key is required (Authorization: Bearer <key>)",
                            code="invalid_api_key")  # fmt: skip
        return None

    def middleware(app: ASGIApp) -> ASGIApp:
        async def check(scope: Scope, receive: Receive, send: Send) -> None:
            err = refusal(scope) if scope["type"] == "http" else None
            if err is None:
                await app(scope, receive, send)
                return
            body = msgspec.json.encode(error_body(err))
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
            if err.status == 401:
                headers.append((b"www-authenticate", b"Bearer"))
            await send({"type": "http.response.start", "status": err.status, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        return check

    return middleware


def _netloc(origin: str) -> str:
    """`https://a.example:8000` -> `a.example:8000` (what a same-origin request's Host says)."""
    return urlsplit(origin).netloc if "://" in origin else ""


def _hostname(host: str) -> str:
    """The Host header without its port (`[::1]:8000` -> `[::1]`)."""
    if host.startswith("["):
        return host.split("]", 1)[0] + "]"
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host
