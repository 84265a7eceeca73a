"""Batch captioning: stream many images through one engine, one JSON line per input.

    inputs -> [worker threads: read, decode, check, preprocess] -> engine (continuous batching)
           -> results.jsonl, one line per input as soon as it finishes, flushed

Memory stays bounded whatever the number of images: at most `prefetch` images are decoded ahead
and at most `max_in_flight` (2 x max_num_seqs) requests are in the engine; new requests are
added before every step, so the batch stays full as captions finish at different lengths.

The prompt: a prompt that contains the model's image placeholder (`<image>`) is used as is, like
`LLM.generate`; any other prompt is a question, put after the image in one user message rendered
with the model's chat template, like `LLM.chat` (and `mm-engine generate`). A model without a chat
template needs the placeholder in the prompt.
"""

from __future__ import annotations

import itertools
import json
import os
import time
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from mm_engine.jobs.caption_inputs import CaptionInput, check_output, discover, in_shard, parse_shard
from mm_engine.jobs.caption_report import CaptionSummary, Tally, progress_mode
from mm_engine.sampling_params import SamplingParams, StructuredOutputs
from mm_engine.sched.scheduler import QueueFullError
from mm_engine.vision.image_io import load_image

DEFAULT_PROMPT = "Describe the image."
DEFAULT_MAX_TOKENS = 64


