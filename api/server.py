"""`mm-engine serve`: the Litestar app on uvicorn, with a draining shutdown.

SIGTERM (or a first Ctrl-C) does not stop the server at once: new requests get 503 (and /health
says "draining") while running ones get up to `--shutdown-timeout` seconds to finish; what is left
is then aborted and the process exits 0. A second signal exits immediately.

    mm-engine serve [MODEL] --host 127.0.0.1 --port 8000 [engine flags] [API flags]
    python -m mm_engine.api.server [MODEL] ...        (the same, without the `mm-engine` wrapper)
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
import sys
from collections.abc import Callable

from mm_engine.api.settings import ServerSettings
from mm_engine.batch.args import add_batch_args, batch_settings

_D = ServerSettings()


def add_serve_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "model", nargs="?", default=None, help="checkpoint folder or Hub name (default: demo model)"
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed on startup)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    p.add_argument("--no-access-log", action="store_true", help="do not log every request")
    g = p.add_argument_group("API")
    g.add_argument("--served-model-name", nargs="+", default=None,
                   help="name(s) clients use as `model` (default: the model folder's name)")  # fmt: skip
    g.add_argument("--allowed-media-domains", nargs="*", default=[],
                   help="hosts whose http(s) image URLs may be fetched ('*.example.com' for subdomains); "
                   "default: none, only data: URLs and uploads")  # fmt: skip
    g.add_argument("--media-fetch-timeout", type=float, default=_D.media_fetch_timeout)
    g.add_argument("--media-max-redirects", type=int, default=_D.media_max_redirects)
    g.add_argument("--max-body-bytes", type=int, default=_D.max_body_bytes)
    g.add_argument("--max-images-per-request", type=int, default=_D.max_images_per_request)
    g.add_argument("--max-image-pixels", type=int, default=_D.max_image_pixels,
                   help="width x height, checked from the header before decoding")  # fmt: skip
    g.add_argument("--min-image-side", type=int, default=_D.min_image_side)
    g.add_argument("--max-image-bytes", type=int, default=_D.max_image_bytes)
    g.add_argument("--allowed-image-formats", default=",".join(_D.allowed_image_formats).lower(),
                   help="comma-separated Pillow formats, identified by content")  # fmt: skip
    g.add_argument("--max-videos-per-request", type=int, default=_D.max_videos_per_request)
    g.add_argument("--max-video-bytes", type=int, default=_D.max_video_bytes)
    g.add_argument("--max-video-seconds", type=float, default=_D.max_video_seconds,
                   help="a clip's duration, read from its container before decoding")  # fmt: skip
    g.add_argument(
        "--max-video-frames", type=int, default=_D.max_video_frames, help="frames sampled from one clip"
    )
    g.add_argument("--max-stop-strings", type=int, default=_D.max_stop_strings)
    g.add_argument("--max-stop-length", type=int, default=_D.max_stop_length)
    g.add_argument("--default-max-tokens", type=int, default=_D.default_max_tokens)
    g.add_argument(
        "--max-prompts-per-request",
        type=int,
        default=_D.max_prompts_per_request,
        help="prompts in one /v1/completions request",
    )
    g.add_argument(
        "--max-sequences-per-request",
        type=int,
        default=_D.max_sequences_per_request,
        help="prompts x n in one request (each is a sequence in the engine)",
    )
    g.add_argument(
        "--max-sequences-per-client",
        type=int,
        default=_D.max_sequences_per_client,
        help="sequences in flight from one client address, over all its requests (0: no cap; behind "
        "a proxy every client shares the proxy's address)",
    )
    g.add_argument("--default-caption-prompt", default=_D.default_caption_prompt)
    g.add_argument("--header-timeout", type=float, default=_D.header_timeout,
                   help="seconds a client may take to send a request's head (then 408, closed)")  # fmt: skip
    g.add_argument("--body-timeout", type=float, default=_D.body_timeout,
                   help="seconds a client may go silent while sending a body (then 408, closed)")  # fmt: skip
    g.add_argument("--send-timeout", type=float, default=_D.send_timeout,
                   help="seconds a response may wait on a client that stopped reading (then the "
                   "connection is dropped and its request aborted)")  # fmt: skip
    g.add_argument("--shutdown-timeout", type=float, default=_D.shutdown_timeout,
                   help="seconds running requests get to finish after SIGTERM")  # fmt: skip
    g.add_argument("--health-stall-timeout", type=float, default=_D.health_stall_timeout)
    g.add_argument(
        "--api-key",
        default=os.environ.get("MM_ENGINE_API_KEY"),
        help="clients must send 'Authorization: Bearer <key>' on every route but /health "
        "and the playground page (default: $MM_ENGINE_API_KEY; none: no key)",
    )
    g.add_argument("--api-key-metrics", action="store_true", help="/metrics needs the API key too")
    g.add_argument(
        "--allow-client-priority",
        action="store_true",
        help="honour a request's `priority` (else a request that sets one is refused)",
    )
    g.add_argument(
        "--allowed-hosts",
        nargs="*",
        default=[],
        help="Host names the server answers for (default: any); against DNS rebinding",
    )
    g.add_argument(
        "--allowed-origins",
        nargs="*",
        default=[],
        help="other sites (https://app.example.com) whose pages may post to this server",
    )
    g.add_argument("--engine-core", choices=["process", "thread"], default="process",
                   help="run the engine core in a process of its own (default), or on a thread of "
                   "the server's process")  # fmt: skip
    g.add_argument("--engine-core-restart", action=argparse.BooleanOptionalAction, default=True,
                   help="restart a crashed engine-core process (at most --max-core-restarts times); "
                   "with --no-engine-core-restart the server exits with code 1 instead")  # fmt: skip
    g.add_argument("--max-core-restarts", type=int, default=3)
    g.add_argument("--data-parallel-size", type=int, default=1,
                   help="engine-core processes, each with the whole model; requests go to the least "
                   "loaded, or to the one that holds their image (--engine-core process)")  # fmt: skip
    g.add_argument("--api-server-count", type=int, default=1,
                   help="API-server processes on the one port, sharing the engine cores: each parses, "
                   "decodes images, tokenizes, detokenizes and streams for its connections "
                   "(--engine-core process)")  # fmt: skip
    g.add_argument("--input-workers", type=int, default=_D.input_workers,
                   help="threads that tokenize and decode images")  # fmt: skip
    g.add_argument("--light-input-bytes", type=int, default=_D.light_input_bytes,
                   help="requests whose text and images weigh at most this many bytes have "
                   "input workers of their own, so big ones cannot stall them")  # fmt: skip

    add_batch_args(p)


def add_serve_parser(subparsers, add_engine_args: Callable[[argparse.ArgumentParser], None]) -> None:
    """Add `serve` to the `mm-engine` command; `add_engine_args` adds the engine flags."""
    p = subparsers.add_parser("serve", help="serve the HTTP API (multipart captioning, OpenAI chat)")
    add_serve_args(p)
    add_engine_args(p)
    p.set_defaults(func=run_server)


def settings_from_args(args: argparse.Namespace, model_name: str) -> ServerSettings:
    domains = [d for entry in args.allowed_media_domains for d in entry.split(",") if d.strip()]
    return ServerSettings(
        served_model_names=args.served_model_name or [model_name],
        max_body_bytes=args.max_body_bytes,
        max_images_per_request=args.max_images_per_request,
        max_image_pixels=args.max_image_pixels,
        min_image_side=args.min_image_side,
        max_image_bytes=args.max_image_bytes,
        allowed_image_formats=tuple(f.strip() for f in args.allowed_image_formats.split(",") if f.strip()),
        max_videos_per_request=args.max_videos_per_request,
        max_video_bytes=args.max_video_bytes,
        max_video_seconds=args.max_video_seconds,
        max_video_frames=args.max_video_frames,
        max_stop_strings=args.max_stop_strings,
        max_stop_length=args.max_stop_length,
        default_max_tokens=args.default_max_tokens,
        default_caption_prompt=args.default_caption_prompt,
        allowed_media_domains=tuple(domains),
        media_fetch_timeout=args.media_fetch_timeout,
        media_max_redirects=args.media_max_redirects,
        header_timeout=args.header_timeout,
        body_timeout=args.body_timeout,
        send_timeout=args.send_timeout,
        shutdown_timeout=args.shutdown_timeout,
        health_stall_timeout=args.health_stall_timeout,
        input_workers=args.input_workers,
        light_input_bytes=args.light_input_bytes,
        max_prompts_per_request=args.max_prompts_per_request,
        max_sequences_per_request=args.max_sequences_per_request,
        max_sequences_per_client=args.max_sequences_per_client,
        api_key=args.api_key or None,
        api_key_metrics=args.api_key_metrics,
        allow_client_priority=args.allow_client_priority,
        allowed_hosts=tuple(_listed(args.allowed_hosts)),
        allowed_origins=tuple(_listed(args.allowed_origins)),
        **batch_settings(args),
    )


def _listed(entries: list[str]) -> list[str]:
    """`a b,c` -> [a, b, c]: a list flag takes spaces or commas."""
    return [x.strip() for entry in entries for x in entry.split(",") if x.strip()]


def _model_name(model: str | None) -> str:
    if model is None:
        return "mm-engine-demo"
    # The folder's name only: the full path would tell clients about the server's disk.
    return model.rstrip("/\\").replace("\\", "/").rsplit("/", 1)[-1] or "model"


def run_server(args: argparse.Namespace) -> int:
    if args.api_server_count < 1:
        raise ValueError(f"--api-server-count must be at least 1, got {args.api_server_count}")
    settings_name = (args.served_model_name or [_model_name(args.model)])[0]
    banner = f"mm-engine: serving {settings_name!r}"
    if args.api_server_count > 1:
        from mm_engine.api.supervisor import run_api_servers

        logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
        return run_api_servers(args, banner)
    llm, settings, exit_ = make_llm_and_settings(args)
    from mm_engine.api.supervisor import listen

    sock = listen(args.host, args.port)
    host, port = sock.getsockname()[:2]

    def serving() -> None:
        print(f"{banner} on http://{host}:{port}", flush=True)

    return serve_on(args, settings, llm, exit_, sock, on_serving=serving)


class _Exit:
    """The server's exit code, and the server to stop when the engine is dead for good."""

    code = 0
    server = None

    def dead(self) -> None:  # with --no-engine-core-restart, the server exits with code 1
        self.code = 1
        if self.server is not None:
            self.server.should_exit = True


