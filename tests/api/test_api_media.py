"""Remote image URLs: refused unless allowed; when allowed, fetched only from public addresses,
every redirect checked again, size and time capped. DNS and HTTP are faked (no network)."""

from __future__ import annotations

import asyncio
import base64

import httpx
import pytest
from litestar.testing import TestClient

from helpers.api import ENGINE_KW, image_bytes
from mm_engine.api.app import create_app
from mm_engine.api.media import MediaError, MediaFetcher, host_allowed, is_public
from mm_engine.api.settings import ServerSettings
from mm_engine.async_llm import AsyncLLM

DNS = {
    "img.example.com": ["93.184.216.34"],
    "cdn.example.com": ["2606:2800:220:1::1"],
    "inside.example.com": ["10.0.0.7"],
    "mixed.example.com": ["93.184.216.34", "127.0.0.1"],
    "localhost": ["127.0.0.1"],
    "evil.test": ["93.184.216.35"],
}
PNG = image_bytes(7)


async def fake_resolve(host: str, port: int) -> list[str]:
    return DNS.get(host, [host])  # an IP literal resolves to itself


def body(data: bytes, status: int = 200, **headers: str) -> httpx.Response:
    return httpx.Response(status, stream=httpx.ByteStream(data), headers=headers)  # streamed, like a socket


def upstream(request: httpx.Request) -> httpx.Response:
    """What the checked address answers; `Host` says which site was meant."""
    host, path = request.headers["host"], request.url.path
    if path == "/cat.png":
        return body(PNG)
    if path == "/big.png":  # no content-length: the cap must hold while reading
        return body(b"\0" * 5000)
    if path == "/gzip.png":
        return body(PNG, **{"content-encoding": "gzip"})
    if path == "/missing.png":
        return httpx.Response(404)
    if path.startswith("/to/"):  # /to/<host>/<path>: a redirect
        _, _, target, rest = path.split("/", 3)
        return httpx.Response(302, headers={"location": f"http://{target}/{rest}"})
    if path == "/loop.png":
        return httpx.Response(302, headers={"location": "/loop.png"})
    raise AssertionError(f"unexpected request to {host}{path}")


def fetcher(**kw) -> MediaFetcher:
    allowed = kw.pop("allowed", ("img.example.com", "*.example.com", "localhost", "127.0.0.1"))
    return MediaFetcher(allowed, kw.pop("max_bytes", 4096), kw.pop("timeout", 5.0), 3,
                        resolver=fake_resolve, transport=httpx.MockTransport(upstream), **kw)  # fmt: skip


def fetch(url: str, **kw) -> bytes:
    async def run():
        f = fetcher(**kw)
        try:
            return await f.fetch(url)
        finally:
            await f.aclose()

    return asyncio.run(run())


def test_allowed_public_host_is_fetched_through_the_checked_address():
    seen = []

    def recording(request):
        seen.append((request.url.host, request.headers["host"]))
        return upstream(request)

    async def run():
        f = MediaFetcher(
            ["img.example.com"], 4096, 5.0, resolver=fake_resolve, transport=httpx.MockTransport(recording)
        )
        return await f.fetch("http://img.example.com/cat.png")

    assert asyncio.run(run()) == PNG
    assert seen == [("93.184.216.34", "img.example.com")]  # pinned: no second DNS lookup
    assert fetch("https://cdn.example.com/cat.png") == PNG  # wildcard entry, IPv6 address


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("http://evil.test/cat.png", "not allowed"),
        ("ftp://img.example.com/cat.png", r"data: URLs, or http\(s\)"),
        ("file:///etc/passwd", r"data: URLs, or http\(s\)"),
        ("http://user:pw@img.example.com/cat.png", "credentials"),
        ("http://localhost/cat.png", "private or loopback"),
        ("http://127.0.0.1/cat.png", "private or loopback"),
        ("http://inside.example.com/cat.png", "private or loopback"),
        ("http://mixed.example.com/cat.png", "private or loopback"),  # one bad address is enough
        ("http://img.example.com/to/evil.test/cat.png", "not allowed"),  # redirect off the list
        ("http://img.example.com/to/inside.example.com/cat.png", "private or loopback"),
        ("http://img.example.com/loop.png", "redirects more than 3 times"),
        ("http://img.example.com/big.png", "larger than the limit of 4096 bytes"),
        ("http://img.example.com/gzip.png", "compressed"),
        ("http://img.example.com/missing.png", "answered 404"),
    ],
)
def test_refused_urls(url, message):
    with pytest.raises(MediaError, match=message):
        fetch(url)


