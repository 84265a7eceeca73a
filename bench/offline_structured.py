"""`bench.offline --json-schema PATH`: structured output's throughput cost, side by side.

The same job (workload, images, prompts, output lengths) runs on the engine unconstrained and with
every output constrained to the schema, in fresh processes, in the order free, schema, free
(A-B-A: drift between runs cancels in the free side's mean). The model must spell JSON: the
default is `bench-bytelevel`, the benchmark model with a byte-level tokenizer.

A constrained request ends when its grammar does (the schema's object closed) or at its output
length, so the two sides may decode different token counts: the cost is per output token.
Reported besides: how many constrained outputs completed, and how many of those parse and
validate against the schema.
"""

from __future__ import annotations

import json
import time

from bench.machine import machine_info
from bench.offline_runs import Job, engine_run, run_in_child


def structured_cost(job: Job, schema: dict) -> dict:
    started = time.perf_counter()
    free = [run_in_child(engine_run, job)]
    print(f"  free: {free[0]['seconds']:.1f} s", flush=True)
    constrained = run_in_child(engine_run, Job(**{**job.__dict__, "json_schema": schema}))
    print(f"  json schema: {constrained['seconds']:.1f} s", flush=True)
    free.append(run_in_child(engine_run, job))
    print(f"  free again: {free[1]['seconds']:.1f} s", flush=True)
    free_tokens = sum(len(t) for t in free[0]["tokens"])
    schema_tokens = sum(len(t) for t in constrained["tokens"])
    free_seconds = sum(r["seconds"] for r in free) / 2
    per_token = {"free": free_seconds / free_tokens, "json_schema": constrained["seconds"] / schema_tokens}
    ends = zip(constrained["texts"], constrained["finish_reasons"], strict=True)
    done = [text for text, why in ends if why == "stop"]
    return {
        "mode": "json_schema",
        "num_requests": len(job.requests),
        "schema": schema,
        "free_seconds_runs": [r["seconds"] for r in free],
        "json_schema_seconds": constrained["seconds"],
        "free_output_tokens": free_tokens,
        "json_schema_output_tokens": schema_tokens,
        "free_output_tokens_per_s": 1 / per_token["free"],
        "json_schema_output_tokens_per_s": 1 / per_token["json_schema"],
        "free_requests_per_s": len(job.requests) / free_seconds,
        "json_schema_requests_per_s": len(job.requests) / constrained["seconds"],
        "overhead_per_token": per_token["json_schema"] / per_token["free"] - 1.0,
        "json_schema_completed": len(done),
        "json_schema_valid": sum(_valid(text, schema) for text in done),
        "engine_args": job.engine_args,
        "device": job.device,
        "dtype": job.dtype,
        "machine": machine_info(),
        "wall_s": time.perf_counter() - started,
    }


def _valid(text: str, schema: dict) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    try:
        import jsonschema
    except ImportError:  # not a dependency: parsing is the check then
        return True
    return jsonschema.Draft202012Validator(schema).is_valid(value)


def print_structured(r: dict) -> None:
    m = r["machine"]
    where = m["gpu"] if r["device"] != "cpu" else f"{m['cpu']}, {m['torch_threads']} threads"
    head = f"{r['num_requests']} requests ({m['date']}, {where}, {r['dtype']})"
    print(f"\n### bench.offline --json-schema: {head}\n")
    print("| decoding | output tokens | requests/s | output tokens/s |")
    print("|---|---:|---:|---:|")
    for side in ("free", "json_schema"):
        print(
            f"| {side} | {r[f'{side}_output_tokens']} | {r[f'{side}_requests_per_s']:.2f} | "
            f"{r[f'{side}_output_tokens_per_s']:.1f} |"
        )
    print(f"\ncost of the grammar per output token: {100 * r['overhead_per_token']:+.1f}%")
    print(
        f"constrained outputs completed: {r['json_schema_completed']}/{r['num_requests']}, "
        f"of those valid against the schema: {r['json_schema_valid']}"
    )