class Captioner:
    """Caption `CaptionInput`s with an engine already loaded; `run` yields one record per input.

    Reusable across calls (a notebook, a Ray Data actor's batches). `llm` is an `LLM` or an
    `LLMEngine`; the engine is single-threaded, so one `run` at a time.
    """

    def __init__(
        self,
        llm: Any,
        prompt: str = DEFAULT_PROMPT,
        params: SamplingParams | None = None,
        workers: int = 4,
        max_in_flight: int | None = None,
        prefetch: int | None = None,
        video_options: dict | None = None,
    ) -> None:
        self.engine = getattr(llm, "engine", llm)
        self.inputs = self.engine.inputs
        self.params = params or SamplingParams(max_tokens=DEFAULT_MAX_TOKENS, temperature=0.0)
        self.params.validate()
        self.inputs.check_structured_outputs(self.params)  # a schema that cannot work fails the job now
        so = self.params.structured_outputs
        self.parse_json = so is not None and (so.json is not None or so.json_object)
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self.workers = workers
        config = self.engine.config
        # Twice the batch: a full batch running and as many waiting to replace finished ones at once.
        self.max_in_flight = max_in_flight or min(
            2 * config.max_num_seqs, config.max_num_seqs + getattr(config, "max_waiting_requests", 1 << 30)
        )
        self.prefetch = prefetch or max(2 * workers, 8)
        self.prompt = prompt
        self.video_options = dict(video_options or {})  # a clip's sampling (fps, max_frames)
        self._prompts: dict[tuple[str, bool], tuple[str, list[int], bool]] = {}
        self.prompt_ids(prompt)  # a job whose own prompt cannot work fails before any image

    def prompt_ids(self, prompt: str, video: bool = False) -> tuple[str, list[int], bool]:
        """The full prompt text, its token ids, with one image (or video) placeholder, and
        whether tokenizing it adds the special tokens (not after a chat template): tokenized
        once per distinct prompt (most jobs have a single one), not once per input."""
        if (prompt, video) in self._prompts:
            return self._prompts[prompt, video]
        inputs = self.inputs
        tok = inputs.tokenizer
        placeholder, token_id = inputs.image_token, inputs.image_token_id
        if video:
            if inputs.processing.video_token is None:
                inputs.processing.video_sampling()  # the family says why it reads no video
            placeholder, token_id = inputs.processing.video_token, inputs.processing.video_token_id
        if placeholder in prompt:
            text, ids, special = prompt, tok(prompt)["input_ids"], True
        elif inputs.chat_template is not None:
            part = {"type": "video" if video else "image"}
            message = {"role": "user", "content": [part, {"type": "text", "text": prompt}]}
            text = tok.apply_chat_template(
                [message], chat_template=inputs.chat_template, tokenize=False, add_generation_prompt=True
            )
            ids = tok(text, add_special_tokens=False)["input_ids"]  # the template wrote BOS already
            special = False
        else:
            raise ValueError(f"this model has no chat template: the prompt must contain {placeholder}")
        in_text = video and inputs.processing.video_in_text  # a clip written into the text, not the ids
        if (text.count(placeholder) if in_text else ids.count(token_id)) != 1:
            kind = "video" if video else "image"
            raise ValueError(f"the prompt must contain exactly one {kind} placeholder {placeholder}")
        if len(self._prompts) >= 1024:  # many distinct manifest prompts: keep the cache bounded
            self._prompts.clear()
        self._prompts[prompt, video] = (text, ids, special)
        return text, ids, special

    def _prepare(self, inp: CaptionInput, text: str, ids: list[int], special: bool):
        """On a worker thread: read, decode and check the image, preprocess it, expand the ids."""
        source = inp.data if inp.data is not None else Path(inp.path or "")
        if inp.video and self.inputs.processing.video_in_text:  # the clip's text, then tokenized
            return text, *self.inputs.tokenize(text, [], self.video_options, [source], special)
        if inp.video:  # decoded, sampled and checked by the input processor
            data = {"video": source}
            return self.inputs.process(
                {"prompt": text, "prompt_token_ids": ids, "multi_modal_data": data,
                 "mm_processor_kwargs": self.video_options}
            )  # fmt: skip
        image = load_image(source, self.inputs.limits, name="input")
        return self.inputs.process(
            {"prompt": text, "prompt_token_ids": ids, "multi_modal_data": {"image": image}}
        )

    def _submit(self, pool: ThreadPoolExecutor, inp: CaptionInput) -> tuple[CaptionInput, str, Future]:
        prompt = inp.prompt if inp.prompt is not None else self.prompt
        try:
            if inp.error is not None:
                raise ValueError(inp.error)
            text, ids, special = self.prompt_ids(prompt, inp.video)
        except ValueError as exc:  # failed before any image is read: goes out the same way
            failed: Future = Future()
            failed.set_exception(exc)
            return inp, prompt, failed
        return inp, prompt, pool.submit(self._prepare, inp, text, ids, special)

    def run(self, inputs: Iterable[CaptionInput]) -> Iterator[dict]:
        """Yield a result record per input, in the order they finish (not the input order)."""
        source = iter(inputs)
        pending: deque[tuple[CaptionInput, str, Future]] = deque()  # being decoded, in input order
        live: dict[str, tuple[CaptionInput, str]] = {}  # request id -> input, in the engine
        with ThreadPoolExecutor(self.workers, thread_name_prefix="caption") as pool:
            try:
                while True:
                    for inp in itertools.islice(source, self.prefetch - len(pending)):
                        pending.append(self._submit(pool, inp))
                    exhausted = len(pending) < self.prefetch
                    # Admit decoded images; wait for one only when the engine would otherwise idle.
                    while pending and len(live) < self.max_in_flight and (pending[0][2].done() or not live):
                        inp, prompt, future = pending[0]
                        try:
                            rid = self.engine.add_processed(*future.result(), self.params)
                        except QueueFullError:  # an engine shared with others: retry after a step
                            break
                        except Exception as exc:  # a bad image, or a prompt too long for the KV pools
                            pending.popleft()
                            yield error_record(inp, _message(exc))
                            continue
                        pending.popleft()
                        live[rid] = (inp, prompt)
                    if exhausted and not pending and not live:
                        return
                    if self.engine.has_unfinished():
                        for out in self.engine.step():
                            if out.finished and out.request_id in live:
                                yield caption_record(*live.pop(out.request_id), out, self.parse_json)
            finally:  # stopped early (an error, Ctrl-C, the caller closed us): leave the engine clean
                for _, _, future in pending:
                    future.cancel()
                for rid in live:
                    self.engine.abort(rid)


def caption_record(inp: CaptionInput, prompt: str, out, parse_json: bool = False) -> dict:
    c = out.outputs[0]
    rec = {
        "id": inp.id,
        "video" if inp.video else "image": inp.image,
        "prompt": prompt,
        "caption": c.text,
        "finish_reason": c.finish_reason,
        "prompt_tokens": len(out.prompt_token_ids),
        "completion_tokens": len(c.token_ids),
    }
    if parse_json:  # --json-schema: the parsed object too (the grammar made it valid, unless cut short)
        try:
            rec["json"] = json.loads(c.text, strict=False)
        except json.JSONDecodeError:
            rec["json"] = None
            rec["json_error"] = f"the caption is not complete JSON (finish_reason {c.finish_reason})"
    return rec