def make_llm_and_settings(args: argparse.Namespace, attach: list | None = None, index: int = 0):
    """The engine client the app serves and the app's settings, from the serve flags. `attach`:
    the socket pair with each core, for one of several API servers (`index` among them)."""
    # Imported here, not at the top: `mm-engine generate` and friends import this module for the
    # parser alone and need none of the web stack.
    from mm_engine.api.metrics import Metrics
    from mm_engine.async_llm import AsyncLLM
    from mm_engine.cli import engine_kwargs
    from mm_engine.config import EngineConfig
    from mm_engine.engine.async_client import AsyncMPLLM
    from mm_engine.engine.llm_engine import LLMEngine

    settings = settings_from_args(args, _model_name(args.model))
    settings.api_server_index = index
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    config = EngineConfig.from_kwargs(args.model, **engine_kwargs(args))
    limits, video_limits = settings.image_limits(), settings.video_limits()
    common = dict(
        input_workers=settings.input_workers,
        light_input_bytes=settings.light_input_bytes,
        stall_timeout=settings.health_stall_timeout,
        listener=Metrics(config.max_num_seqs),
    )
    exit_ = _Exit()
    if args.engine_core == "process":
        restart = dict(
            restart=args.engine_core_restart, max_restarts=args.max_core_restarts, on_dead=exit_.dead
        )
        llm = AsyncMPLLM(
            config, image_limits=limits, video_limits=video_limits, **common, **restart,
            data_parallel_size=args.data_parallel_size, attach=attach, frontend_index=index,
        )  # fmt: skip
    elif args.data_parallel_size != 1:
        raise ValueError("--data-parallel-size needs --engine-core process")
    else:
        llm = AsyncLLM(LLMEngine(config, image_limits=limits, video_limits=video_limits), **common)
    return llm, settings, exit_


