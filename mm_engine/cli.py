"""The `mm-engine` command. Engine arguments become flags automatically from `EngineConfig`, so
every subcommand takes the same ones (`--block-size`, `--kv-cache-memory-bytes`, ...)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import types
import typing
from pathlib import Path

from mm_engine.api.server import add_serve_parser
from mm_engine.batch.offline import add_run_batch_parser
from mm_engine.config import EngineConfig
from mm_engine.jobs.caption_cli import add_caption_parser

# Where a command differs from the library's default: a command owns its process, a library
# caller does not.
COMMAND_DEFAULTS = {"cpu_tune_malloc": True}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    hints = typing.get_type_hints(EngineConfig)
    for f in dataclasses.fields(EngineConfig):
        if f.name == "model":
            continue
        default = COMMAND_DEFAULTS.get(f.name, f.default)
        kind = hints[f.name]
        if isinstance(kind, types.UnionType):  # `int | None` and the like
            kind = next(a for a in typing.get_args(kind) if a is not type(None))
        flag = "--" + f.name.replace("_", "-")
        if kind is bool:  # --enable-prefix-caching / --no-enable-prefix-caching
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        elif kind is dict:  # --mm-processor-kwargs '{"max_pixels": 1003520}'
            group.add_argument(flag, type=_json_object, default=default, help="a JSON object")
        else:
            group.add_argument(flag, type=kind, default=default, help=f"default: {default}")


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(f"not valid JSON: {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {f.name: getattr(args, f.name) for f in dataclasses.fields(EngineConfig) if f.name != "model"}


def cmd_generate(args: argparse.Namespace) -> int:
    from mm_engine import LLM, SamplingParams

    llm = LLM(args.model, **engine_kwargs(args))
    params = SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed_sampling
    )
    images = [Path(p).read_bytes() for p in args.image]
    start = time.perf_counter()
    if llm.engine.inputs.image_token in args.prompt or llm.engine.inputs.chat_template is None:
        out = llm.generate({"prompt": args.prompt, "multi_modal_data": {"image": images}}, params)[0]
    else:  # a plain question: let the chat template place the images
        parts = [{"type": "image_url", "image_url": {"url": _data_url(p)}} for p in args.image]
        message = {"role": "user", "content": [*parts, {"type": "text", "text": args.prompt}]}
        out = llm.chat([message], params)[0]
    elapsed = time.perf_counter() - start
    c = out.outputs[0]
    if args.json:
        print(json.dumps({"text": c.text, "token_ids": c.token_ids, "finish_reason": c.finish_reason}))
    else:
        print(c.text)
        print(
            f"[{len(out.prompt_token_ids)} prompt tokens, {len(c.token_ids)} generated, "
            f"finish_reason={c.finish_reason}, {elapsed:.2f} s]",
            file=sys.stderr,
        )
    return 0


def cmd_env(args: argparse.Namespace) -> int:
    from mm_engine.models.platform import environment

    env = environment()
    if args.json:
        print(json.dumps(env, indent=2))
        return 0
    width = max(map(len, env))
    for key, value in env.items():
        if isinstance(value, list):
            value = ", ".join(map(str, value)) or "-"
        elif isinstance(value, dict):
            value = (
                "; ".join(f"{k}: {', '.join(v) if isinstance(v, list) else v}" for k, v in value.items())
                or "-"
            )
        print(f"{key:<{width}}  {value}")
    if env["variant"] is None:
        print("\nno CPU C kernels: the engine runs the plain torch path on CPU", file=sys.stderr)
    return 0


def _data_url(path: str) -> str:
    import base64

    suffix = Path(path).suffix.lower().lstrip(".") or "png"
    kind = {"jpg": "jpeg"}.get(suffix, suffix)
    return f"data:image/{kind};base64," + base64.b64encode(Path(path).read_bytes()).decode()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mm-engine", description="Multimodal LLM serving engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="answer one prompt about zero or more images")
    gen.add_argument(
        "--model", default=None, help="checkpoint folder or Hub name (default: embedded demo model)"
    )
    gen.add_argument("--image", action="append", default=[], help="an image file; repeat for several")
    gen.add_argument(
        "--prompt", default="Describe the image.", help="a question, or a raw prompt with <image>"
    )
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed-sampling", type=int, default=None, help="per-request sampling seed")
    gen.add_argument("--json", action="store_true", help="print the result as JSON")
    add_engine_args(gen)
    gen.set_defaults(func=cmd_generate)
    env = sub.add_parser("env", help="print the platform: torch, CPU features, kernel variant, compiler")
    env.add_argument("--json", action="store_true", help="print it as JSON")
    env.set_defaults(func=cmd_env)
    add_caption_parser(sub, add_engine_args)
    add_serve_parser(sub, add_engine_args)
    add_run_batch_parser(sub, add_engine_args)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, OSError) as exc:  # user mistakes: one clear line, no traceback
        print(f"mm-engine: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