def error_record(inp: CaptionInput, message: str) -> dict:
    return {"id": inp.id, "video" if inp.video else "image": inp.image, "error": message}


def _message(exc: Exception) -> str:
    # ImageError and the engine's ValueErrors are written for users; anything else is a surprise
    # whose text may carry paths or addresses, so only its type is recorded.
    if isinstance(exc, ValueError):
        return str(exc)
    return f"unexpected {type(exc).__name__} while preparing the image"


def caption_images(
    inputs: str | os.PathLike | Iterable[str | os.PathLike],
    out: str | os.PathLike,
    *,
    prompt: str = DEFAULT_PROMPT,
    model: str | None = None,
    llm: Any = None,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    json_schema: dict | str | os.PathLike | None = None,
    resume: bool = False,
    overwrite: bool = False,
    workers: int = 4,
    shard: str | tuple[int, int] | None = None,
    progress: str | bool = "auto",
    log_interval: float = 10.0,
    fps: float | None = None,
    max_frames: int | None = None,
    **engine_args: Any,
) -> CaptionSummary:
    """Caption every image named by `inputs` (files, folders, globs, JSONL manifests) into the JSONL
    file `out`; return the summary. The same code runs `mm-engine caption`.

    `seed` seeds the engine and every request's sampler, so a sampled caption (temperature > 0)
    does not depend on the batch, shard or resumed run it fell in. `json_schema` (a dict, or the
    path of a JSON file): every caption follows it, and each line gets the parsed object as "json".
    `llm`: an `LLM` already loaded
    (then `model` and `engine_args` are not used). `progress`: "auto" (a bar on a terminal, log
    lines otherwise), "bar", "log" or "none". `fps`, `max_frames`: how clips are sampled (None:
    the model's default). Raises ValueError/OSError when the job cannot run;
    a bad image is an error line, never an exception.
    """
    start = time.perf_counter()
    if llm is not None and (model is not None or engine_args):
        raise TypeError("pass either llm (already loaded) or model and engine arguments, not both")
    if workers < 1:
        raise ValueError(f"workers must be at least 1, got {workers}")
    specs = [inputs] if isinstance(inputs, str | os.PathLike) else list(inputs)
    shard_spec = parse_shard(shard)
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, seed=seed,
                            structured_outputs=_schema_outputs(json_schema))  # fmt: skip
    mode = progress_mode(progress)
    selected = [inp for inp in discover(specs) if in_shard(inp.id, shard_spec)]
    out_path = Path(out)
    done = check_output(out_path, resume, overwrite)
    todo = [inp for inp in selected if inp.id not in done]
    tally = Tally(total=len(selected), skipped=len(selected) - len(todo))

    # Opened before the model loads so that an unwritable path fails at once; emptied (overwrite)
    # only once the model has loaded, so a job that cannot start destroys nothing.
    with open(out_path, "a", encoding="utf-8") as f:
        if todo and llm is None:
            from mm_engine.llm import LLM

            llm = LLM(model, seed=seed, **engine_args)
        video = {k: v for k, v in (("fps", fps), ("max_frames", max_frames)) if v is not None}
        captioner = Captioner(llm, prompt, params, workers, video_options=video) if todo else None
        if overwrite:
            f.truncate(0)
        loaded = time.perf_counter() if captioner is not None else start  # no model needed: no load
        if captioner is not None:
            tally.start_reporting(mode, log_interval)
            try:
                for rec in captioner.run(todo):
                    # ensure_ascii (the default) keeps odd file names (surrogates) writable as UTF-8
                    f.write(json.dumps(rec) + "\n")
                    f.flush()  # a killed job loses only the requests in flight
                    tally.add(rec)
            finally:
                tally.close()
    return tally.summary(time.perf_counter() - start, loaded - start, str(out_path))


def _schema_outputs(schema: dict | str | os.PathLike | None) -> StructuredOutputs | None:
    if schema is None:
        return None
    if not isinstance(schema, dict):
        try:
            schema = json.loads(Path(schema).read_text(encoding="utf-8"))
        except json.JSONDecodeError as exc:
            raise ValueError(f"the JSON schema file {Path(schema).name} is not JSON: {exc.msg}") from None
    if not isinstance(schema, dict):
        raise ValueError("a JSON schema must be a JSON object")
    return StructuredOutputs(json=schema)