def serve_on(
    args: argparse.Namespace,
    settings: ServerSettings,
    llm,
    exit_: _Exit,
    sock: socket.socket,
    on_start=None,
    on_serving=None,
) -> int:
    """Serve the app on a listening socket until shut down; the exit code. `on_start(server)` runs
    before the server starts, `on_serving()` once it serves (DrainingServer)."""
    import uvicorn

    from mm_engine.api.app import create_app
    from mm_engine.api.draining_server import DrainingServer
    from mm_engine.api.timeouts import timed_h11_protocol

    app = create_app(llm, settings)
    uv_config = uvicorn.Config(
        app,
        http=timed_h11_protocol(settings.header_timeout, settings.body_timeout, settings.send_timeout),
        log_level=args.log_level,
        access_log=not args.no_access_log,
        timeout_graceful_shutdown=5,
        lifespan="on",
    )
    batches = app.state.ctx.batches  # (stopping a runner that never started does nothing)
    stop_first = batches and batches.stop
    server = DrainingServer(
        uv_config, llm, settings.shutdown_timeout, before_drain=stop_first, on_serving=on_serving
    )
    exit_.server = server
    if on_start is not None:
        on_start(server)
    try:
        server.run(sockets=[sock])
    finally:
        asyncio.run(llm.shutdown())
        sock.close()
    return exit_.code


def build_parser() -> argparse.ArgumentParser:
    from mm_engine.cli import add_engine_args

    parser = argparse.ArgumentParser(prog="mm-engine serve", description="Serve the HTTP API")
    add_serve_args(parser)
    add_engine_args(parser)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run_server(args)
    except (ValueError, OSError) as exc:  # user mistakes: one clear line, no traceback
        print(f"mm-engine serve: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
