"""HTTP API (Litestar): multipart uploads and OpenAI-compatible routes.

    app.py             create_app(async_llm, settings): the Litestar app
    server.py          `mm-engine serve` / `python -m mm_engine.api.server`: flags, start-up
    draining_server.py uvicorn's server with the SIGTERM drain
    routes_caption.py  POST /v1/caption (multipart)
    routes_chat.py     POST /v1/chat/completions (OpenAI)
    routes_misc.py     GET /v1/models, /v1/models/{model}, /health, /metrics
    schemas.py, openai_schemas.py   msgspec Structs of every body
    access.py          the API key, Origin and allowed-hosts checks (before any route)
    errors.py          OpenAI-shaped errors, sanitized messages
    limits.py, settings.py          request limits and their defaults
    media.py           remote image fetching (allow-list, SSRF checks)
    metrics.py         Prometheus metrics (mm_engine:*)
    streaming.py       server-sent events and client-disconnect handling
    timeouts.py        uvicorn's h11 protocol with header, body and send timeouts

Nothing is imported here, so `import mm_engine.api.server` for the CLI stays cheap.
"""
