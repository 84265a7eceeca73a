"""Time to first token of one clip: `python -m bench.video_ttft [--seconds 30] [--fps 1] [--json PATH]`.

A clip of generated scenes panning sideways (`--seconds` long at 30 frames per second, 320 x 180,
H.264 in MP4, written here once) is sent to an idle engine on the Qwen2.5-VL benchmark model as
encoded bytes, sampled at `--fps`, and the first token timed from the call: decoding and sampling
the frames, the video processor, the tower and the prefill all fall inside it. Decoding and the
video processor are also timed on their own (the same work outside the engine, just before);
the median is over `--runs` requests with different clips, so that no cache helps.
"""

from __future__ import annotations

import argparse
import io
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from bench import vlm
from bench.machine import machine_info
from bench.save import save_json


def clip_bytes(seconds: float, seed: int, size: tuple[int, int] = (320, 180), rate: int = 30) -> bytes:
    import av

    w, h = size
    scene = np.asarray(vlm.images(1, seed)[0].convert("RGB").resize((2 * w, h)))
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream("libx264", rate=rate)
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        stream.options = {"g": str(2 * rate), "preset": "veryfast"}
        for k in range(int(seconds * rate)):
            x = k * w // int(seconds * rate)
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(scene[:, x : x + w]), format="rgb24")
            for packet in stream.encode(frame):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    return buf.getvalue()


def main(argv: list[str] | None = None) -> dict:
    from mm_engine import LLM, SamplingParams
    from mm_engine.vision.video_io import load_video

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--fps", type=float, default=1.0)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--model", default="bench-qwen2.5-vl")
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = vlm.resolve_model(args.model)
    clips = [clip_bytes(args.seconds, seed) for seed in range(args.runs + 1)]
    llm = LLM(model, max_num_batched_tokens=8192, cpu_tune_malloc=True)
    prompt = vlm.video_prompt_for(model)
    options = {"fps": args.fps}
    params = SamplingParams(temperature=0.0, max_tokens=1)

    def request(data: bytes) -> dict:
        return {"prompt": prompt, "multi_modal_data": {"video": data}, "mm_processor_kwargs": options}

    llm.generate([request(clips[-1])], params)  # warm-up: first-call costs are nobody's TTFT
    inputs = llm.engine.inputs
    rows = []
    for data in clips[:-1]:
        t = time.perf_counter()
        video = load_video(data, inputs.processing.video_sampling(options), inputs.video_limits)
        decoded = time.perf_counter() - t
        t = time.perf_counter()
        processed = inputs.processing.process_video(video, options)
        processing = time.perf_counter() - t
        t = time.perf_counter()
        out = llm.generate([request(data)], params)[0]
        ttft = time.perf_counter() - t
        rows.append(dict(ttft_s=ttft, decode_s=decoded, processing_s=processing,
                         frames=len(video.indices), video_tokens=sum(len(g.tokens) for g in processed),
                         prompt_tokens=len(out.prompt_token_ids)))  # fmt: skip
    llm.close()
    result = {
        "clip_seconds": args.seconds,
        "fps": args.fps,
        "clip_bytes": len(clips[0]),
        "ttft_s_median": statistics.median(r["ttft_s"] for r in rows),
        "runs": rows,
        "model": model,
        "machine": machine_info(),
    }
    r = rows[0]
    print(
        f"\n### bench.video_ttft: a {args.seconds:g} s clip (320x180, H.264, {len(clips[0])} bytes) "
        f"at {args.fps:g} fps: {r['frames']} frames, {r['video_tokens']} video tokens, "
        f"{r['prompt_tokens']} prompt tokens\n"
    )
    print(
        "| run | TTFT (s) | of which: decode + sample frames (s) | video processor (s) |\n"
        "|---:|---:|---:|---:|"
    )
    for k, row in enumerate(rows):
        print(f"| {k} | {row['ttft_s']:.2f} | {row['decode_s']:.3f} | {row['processing_s']:.3f} |")
    print(f"\nmedian TTFT {result['ttft_s_median']:.2f} s")
    save_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
