"""The two contestants of bench.offline, each run in a fresh process so that its peak memory is its
own: mm-engine's `LLM.generate` and transformers' `generate` (AutoModelForImageTextToText: the
checkpoint's own family class).

A run gets the model path and the requests (image index, prompt, output length), loads, warms up
on one short request (first-call costs of the matmul library are nobody's throughput), then times
the whole job, image preprocessing included, and returns the tokens, the seconds and the peak RSS.
It also measures the machine's matmul rate just before and just after the job, in the same
process: on a shared machine whose speed drifts by 15-40% over minutes, the rate next to the run
is the one its compute-floor fraction should be taken against.
"""

from __future__ import annotations

import multiprocessing
import os
import resource
import time
from collections import defaultdict
from dataclasses import dataclass

import numpy as np
import torch

from bench import vlm
from bench.machine import matmul_flops_per_s


@dataclass(frozen=True)
class Job:
    model: str
    threads: int
    num_images: int
    seed: int
    requests: list[tuple[int, str, int]]  # (image index, prompt, output tokens)
    engine_args: dict
    hf_batch_size: int = 8
    profile: bool = False
    rate_sizes: tuple[int, ...] = (1024, 2048, 3072)  # matmul sizes of the rate measured next to a run
    device: str = "cpu"
    dtype: str = "float32"  # both contestants' weights and activations (vision tower too)
    json_schema: dict | None = None  # the engine's outputs constrained to it (structured output)
    video: bool = False  # each request is a clip (bench.vlm.clips), not an image
    pages: bool = False  # each image a document page (bench.vlm.pages)


def run_in_child(fn, job: Job) -> dict:
    """`fn(job)` in a spawned process (fresh heap, fresh thread pool). With
    `MM_ENGINE_BENCH_IN_PROCESS=1` (the tests of the bench tools) it runs in this process instead:
    the same code, without a process start and an import of torch and transformers per run, and
    figures that are not clean."""
    if os.environ.get("MM_ENGINE_BENCH_IN_PROCESS") == "1":
        threads = torch.get_num_threads()
        try:
            return fn(job)
        finally:
            torch.set_num_threads(threads)
    pool = multiprocessing.get_context("spawn").Pool(1)
    try:
        return pool.apply(fn, (job,))
    finally:
        # close + join lets the worker exit on its own; the context manager's terminate() killed
        # it mid-shutdown and left its semaphores to the resource tracker's "leaked" warning.
        pool.close()
        pool.join()


def _peak_memory(job: Job) -> dict:
    """Peak RSS (Linux reports KiB), and on a GPU the peak of torch's allocations there."""
    peak = {"peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}
    if job.device != "cpu":
        peak["peak_gpu_mib"] = torch.cuda.max_memory_allocated(job.device) / 1024**2
    return peak


def engine_run(job: Job) -> dict:
    from mm_engine import LLM, SamplingParams
    from mm_engine.sampling_params import StructuredOutputs

    torch.set_num_threads(job.threads)
    media = _media(job)
    engine_args = {"cpu_tune_malloc": True, **job.engine_args}  # as `mm-engine` runs it
    engine_args = {"vision_dtype": job.dtype, **engine_args}  # --vision-dtype may set the tower's own
    llm = LLM(job.model, device=job.device, dtype=job.dtype, **engine_args)
    warm = {"prompt": job.requests[0][1], "multi_modal_data": _engine_media(job, _warm_media(job))}
    so = None if job.json_schema is None else StructuredOutputs(json=job.json_schema)
    # (with a schema, the warm-up also compiles its grammar: compiles are cached per schema)
    llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True, structured_outputs=so))
    prompts = [{"prompt": p, "multi_modal_data": _engine_media(job, media[i])} for i, p, _ in job.requests]
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, structured_outputs=so)
        for _, _, n in job.requests
    ]
    timers = _profile(llm.engine) if job.profile else None
    outs, seconds, rates = _timed(job, lambda: llm.generate(prompts, params))
    result = {
        "seconds": seconds,
        "matmul_flops_per_s": rates,
        "tokens": [list(o.outputs[0].token_ids) for o in outs],
        "texts": [o.outputs[0].text for o in outs],
        "finish_reasons": [o.outputs[0].finish_reason for o in outs],
        "prompt_ids": [list(o.prompt_token_ids) for o in outs],
        "cached_tokens": sum(o.num_cached_tokens or 0 for o in outs),
        "encoded_images": llm.engine.stats()["num_encoded_images_total"] - 1,  # minus the warm-up's
        **_peak_memory(job),
    }
    llm.close()  # with multiprocess=True: stop the engine-core process
    if timers is not None:
        timers["other"] = seconds - sum(timers.values())
        result["profile"] = dict(timers)
    return result


