"""schemathesis generates requests from the app's OpenAPI schema (a bounded, derandomized number of
examples per operation); no answer may be a 5xx, and every error keeps the OpenAI shape."""

from __future__ import annotations

import asyncio

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from helpers.api import ENGINE_KW
from mm_engine.api.app import create_app
from mm_engine.api.settings import ServerSettings
from mm_engine.async_llm import AsyncLLM

EXAMPLES = 30


@pytest.fixture(scope="module")
def schema(clip_llama):
    # A short context keeps every generated request fast, whatever max_tokens it asks for.
    llm = AsyncLLM.from_engine_args(clip_llama, **{**ENGINE_KW, "max_model_len": 64})
    app = create_app(llm, ServerSettings(served_model_names=["tiny"], default_max_tokens=4))
    yield schemathesis.openapi.from_asgi("/schema/openapi.json", app)
    asyncio.run(llm.shutdown())


@pytest.mark.slow
def test_generated_requests_never_get_a_5xx(schema):
    operations = [result.ok() for result in schema.get_all_operations()]
    paths = {"/v1/caption", "/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize", "/health"}
    assert {op.path for op in operations} >= paths
    for op in operations:

        @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                  suppress_health_check=list(HealthCheck))  # fmt: skip
        @given(case=op.as_strategy())
        def check(case):
            response = case.call()
            assert response.status_code < 500, f"{case.method} {case.path}: {response.text[:300]}"
            if response.status_code >= 400 and case.path != "/health":
                assert set(response.json()["error"]) == {"message", "type", "param", "code"}

        check()
