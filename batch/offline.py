"""`mm-engine run-batch -i requests.jsonl -o results.jsonl`: a file of OpenAI batch lines run on an
engine in this process, through the same handlers as the server's batches (batch/job.py).

Each answer is appended to the output as it comes (successes and failures in one file, vLLM's
layout: a failure has `response.status_code` >= 400, a line that could not run has `error` with its
line number). Run it again on the same output to resume: lines already answered are kept and not
run again; `--overwrite` starts over.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from pathlib import Path

from mm_engine.api.settings import ServerSettings


def add_run_batch_parser(subparsers, add_engine_args) -> None:
    p = subparsers.add_parser("run-batch", help="run a file of OpenAI batch requests (JSONL) offline")
    p.add_argument("-i", "--input-file", required=True, help="batch requests, one JSON object per line")
    p.add_argument("-o", "--output-file", required=True, help="results, one JSON object per line")
    p.add_argument("--model", default=None, help="checkpoint folder or Hub name (default: demo model)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="names a line's `model` may give (default: the model folder's name)")  # fmt: skip
    p.add_argument("--max-in-flight", type=int, default=256, help="sequences in the engine at once")
    p.add_argument("--overwrite", action="store_true", help="start over instead of resuming the output")
    p.add_argument("--allowed-media-domains", nargs="*", default=[],
                   help="hosts whose http(s) images may be fetched (default: data: URLs only)")  # fmt: skip
    p.add_argument("--max-line-bytes", type=int, default=ServerSettings().max_body_bytes)
    p.add_argument("--no-progress", action="store_true")
    add_engine_args(p)
    p.set_defaults(func=cmd_run_batch)


def cmd_run_batch(args: argparse.Namespace) -> int:
    from mm_engine.api.server import _model_name

    if args.max_in_flight < 1:
        raise ValueError(f"--max-in-flight must be at least 1, got {args.max_in_flight}")
    source, target = Path(args.input_file), Path(args.output_file)
    if not source.is_file():
        raise ValueError(f"no input file {str(source)!r}")
    if args.overwrite:
        target.unlink(missing_ok=True)
    names = args.served_model_name or [_model_name(args.model)]
    domains = tuple(args.allowed_media_domains)
    settings = ServerSettings(served_model_names=names, allowed_media_domains=domains,
                              max_body_bytes=args.max_line_bytes)  # fmt: skip
    return asyncio.run(_run(args, source, target, settings))


async def _run(args: argparse.Namespace, source: Path, target: Path, settings: ServerSettings) -> int:
    from mm_engine.api.context import ServerContext
    from mm_engine.api.media import MediaFetcher
    from mm_engine.api.metrics import Metrics
    from mm_engine.async_llm import AsyncLLM
    from mm_engine.batch.job import InFlight, report_refused, run_lines
    from mm_engine.batch.lines import NotJSONL, read_lines
    from mm_engine.batch.results import ResultFile
    from mm_engine.cli import engine_kwargs

    out = ResultFile.open(target)
    if out.lines:
        print(f"resuming: {out.lines} lines of {target} already answered", file=sys.stderr)
    try:
        total = report_refused(read_lines(source, None, settings.max_body_bytes), out)
    except NotJSONL as exc:
        out.close()
        raise ValueError(str(exc)) from None
    llm = AsyncLLM.from_engine_args(args.model, **engine_kwargs(args))
    fetcher = MediaFetcher(settings.allowed_media_domains, settings.max_image_bytes,
                           settings.media_fetch_timeout, settings.media_max_redirects)  # fmt: skip
    ctx = ServerContext(llm, settings, Metrics(llm.model_info.max_num_seqs), fetcher)
    progress = None if args.no_progress else asyncio.create_task(_progress(out, total))
    try:
        lines = read_lines(source, None, settings.max_body_bytes)
        await run_lines(ctx, lines, out, out, 0, InFlight(args.max_in_flight))
    finally:
        if progress is not None:
            progress.cancel()
        out.close()
        await fetcher.aclose()
        await llm.shutdown()
    print(f"{out.lines} of {total} lines answered, {out.failed} failed: {target}", file=sys.stderr)
    return 0


async def _progress(out, total: int) -> None:
    from tqdm import tqdm

    with contextlib.suppress(asyncio.CancelledError), tqdm(total=total, unit="req", file=sys.stderr) as bar:
        while True:
            bar.update(out.lines - bar.n)
            await asyncio.sleep(0.5)