def hf_run(job: Job) -> dict:
    from transformers import AutoModelForImageTextToText, AutoProcessor

    torch.set_num_threads(job.threads)
    media = _media(job)
    processor = AutoProcessor.from_pretrained(job.model)
    processor.tokenizer.padding_side = "left"  # generation appends on the right
    dtype = getattr(torch, job.dtype)
    model = AutoModelForImageTextToText.from_pretrained(job.model, dtype=dtype).to(job.device).eval()
    model.generation_config.eos_token_id = None  # ignore_eos: every row runs to its max_new_tokens
    pad = processor.tokenizer.pad_token_id

    def encode(texts: list[str], items: list) -> dict:
        key = "pixel_values"
        if job.video:  # the frames as sampled, at their rate (Qwen2.5-VL's time positions)
            from transformers.video_utils import VideoMetadata

            meta = [VideoMetadata(len(f), fps=fps, frames_indices=list(range(len(f)))) for f, fps in items]
            opts = dict(video_metadata=meta, do_sample_frames=False)
            if hasattr(processor.video_processor, "cap_pixels_per_frame"):  # Qwen's per-frame pixel cap
                opts["cap_pixels_per_frame"] = True
            videos = [f for f, _ in items]
            inputs = processor(
                text=texts, videos=videos, videos_kwargs=opts, padding=True, return_tensors="pt"
            )
            key = processor.video_processor.model_input_names[0]  # Qwen: pixel_values_videos
        else:
            inputs = processor(text=texts, images=items, padding=True, return_tensors="pt")
        inputs = inputs.to(job.device)
        inputs[key] = inputs[key].to(dtype)
        return inputs

    def generate(batch: list[tuple[int, str, int]]) -> list[list[int]]:
        inputs = encode([p for _, p, _ in batch], [media[i] for i, _, _ in batch])
        longest = max(n for _, _, n in batch)  # a static batch runs until its longest row is done
        with torch.inference_mode():
            out = model.generate(**inputs, max_new_tokens=longest, do_sample=False, pad_token_id=pad)
        new = out[:, inputs["input_ids"].shape[1] :].tolist()
        return [row[:n] for row, (_, _, n) in zip(new, batch, strict=True)]

    with torch.inference_mode():
        warm_inputs = encode([job.requests[0][1]], [_warm_media(job)])
        model.generate(**warm_inputs, max_new_tokens=2, do_sample=False, pad_token_id=pad)
    bs = job.hf_batch_size
    batches = range(0, len(job.requests), bs)
    tokens, seconds, rates = _timed(
        job, lambda: [t for k in batches for t in generate(job.requests[k : k + bs])]
    )
    return {
        "seconds": seconds,
        "tokens": tokens,
        **_peak_memory(job),
        "matmul_flops_per_s": rates,
    }


def _media(job: Job) -> list:
    if job.video:
        return vlm.clips(job.num_images, job.seed)
    return (vlm.pages if job.pages else vlm.images)(job.num_images, job.seed)


def _warm_media(job: Job):
    """A short input unlike the job's (first-call costs): a noise image, or two frames of noise."""
    if job.video:
        frames = torch.from_numpy(np.stack([np.asarray(vlm.noise_image(k)) for k in range(2)]))
        return frames, vlm.CLIP_FPS
    return vlm.noise_image(0)


def _engine_media(job: Job, item) -> dict:
    if job.video:
        frames, fps = item
        return {"video": (frames, {"fps": fps})}
    return {"image": item}


def _timed(job: Job, fn):
    """`(fn(), its seconds, [matmul rate just before, just after])`: the rate next to the run."""

    def rate() -> float:
        return matmul_flops_per_s(job.rate_sizes, device=job.device, dtype=getattr(torch, job.dtype))

    rate_before = rate()
    start = time.perf_counter()
    result = fn()  # returns host-side tokens, so the device's work is done when it returns
    seconds = time.perf_counter() - start
    return result, seconds, [rate_before, rate()]


def _profile(engine) -> dict[str, float]:
    """Wrap the engine's phases with wall-clock timers (shares of one run; the timers cost ~1 us).

    A forward pass that mixes prefill chunks and decodes is split between the two by token count."""
    timers: dict[str, float] = defaultdict(float)

    def timed(obj, name: str, bucket: str):
        fn = getattr(obj, name)

        def wrapper(*args, **kwargs):
            t = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                timers[bucket] += time.perf_counter() - t

        setattr(obj, name, wrapper)

    runner = engine.core.runner
    execute = runner.execute

    def execute_split(batch):
        t, vision_before = time.perf_counter(), timers["vision"]
        try:
            return execute(batch)
        finally:
            forward = time.perf_counter() - t - (timers["vision"] - vision_before)
            prefill = sum(n for req, n in batch.items if _in_prompt(req))
            total = sum(n for _, n in batch.items)
            timers["prefill"] += forward * prefill / total
            timers["decode"] += forward * (total - prefill) / total

    runner.execute = execute_split
    timed(runner.features, "take_new", "vision")
    timed(runner.features, "advance_slices", "vision")  # shares of images encoded a few layers a step
    timed(engine.core.scheduler, "schedule", "scheduling")
    timed(engine.core.sampler, "sample_tensor", "sampling")
    timed(engine.inputs, "process", "input processing")
    timed(engine.frontend.output, "process", "detokenization")  # text, stop strings, outputs
    return timers


def _in_prompt(req) -> bool:
    return req.num_computed_tokens < req.num_prompt_tokens
