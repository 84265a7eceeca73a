"""Request limits that need more than a schema: stop strings, image counts, max_tokens vs context."""

from __future__ import annotations

import re
from typing import Any

from mm_engine.api.errors import APIError
from mm_engine.api.settings import ServerSettings
from mm_engine.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputs

# Longer names before their prefixes: a message naming "stop_token_ids" is not about "stop".
_PARAMS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop_token_ids", "stop",
           "frequency_penalty", "presence_penalty", "repetition_penalty", "min_p", "min_tokens",
           "logit_bias", "allowed_token_ids", "bad_words_token_ids", "bad_words")  # fmt: skip
MAX_LOGIT_BIAS = 1024  # entries in one request's logit_bias (OpenAI documents no cap; vLLM has none)
_TOKEN_ID = re.compile(r"(?:0|[1-9][0-9]{0,9})", re.ASCII)
# Below this a temperature only overflows the logits; it means greedy (vLLM does the same).
GREEDY_BELOW = 1e-5


def check_stop(stop: str | list[str] | None, settings: ServerSettings) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > settings.max_stop_strings:
        raise APIError(
            400,
            f"at most {settings.max_stop_strings} stop strings are allowed, got {len(stops)}",
            param="stop",
        )
    for s in stops:
        if not s:
            raise APIError(400, "stop strings must not be empty", param="stop")
        if len(s) > settings.max_stop_length:
            raise APIError(
                400,
                f"a stop string is {len(s)} characters, over the limit of {settings.max_stop_length}",
                param="stop",
            )
    return stops


def check_priority(priority: int, settings: ServerSettings) -> int:
    """A request's `priority` if the operator lets clients set one (else only the default, 0)."""
    if priority and not settings.allow_client_priority:
        raise APIError(
            400,
            "priority is not set by clients on this server (its operator may allow it with "
            "--allow-client-priority)",
            param="priority",
        )
    return priority


def check_image_count(n: int, settings: ServerSettings, param: str) -> None:
    if n > settings.max_images_per_request:
        raise APIError(
            400, f"{n} images were sent; at most {settings.max_images_per_request} are allowed", param=param
        )


def check_video_count(n: int, settings: ServerSettings, param: str) -> None:
    if n > settings.max_videos_per_request:
        raise APIError(
            400, f"{n} videos were sent; at most {settings.max_videos_per_request} are allowed", param=param
        )


def sampling_params(**kwargs) -> SamplingParams:
    """`SamplingParams` from request fields (None: the default); a bad value is a 400 naming it."""
    if kwargs.get("temperature") is not None and kwargs["temperature"] < GREEDY_BELOW:
        kwargs["temperature"] = 0.0
    try:
        return SamplingParams(**{k: v for k, v in kwargs.items() if v is not None})
    except ValueError as exc:
        message = str(exc)
        param = next((p for p in _PARAMS if message.startswith(p)), None)
        raise APIError(400, message, param=param, code="invalid_value") from None


def logit_bias(raw: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's `logit_bias` (token ids as JSON object keys) with integer keys; a 400 otherwise."""
    if not raw:
        return None
    if len(raw) > MAX_LOGIT_BIAS:
        message = f"logit_bias has {len(raw)} entries, more than {MAX_LOGIT_BIAS}"
        raise APIError(400, message, param="logit_bias", code="invalid_value")
    bad = next((k for k in raw if not _TOKEN_ID.fullmatch(k)), None)
    if bad is not None:  # int() would take "1_0", " 7" or other scripts' digits
        message = f"logit_bias keys must be token ids (decimal digits), got {bad[:40]!r}"
        raise APIError(400, message, param="logit_bias", code="invalid_value")
    return {int(k): float(v) for k, v in raw.items()}


def fit_max_tokens(
    requested: int | None,
    prompt_len: int,
    max_model_len: int,
    settings: ServerSettings,
    param: str,
    prompt_param: str,
) -> int:
    """The request's max_tokens if the context has room for it (else a 400), or the default."""
    room = max_model_len - prompt_len
    if room < 1:
        raise APIError(
            400,
            f"the prompt is {prompt_len} tokens, which leaves no room to generate "
            f"within max_model_len={max_model_len}",
            param=prompt_param,
        )
    if requested is None:
        return min(settings.default_max_tokens, room)
    if requested > room:
        raise APIError(
            400,
            f"{param}={requested} is more than the {room} tokens left for the output "
            f"(max_model_len={max_model_len} minus {prompt_len} prompt tokens)",
            param=param,
        )
    return requested


def request_fields(
    data, settings: ServerSettings, logprobs: int | None, structured: StructuredOutputs | None = None
) -> dict[str, Any]:
    """The sampling fields that chat and completions share (OpenAI's and vLLM's extras), checked
    as far as they can be before the prompt is processed; `sampling_params(**fields, max_tokens=,
    min_tokens=)` builds the request's params once its prompt's length is known."""
    if data.stream_options is not None and not data.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")
    return dict(
        n=data.n,
        temperature=data.temperature,
        top_p=data.top_p,
        top_k=data.top_k,
        seed=data.seed,
        stop=check_stop(data.stop, settings),
        ignore_eos=data.ignore_eos,
        frequency_penalty=data.frequency_penalty,
        presence_penalty=data.presence_penalty,
        repetition_penalty=data.repetition_penalty,
        min_p=data.min_p,
        logit_bias=logit_bias(data.logit_bias),
        stop_token_ids=data.stop_token_ids,
        allowed_token_ids=data.allowed_token_ids,
        bad_words=data.bad_words,
        skip_special_tokens=data.skip_special_tokens,
        include_stop_str_in_output=data.include_stop_str_in_output,
        logprobs=logprobs,
        structured_outputs=structured,
        output_kind=RequestOutputKind.DELTA if data.stream else RequestOutputKind.FINAL_ONLY,
    )


def structured_outputs_of(data, response_format=None) -> StructuredOutputs | None:
    """The one grammar a request asks for: OpenAI's `response_format` or vLLM's fields; a 400
    when it asks for several, or names an empty or malformed one."""
    asked: list[tuple[str, StructuredOutputs]] = []
    if response_format is not None and response_format.type != "text":
        if response_format.type == "json_object":
            asked.append(("response_format", StructuredOutputs(json_object=True)))
        else:
            schema = response_format.json_schema.schema if response_format.json_schema else None
            if schema is None:
                raise APIError(
                    400, "response_format json_schema needs json_schema.schema", param="response_format"
                )
            asked.append(("response_format", StructuredOutputs(json=schema)))
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar")):  # fmt: skip
        value = getattr(data, name)
        if value is not None:
            asked.append((name, StructuredOutputs(**{kind: value})))
    if data.structured_outputs is not None:
        so = data.structured_outputs
        spec = StructuredOutputs(so.json, so.json_object, so.regex, so.choice, so.grammar)
        asked.append(("structured_outputs", spec))
    if len(asked) > 1:
        names = ", ".join(n for n, _ in asked)
        raise APIError(400, f"ask for one kind of structured output, got {names}", param=asked[1][0])
    if not asked:
        return None
    name, spec = asked[0]
    try:
        spec.key()
    except ValueError as exc:
        raise APIError(400, str(exc), param=name, code="invalid_value") from None
    return spec
