"""Who may call the API: the API key (401 in OpenAI's shape, constant-time compare, /health and
the playground page open, /metrics open unless asked), client-set priority only when the operator
allows it, cross-site posts refused by Origin, the Host checked against DNS rebinding, and no
schema page that loads scripts from a CDN."""

from __future__ import annotations

import argparse
import asyncio

import pytest
from litestar.testing import TestClient

from helpers.api import ENGINE_KW, image_bytes
from mm_engine.api.app import create_app
from mm_engine.api.server import add_serve_args, settings_from_args
from mm_engine.api.settings import ServerSettings
from mm_engine.async_llm import AsyncLLM

CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def llm(clip_llama):
    llm = AsyncLLM.from_engine_args(clip_llama, **ENGINE_KW)
    yield llm
    asyncio.run(llm.shutdown())


def _client(llm, **settings) -> TestClient:
    return TestClient(create_app(llm, ServerSettings(served_model_names=["m"], **settings)))


def test_the_api_key_is_needed_everywhere_but_health_and_the_playground(llm):
    with _client(llm, api_key="sesame") as c:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "sesame"}):
            r = c.get("/v1/models", headers=headers)
            assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
            assert r.json()["error"]["code"] == "invalid_api_key"
            assert r.json()["error"]["type"] == "invalid_request_error"
        assert c.post("/v1/chat/completions", json=CHAT).status_code == 401
        assert c.get("/schema/openapi.json").status_code == 401
        ok = {"authorization": "Bearer sesame"}
        assert c.get("/v1/models", headers=ok).status_code == 200
        assert c.post("/v1/chat/completions", json=CHAT, headers=ok).status_code == 200
        assert c.get("/health").status_code == 200
        page = c.get("/")
        assert page.status_code == 200 and 'id="api-key"' in page.text  # the page asks for it
        assert c.get("/metrics").status_code == 200
    with _client(llm, api_key="sesame", api_key_metrics=True) as c:
        assert c.get("/metrics").status_code == 401
        assert c.get("/metrics", headers={"authorization": "Bearer sesame"}).status_code == 200


def test_client_priority_is_refused_by_name_unless_the_operator_allows_it(llm):
    caption = {"files": [("image", ("a", image_bytes(1)))], "data": {"max_tokens": "2", "priority": "3"}}
    with _client(llm) as c:
        for r in (
            c.post("/v1/chat/completions", json={**CHAT, "priority": -5}),
            c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "priority": 2**31 - 1}),
            c.post("/v1/caption", **caption),
        ):
            assert r.status_code == 400 and r.json()["error"]["param"] == "priority", r.text
            assert "--allow-client-priority" in r.json()["error"]["message"]
        assert c.post("/v1/chat/completions", json={**CHAT, "priority": 0}).status_code == 200
    with _client(llm, allow_client_priority=True) as c:
        assert c.post("/v1/chat/completions", json={**CHAT, "priority": -5}).status_code == 200
        assert c.post("/v1/caption", **caption).status_code == 200


def test_a_cross_site_post_is_refused_by_its_origin(llm):
    evil = {"origin": "https://evil.example"}
    with _client(llm) as c:
        r = c.post("/v1/caption", files=[("image", ("a", image_bytes(1)))], headers=evil)
        assert r.status_code == 403 and r.json()["error"]["code"] == "cross_origin"
        assert c.post("/v1/chat/completions", json=CHAT, headers=evil).status_code == 403
        assert c.get("/v1/models", headers=evil).status_code == 200  # reading is not changing
        same = {"origin": str(c.base_url).rstrip("/")}  # the page this server itself served
        assert c.post("/v1/chat/completions", json=CHAT, headers=same).status_code == 200
    with _client(llm, allowed_origins=("https://evil.example/",)) as c:
        assert c.post("/v1/chat/completions", json=CHAT, headers=evil).status_code == 200


def test_only_the_allowed_hosts_are_answered(llm):
    with _client(llm, allowed_hosts=("localhost", "[::1]")) as c:
        r = c.get("/v1/models", headers={"host": "rebound.example:8000"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_host"
        assert c.get("/v1/models", headers={"host": "localhost:8000"}).status_code == 200
        assert c.get("/v1/models", headers={"host": "[::1]:8000"}).status_code == 200


def test_the_schema_is_served_as_data_without_cdn_pages(llm):
    with _client(llm) as c:
        assert c.get("/schema/openapi.json").status_code == 200
        assert c.get("/schema/openapi.yaml").status_code == 200
        for page in ("/schema/swagger", "/schema/redoc", "/schema/elements"):
            assert c.get(page).status_code == 404


def test_the_serve_flags_and_the_key_from_the_environment(monkeypatch):
    monkeypatch.setenv("MM_ENGINE_API_KEY", "from-env")
    p = argparse.ArgumentParser()
    add_serve_args(p)
    s = settings_from_args(
        p.parse_args(["--allowed-hosts", "a.example,b.example", "--allow-client-priority"]), "m"
    )
    assert (
        s.api_key == "from-env" and s.allow_client_priority and s.allowed_hosts == ("a.example", "b.example")
    )
    assert settings_from_args(p.parse_args(["--api-key", "flag"]), "m").api_key == "flag"
    with pytest.raises(ValueError, match="api_key"):
        ServerSettings(api_key=" ")
