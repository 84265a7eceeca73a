"""`mm-engine caption INPUT... --out results.jsonl`: the batch captioning command.

`mm_engine.cli` adds it with `add_caption_parser(subparsers, add_engine_args)`; `main` runs it on
its own (`python -m mm_engine.jobs.caption_cli INPUT... --out ...`) with the same arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable

from mm_engine.config import EngineConfig
from mm_engine.jobs.caption import DEFAULT_MAX_TOKENS, DEFAULT_PROMPT, caption_images

DESCRIPTION = """\
Caption every image named by the INPUTs into a JSONL file, one line per input as soon as it
finishes: {"id", "image", "prompt", "caption", "finish_reason", "prompt_tokens",
"completion_tokens"}, or {"id", "image", "error"} for an input that could not be captioned.
An INPUT is an image file, a folder (searched recursively, sorted; files with an image extension
or image content), a glob (quote it: 'photos/**/*.jpg'), or a JSONL manifest (.jsonl) with lines
{"image": path, "prompt": optional, "id": optional}. A summary goes to stdout as JSON at the end.
The exit status is non-zero only when the job could not run, never for a bad image."""


def add_caption_parser(subparsers, add_engine_args: Callable[[argparse.ArgumentParser], None]):
    """Add the `caption` subcommand; `add_engine_args` adds the engine flags (`--block-size`, ...)."""
    parser = subparsers.add_parser(
        "caption",
        help="caption many images (files, folders, globs, manifests) into a JSONL file",
        description=DESCRIPTION,
        conflict_handler="resolve",  # our --seed replaces the engine's, with the fuller help
    )
    _add_arguments(parser, add_engine_args)
    return parser


def _add_arguments(parser: argparse.ArgumentParser, add_engine_args) -> None:
    parser.add_argument(
        "inputs", nargs="+", metavar="INPUT", help="image or video file, folder, glob or manifest"
    )
    parser.add_argument("--fps", type=float, default=None, help="frames per second sampled from a clip")
    parser.add_argument("--max-frames", type=int, default=None, help="frames sampled from one clip, at most")
    parser.add_argument("--out", "-o", required=True, help="the results file (JSONL)")
    parser.add_argument(
        "--model", default=None, help="checkpoint folder or Hub name (default: embedded demo model)"
    )
    parser.add_argument(
        "--prompt",
        default=DEFAULT_PROMPT,
        help="a question put after the image with the chat template, or a raw prompt with <image>",
    )
    parser.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (the default) is greedy")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument(
        "--json-schema", default=None, metavar="SCHEMA.json",
        help='captions follow this JSON schema; each line has the parsed object as "json"',
    )  # fmt: skip
    parser.add_argument("--resume", action="store_true", help="skip inputs already in --out, append the rest")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    parser.add_argument("--workers", type=int, default=4, help="threads decoding and preprocessing images")
    parser.add_argument(
        "--shard", default=None, metavar="I/N", help="take only share I of N (0-based), disjoint and stable"
    )
    parser.add_argument(
        "--progress",
        choices=("auto", "bar", "log", "none"),
        default="auto",
        help="auto: a bar on a terminal, log lines otherwise",
    )
    parser.add_argument("--log-interval", type=float, default=10.0, help="seconds between log lines")
    add_engine_args(parser)
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="seeds the engine and each request's sampler: a sampled caption does not depend on "
        "its batch, shard or run",
    )
    parser.set_defaults(func=run_caption)


def run_caption(args: argparse.Namespace) -> int:
    engine_args = {
        f.name: getattr(args, f.name)
        for f in dataclasses.fields(EngineConfig)
        if f.name not in ("model", "seed") and hasattr(args, f.name)
    }
    try:
        summary = caption_images(
            args.inputs,
            args.out,
            prompt=args.prompt,
            model=args.model,
            max_tokens=args.max_tokens,
            temperature=args.temperature,
            top_p=args.top_p,
            seed=args.seed,
            json_schema=args.json_schema,
            resume=args.resume,
            overwrite=args.overwrite,
            workers=args.workers,
            shard=args.shard,
            progress=args.progress,
            log_interval=args.log_interval,
            fps=args.fps,
            max_frames=args.max_frames,
            **engine_args,
        )
    except KeyboardInterrupt:
        print(
            f"mm-engine caption: interrupted; finished lines are in {args.out}, rerun with --resume",
            file=sys.stderr,
        )
        return 130
    except (ValueError, OSError) as exc:  # the job could not run: one clear line, no traceback
        print(f"mm-engine caption: error: {exc}", file=sys.stderr)
        return 2
    print(summary.describe(), file=sys.stderr)
    print(json.dumps(summary.to_dict()))
    return 0


def main(argv: list[str] | None = None) -> int:
    from mm_engine.cli import add_engine_args  # here, not at the top: mm_engine.cli imports this module

    parser = argparse.ArgumentParser(
        prog="mm-engine caption", description=DESCRIPTION, conflict_handler="resolve"
    )
    _add_arguments(parser, add_engine_args)
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