def test_fetch_time_is_capped():
    async def slow(request):
        await asyncio.sleep(30)

    async def run():
        f = MediaFetcher(
            ["img.example.com"], 4096, 0.05, resolver=fake_resolve, transport=httpx.MockTransport(slow)
        )
        return await f.fetch("http://img.example.com/cat.png")

    with pytest.raises(MediaError, match="took longer than"):
        asyncio.run(run())


def test_address_and_host_rules():
    private = [
        "127.0.0.1",
        "10.1.2.3",
        "172.16.0.1",
        "192.168.1.1",
        "169.254.169.254",
        "0.0.0.0",
        "100.64.0.1",
    ]
    private += ["224.0.0.1", "::1", "fe80::1%eth0", "::ffff:127.0.0.1", "fc00::1"]
    for address in private:
        assert not is_public(address), address
    assert is_public("93.184.216.34") and is_public("2606:2800:220:1::1")
    assert host_allowed("a.example.com", ["*.example.com"]) and not host_allowed(
        "example.com", ["*.example.com"]
    )
    assert host_allowed("IMG.example.com.", ["img.example.com"]) and not host_allowed(
        "xexample.com", ["*.example.com"]
    )


def test_chat_with_an_allowed_remote_image_equals_the_same_image_inline(clip_llama):
    llm = AsyncLLM.from_engine_args(clip_llama, **ENGINE_KW)
    settings = ServerSettings(allowed_media_domains=("img.example.com",))
    app = create_app(llm, settings, fetcher=fetcher(max_bytes=settings.max_image_bytes))

    def ask(url: str) -> httpx.Response:
        content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "what is this"}]
        body = {"messages": [{"role": "user", "content": content}], "max_tokens": 5, "temperature": 0}
        return c.post("/v1/chat/completions", json=body)

    seen = []  # what reaches the input worker: the fetched bytes themselves, not a data: URL of them
    process_chat = llm.process_chat
    llm.process_chat = lambda chat, *rest: (seen.append(list(chat.images)), process_chat(chat, *rest))[1]
    try:
        with TestClient(app) as c:
            remote = ask("http://img.example.com/cat.png")
            inline = ask("data:image/png;base64," + base64.b64encode(PNG).decode())
            refused = ask("http://img.example.com/to/localhost/cat.png")
    finally:
        asyncio.run(llm.shutdown())
    assert remote.status_code == 200 and remote.json()["choices"] == inline.json()["choices"]
    assert seen[0] == [PNG] and seen[1][0].startswith("data:image/png;base64,")
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "messages[0].content[0].image_url"
    assert "private or loopback" in refused.json()["error"]["message"]


def test_a_video_fetch_has_its_own_cap_and_names_itself():
    async def run(url: str, max_bytes: int) -> bytes:
        f = fetcher(max_bytes=100)  # the image cap: a video fetch brings its own
        try:
            return await f.fetch(url, "video", max_bytes)
        finally:
            await f.aclose()

    assert asyncio.run(run("http://img.example.com/big.png", 8000)) == b"\0" * 5000
    with pytest.raises(MediaError, match="the remote video is larger than the limit of 1000 bytes"):
        asyncio.run(run("http://img.example.com/big.png", 1000))
    with pytest.raises(MediaError, match="fetching videos from host 'other.test' is not allowed"):
        asyncio.run(run("http://other.test/clip.mp4", 8000))
    with pytest.raises(MediaError, match="the video URL's host resolves to a private"):
        asyncio.run(run("http://inside.example.com/clip.mp4", 8000))
