"""Fetching remote images and videos, for hosts that `--allowed-media-domains` lists, and nothing else.

Defences against server-side request forgery: the host must be on the allow-list; it is resolved
here and every address must be public (no loopback, private, link-local, reserved ranges); the
connection goes to the address that was checked (so a second DNS answer cannot swap in a private
one); redirects are followed by hand, each hop checked again; size and total time are capped.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Awaitable, Callable, Sequence

import httpx

Resolver = Callable[[str, int], Awaitable[list[str]]]


class MediaError(ValueError):
    """A remote image or video could not be used; the message is safe to show to the client."""


async def resolve(host: str, port: int) -> list[str]:
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError:
        raise MediaError("the URL's host could not be resolved") from None
    return [info[4][0] for info in infos]


def is_public(address: str) -> bool:
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_global and not ip.is_multicast


def host_allowed(host: str, allowed: Sequence[str]) -> bool:
    """Exact host names, or `*.example.com` for the subdomains of example.com."""
    host = host.lower().rstrip(".")
    for entry in allowed:
        if entry.startswith("*."):
            if host.endswith(entry[1:]):
                return True
        elif host == entry:
            return True
    return False


class MediaFetcher:
    def __init__(
        self,
        allowed_domains: Sequence[str],
        max_bytes: int,
        timeout: float,
        max_redirects: int = 3,
        *,
        resolver: Resolver = resolve,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.allowed = tuple(allowed_domains)
        self.max_bytes = max_bytes
        self.timeout = timeout
        self.max_redirects = max_redirects
        self._resolve = resolver
        # No proxies from the environment: they would connect somewhere we did not check.
        self._client = httpx.AsyncClient(
            transport=transport, follow_redirects=False, trust_env=False, timeout=timeout
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    def check_allowed(self, url: str, media: str = "image") -> httpx.URL:
        """The parsed URL if its scheme and host may be fetched at all, else MediaError."""
        try:
            parsed = httpx.URL(url)
        except (httpx.InvalidURL, TypeError, ValueError):
            raise MediaError(f"the {media} URL is not a valid URL") from None
        if parsed.scheme not in ("http", "https"):
            raise MediaError(f"{media} URLs must be data: URLs, or http(s) URLs of allowed hosts")
        if parsed.userinfo:
            raise MediaError(f"{media} URLs must not carry credentials")
        if not parsed.host or not host_allowed(parsed.host, self.allowed):
            raise MediaError(
                f"fetching {media}s from host {parsed.host[:100]!r} is not allowed "
                "(the server's --allowed-media-domains does not list it)"
            )
        return parsed

    async def fetch(self, url: str, media: str = "image", max_bytes: int | None = None) -> bytes:
        """The body at `url`, at most `max_bytes` (default: the fetcher's cap); `media` (image or
        video) names what it is in errors."""
        try:
            return await asyncio.wait_for(self._fetch(url, media, max_bytes or self.max_bytes), self.timeout)
        except (TimeoutError, asyncio.TimeoutError):
            raise MediaError(f"fetching the {media} took longer than {self.timeout:g} s") from None
        except httpx.HTTPError:
            raise MediaError(f"fetching the {media} failed") from None

    async def _fetch(self, url: str, media: str, max_bytes: int) -> bytes:
        for _ in range(self.max_redirects + 1):
            target = self.check_allowed(url, media)
            port = target.port or (443 if target.scheme == "https" else 80)
            addresses = await self._resolve(target.host, port)
            if not addresses or not all(is_public(a) for a in addresses):
                raise MediaError(f"the {media} URL's host resolves to a private or loopback address")
            host_header = target.host if target.port is None else f"{target.host}:{target.port}"
            extensions = {"sni_hostname": target.host} if target.scheme == "https" else {}
            request = self._client.build_request(
                "GET",
                target.copy_with(host=addresses[0]),
                # Compressed bodies could expand past the cap inside one chunk: ask for none.
                headers={"Host": host_header, "Accept": f"{media}/*", "Accept-Encoding": "identity"},
                extensions=extensions,
            )
            response = await self._client.send(request, stream=True)
            try:
                if response.is_redirect:
                    location = response.headers.get("location")
                    if not location:
                        raise MediaError(f"the {media} URL redirects nowhere")
                    url = str(target.join(location))
                    continue
                if response.status_code != 200:
                    raise MediaError(
                        f"fetching the {media} failed: the server answered {response.status_code}"
                    )
                return await self._read_capped(response, media, max_bytes)
            finally:
                await response.aclose()
        raise MediaError(f"the {media} URL redirects more than {self.max_redirects} times")

    async def _read_capped(self, response: httpx.Response, media: str, max_bytes: int) -> bytes:
        too_big = MediaError(f"the remote {media} is larger than the limit of {max_bytes} bytes")
        if response.headers.get("content-encoding", "identity").lower() != "identity":
            raise MediaError(f"the remote {media} was sent compressed; only plain bodies are accepted")
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > max_bytes:
            raise too_big
        data = bytearray()
        async for chunk in response.aiter_raw():
            data += chunk
            if len(data) > max_bytes:
                raise too_big
        return bytes(data)
