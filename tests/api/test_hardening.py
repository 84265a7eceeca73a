"""Items of the hardening issue, each with a test that fails on the code before its fix: token ids
outside the vocabulary, the order a finished request's blocks are released in, prefix-cache
lookups counted once per waiting request, EXIF orientation and 16-bit images."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from helpers.images import make_image
from mm_engine import LLM, SamplingParams
from mm_engine.pools.block_manager import IMAGE, TEXT, BlockManager
from mm_engine.pools.block_pool import BlockPool
from mm_engine.request import Request

PROMPT = "USER: <image> what is this ASSISTANT:"


@pytest.fixture(scope="module")
def llm(clip_llama):
    return LLM(clip_llama, kv_cache_memory_bytes=4 * 1024**2)


@pytest.mark.parametrize("bad", [10**6, -1, "7", 3.0, True])
def test_a_token_id_outside_the_vocabulary_is_refused_and_the_batch_runs(llm, bad):
    good = llm.tokenizer("USER: what is this ASSISTANT:")["input_ids"]
    with pytest.raises(ValueError, match="not a token id of this model"):
        llm.generate({"prompt_token_ids": [*good[:2], bad, *good[2:]]}, SamplingParams(max_tokens=2))
    assert llm.generate({"prompt_token_ids": good}, SamplingParams(max_tokens=2))[0].finished
    assert llm.kv_report()["text"]["used_blocks"] == 0


def _request(ids: list[int]) -> Request:
    return Request("r", ids, [], SamplingParams(max_tokens=1), 0.0, 0, frozenset())


def test_a_finished_requests_blocks_are_evicted_tail_first():
    """With the pool full of one request's cached chain, making room evicts its last block, and
    the chain's start is still matched."""
    blocks = BlockManager(BlockPool(TEXT, 0, 3), BlockPool(IMAGE, 3, 0), 4, True, 0.0)
    req = _request(list(range(13)))  # three full blocks and one token more
    assert blocks.allocate(req, 12)
    req.num_computed_tokens = 12
    blocks.commit(req)
    blocks.free(req)
    blocks.pools[TEXT].allocate(1)  # evicts one cached block
    again = _request(list(range(13)))
    assert blocks.match_prefix(again) == 8  # blocks 0 and 1: the root survived


def test_a_waiting_request_counts_its_prefix_lookup_once(clip_llama):
    llm = LLM(clip_llama, kv_cache_memory_bytes=4 * 1024**2, max_num_seqs=1)
    image = make_image(3)
    llm.generate({"prompt": PROMPT, "multi_modal_data": {"image": image}}, SamplingParams(max_tokens=1))
    pools = llm.engine.core.blocks.pools.values()

    def counts() -> tuple[int, int]:
        return sum(p.queries for p in pools), sum(p.hits for p in pools)

    queries, hits = counts()
    eng = llm.engine
    # The first request holds the only seat for 12 steps; the second waits with a cached prefix.
    # (ranked above it, so the image request may not preempt it).
    eng.add_request("USER: how many ASSISTANT:", SamplingParams(max_tokens=12, ignore_eos=True), priority=-5)
    eng.step()
    eng.add_request({"prompt": PROMPT, "multi_modal_data": {"image": image}}, SamplingParams(max_tokens=1))
    steps = 0
    while eng.has_unfinished():
        eng.step()
        steps += 1
    assert steps > 5 and eng.core.scheduler.num_preemptions == 0  # it really waited
    n_ids = len(eng.inputs.process({"prompt": PROMPT, "multi_modal_data": {"image": image}})[1])
    cacheable = (n_ids - 1) // eng.core.blocks.block_size  # full blocks before the last token
    new_queries, new_hits = counts()
    assert 0 < new_hits - hits <= cacheable and new_queries - queries <= cacheable + 1


def _png(image: Image.Image, **kwargs) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG", **kwargs)
    return buf.getvalue()


def test_exif_orientation_is_applied_and_can_be_turned_off():
    from mm_engine.vision.image_io import ImageLimits, image_content_hash, load_image

    upright = make_image(5, (40, 20))
    sideways = upright.transpose(Image.Transpose.ROTATE_90)  # stored turned, tagged to be turned back
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 CW to display"
    data = _png(sideways, exif=exif)
    shown = load_image(data)
    assert shown.size == (40, 20) and np.array_equal(np.asarray(shown), np.asarray(upright))
    assert image_content_hash(shown) == image_content_hash(upright)
    raw = load_image(data, ImageLimits(apply_exif_orientation=False))
    assert raw.size == (20, 40)


def test_sixteen_bit_images_are_scaled_not_clipped():
    from mm_engine.vision.image_io import load_image

    ramp = (np.arange(64, dtype=np.uint16) * 1024).reshape(8, 8)  # 0 .. 64512
    image = Image.fromarray(ramp)  # uint16: mode I;16
    loaded = load_image(_png(image))
    assert loaded.mode == "L"
    want = (ramp >> 8).astype(np.uint8)
    assert np.array_equal(np.asarray(loaded), want)  # not all 255 past the first few pixels


def _jpeg(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, "JPEG", quality=100)
    return buf.getvalue()


@pytest.mark.parametrize(
    ("image", "rgb"),
    [
        (Image.fromarray(np.full((8, 8), 40000, dtype=np.int32)), 156),  # mode I: 16-bit range
        (Image.fromarray(np.full((8, 8), 0.5, dtype=np.float32)), 128),  # mode F in [0, 1]
        (Image.fromarray(np.full((8, 8), 300.0, dtype=np.float32)), 255),  # mode F beyond: clipped
        (Image.fromarray(np.ones((8, 8), dtype=bool)), 255),  # mode 1
        (Image.new("RGB", (8, 8), (102, 102, 102)).convert("P"), 102),  # a web-palette grey
        (Image.new("LA", (8, 8), (70, 255)), 70),
    ],
    ids=["I", "F", "F-clipped", "1", "P", "LA"],
)
def test_other_modes_are_seen_as_a_viewer_shows_them(image, rgb):
    from mm_engine.vision.image_io import load_image

    loaded = load_image(image)
    assert np.asarray(loaded.convert("RGB"))[0, 0].tolist() == [rgb] * 3
    if image.mode not in ("I", "F"):  # those only come as objects; the rest round-trip as PNG
        assert np.asarray(load_image(_png(image)).convert("RGB"))[0, 0].tolist() == [rgb] * 3
    cmyk = load_image(_jpeg(Image.new("CMYK", (8, 8), (0, 255, 255, 0))))  # Adobe JPEGs are CMYK
    assert np.allclose(np.asarray(cmyk.convert("RGB"))[0, 0], [255, 0, 0], atol=2)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"seed": 2**70}, "seed must be an integer that fits in 64 bits"),
        ({"temperature": float("inf")}, "temperature must be a finite number"),
        ({"temperature": "0.5"}, "temperature must be a finite number"),
        ({"stop_token_ids": ["x"]}, "stop_token_ids must be non-negative integers"),
        ({"stop_token_ids": 5}, "stop_token_ids must be a list"),
        ({"stop": 5}, "stop must be a string or a list"),
        ({"top_k": 2.5}, "top_k must be"),
    ],
)
def test_sampling_params_are_checked_where_they_are_given(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_generate_arguments_name_themselves(llm):
    with pytest.raises(
        ValueError, match="sampling_params must be a SamplingParams or a list of them, got dict"
    ):
        llm.generate("USER: hi ASSISTANT:", {"max_tokens": 2})
    with pytest.raises(ValueError, match=r"priority\[0\] must be an integer, got str"):
        llm.generate(["USER: hi ASSISTANT:"], SamplingParams(max_tokens=2), priority=["x"])
    with pytest.raises(ValueError, match="a prompt must be a string or a dict, got int"):
        llm.generate([123], SamplingParams(max_tokens=2))
    bad_chats = {
        r"messages\[0\]\.role must be a string, got int": [{"role": 5, "content": "hi"}],
        r"messages\[0\]\.content must be a string or a list": [{"role": "user", "content": 5}],
        r"messages\[0\]\.content\[1\]\.text must be a string": [
            {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": 5}]}
        ],
        r"messages\[0\]\.content\[0\]: unsupported part type": [{"role": "user", "content": [5]}],
        "messages must be a list of message dicts": {"role": "user", "content": "hi"},
    }
    for match, messages in bad_chats.items():
        with pytest.raises(ValueError, match=match):
            llm.chat(messages, SamplingParams(max_tokens=2))


def test_http_health_head_request_id_empty_content_and_blank_caption_prompt(clip_llama):
    import asyncio

    from litestar.testing import TestClient

    from helpers.api import chat_messages, data_url, image_bytes
    from mm_engine.api.app import create_app
    from mm_engine.api.settings import ServerSettings
    from mm_engine.async_llm import AsyncLLM

    llm = AsyncLLM.from_engine_args(clip_llama, kv_cache_memory_bytes=4 * 1024**2)
    try:
        with TestClient(create_app(llm, ServerSettings(served_model_names=["m"]))) as client:
            r = client.head("/health")
            assert r.status_code == 200 and r.content == b""
            assert len(r.headers["x-request-id"]) == 32  # a fresh one
            r = client.get("/v1/models", headers={"x-request-id": "client-42"})
            assert r.headers["x-request-id"] == "client-42"  # the client's own, echoed
            r = client.get("/v1/models", headers={"x-request-id": "bad id\twith spaces"})
            assert r.headers["x-request-id"] != "bad id\twith spaces"
            empty = {"model": "m", "messages": [{"role": "user", "content": []}], "max_tokens": 2}
            r = client.post("/v1/chat/completions", json=empty)
            assert r.status_code == 400 and "error" in r.json()
            png = image_bytes(1)
            default = client.post("/v1/caption", files=[("image", ("a.png", png))], data={"max_tokens": "4"})
            blank = client.post(
                "/v1/caption", files=[("image", ("a.png", png))], data={"max_tokens": "4", "prompt": ""}
            )
            assert blank.status_code == default.status_code == 200
            assert blank.json()["text"] == default.json()["text"]
            assert client.post(
                "/v1/chat/completions", json={**empty, "messages": chat_messages(data_url(png))}
            )
    finally:
        asyncio.run(llm.shutdown())


@pytest.mark.parametrize(
    "extra",
    [
        {"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"},
        {"tool_choice": "auto"},
        {"tools": []},
        {"top_logprobs": 2},
    ],
)
def test_unsupported_chat_parameters_are_refused_by_name(clip_llama, extra):
    """LLaVA has no tool-call format: tools are refused (tests/engine/test_tool_calls.py has the rest)."""
    import asyncio

    from litestar.testing import TestClient

    from mm_engine.api.app import create_app
    from mm_engine.api.settings import ServerSettings
    from mm_engine.async_llm import AsyncLLM

    llm = AsyncLLM.from_engine_args(clip_llama, kv_cache_memory_bytes=4 * 1024**2)
    try:
        with TestClient(create_app(llm, ServerSettings(served_model_names=["m"]))) as client:
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **extra}
            r = client.post("/v1/chat/completions", json=body)
            assert r.status_code == 400, r.text
            assert r.json()["error"]["param"] == next(iter(extra))
    finally:
        asyncio.run(llm.shutdown())


MULTIPART_CASES = {
    "no filename": [('Content-Disposition: form-data; name="image"', "png")],
    "empty filename": [('Content-Disposition: form-data; name="image"; filename=""', "png")],
    "filename*": [("Content-Disposition: form-data; name=\"image\"; filename*=UTF-8''a.png", "png")],
    "invalid UTF-8": [
        ('Content-Disposition: form-data; name="image"; filename="a.png"', "png"),
        ('Content-Disposition: form-data; name="prompt"', b"\xff\xfe bad"),
    ],
    "unknown charset": [
        ('Content-Disposition: form-data; name="image"; filename="a.png"', "png"),
        ('Content-Disposition: form-data; name="prompt"\r\nContent-Type: text/plain; charset=x-nope', b"hi"),
    ],
}


def test_malformed_bodies_are_400s_not_500s(clip_llama):
    import asyncio

    from litestar.testing import TestClient

    from helpers.api import image_bytes
    from mm_engine.api.app import create_app
    from mm_engine.api.settings import ServerSettings
    from mm_engine.async_llm import AsyncLLM

    png = image_bytes(1)
    llm = AsyncLLM.from_engine_args(clip_llama, kv_cache_memory_bytes=4 * 1024**2)
    try:
        with TestClient(create_app(llm, ServerSettings(served_model_names=["m"]))) as client:
            for name, parts in MULTIPART_CASES.items():
                body = b"".join(
                    b"--B\r\n" + h.encode() + b"\r\n\r\n" + (png if d == "png" else d) + b"\r\n"
                    for h, d in parts
                )
                r = client.post(
                    "/v1/caption", content=body + b"--B--\r\n",
                    headers={"content-type": "multipart/form-data; boundary=B"},
                )  # fmt: skip
                assert r.status_code == 400, (name, r.text)
                assert r.json()["error"]["type"] == "invalid_request_error"
            deep = ("[" * 5000 + "]" * 5000).encode()
            r = client.post(
                "/v1/chat/completions", content=deep, headers={"content-type": "application/json"}
            )
            assert r.status_code == 400 and "nested too deeply" in r.json()["error"]["message"]
            assert client.get("/health").status_code == 200  # still serving
    finally:
        asyncio.run(llm.shutdown())


def test_a_prompt_too_long_to_fit_is_refused_before_it_is_tokenized(llm, monkeypatch):
    tokenized = []
    tokenizer = llm.engine.inputs.tokenizer
    original = type(tokenizer).__call__

    def spy(self, text, *args, **kwargs):
        tokenized.append(len(text))
        return original(self, text, *args, **kwargs)

    monkeypatch.setattr(type(tokenizer), "__call__", spy)
    huge = "what " * (llm.engine.inputs.max_prompt_chars // 5 + 1)
    with pytest.raises(ValueError, match="characters, more than any prompt of max_model_len tokens"):
        llm.generate(huge, SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="characters"):
        llm.chat([{"role": "user", "content": huge}], SamplingParams(max_tokens=2))
    assert not tokenized
    assert llm.generate("USER: what ASSISTANT:", SamplingParams(max_tokens=2))[0].finished


def test_the_engine_leaves_torchs_global_state_alone(clip_llama, monkeypatch):
    import torch

    import mm_engine.core.engine_core
    from mm_engine.cli import build_parser, engine_kwargs

    tuned = []
    monkeypatch.setattr(mm_engine.core.engine_core, "tune_malloc", lambda: tuned.append(1))
    torch.manual_seed(123)
    before, dtype = torch.get_rng_state(), torch.get_default_dtype()
    llm = LLM(clip_llama, kv_cache_memory_bytes=4 * 1024**2)
    llm.generate("USER: what ASSISTANT:", SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True))
    assert torch.equal(torch.get_rng_state(), before) and torch.get_default_dtype() == dtype
    assert not tuned  # glibc's malloc is the process's: a library caller opts in
    for command in (["generate"], ["serve"], ["caption", "x", "-o", "y"]):
        assert engine_kwargs(build_parser().parse_args(command))["cpu_tune_malloc"] is True
    # Unseeded sampling still repeats from the engine's own seed.
    again = LLM(clip_llama, kv_cache_memory_bytes=4 * 1024**2)
    params = SamplingParams(max_tokens=6, temperature=1.0, ignore_eos=True)
    first = LLM(clip_llama, kv_cache_memory_bytes=4 * 1024**2).generate("USER: what ASSISTANT:", params)
    second = again.generate("USER: what ASSISTANT:", params)
    assert first[0].outputs[0].token_ids == second[0].outputs[0].token_ids


def test_image_kv_swapped_out_never_pushes_out_the_request_being_swapped_in():
    """Found by the scheduler property test: admitting a swapped text request preempted an image
    request, whose swap-out dropped the admitted request's own stored KV (KeyError on swap-in)."""
    import torch

    from mm_engine.pools.kv_cache import KVCache, KVCacheSpec
    from mm_engine.pools.swap import HostSwap

    spec = KVCacheSpec(1, 1, 16, 4, torch.float32)
    swap = HostSwap(KVCache(spec, 8, torch.device("cpu")), 3 * spec.bytes_per_block)
    assert swap.swap_out("text", [0, 1], 8, has_image_blocks=False)
    assert not swap.swap_out("image", [2, 3], 8, has_image_blocks=True, protect="text")  # no room
    assert swap.has("text")
    assert swap.swap_out("image2", [2, 3], 8, has_image_blocks=True)  # unprotected text KV gives way
    assert not swap.has("text")


def _messages_with_image(url: str) -> list[dict]:
    image = {"type": "image_url", "image_url": {"url": url}}
    return [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": [{"type": "text", "text": "what"}, image]},
    ]


ERROR_CASES = {  # name: (route, request kwargs, expected message part, expected param)
    "empty body": ("/v1/chat/completions", {"content": b""}, "the request body is empty", None),
    "blank body": ("/v1/chat/completions", {"content": b"  "}, "blank or incomplete", None),
    "text as image": ("/v1/caption", {"files": {"image": (None, b"hi")}}, "expected a file part", "image[0]"),
    "bad base64": (
        "/v1/chat/completions",
        {"json": {"messages": _messages_with_image("data:image/png;base64,@@")}},
        "not valid base64",
        "messages[2].content[1].image_url",
    ),
    "no payload": (
        "/v1/chat/completions",
        {"json": {"messages": _messages_with_image("data:image/png;base64")}},
        "no ','",
        "messages[2].content[1].image_url",
    ),
    "out of range": (
        "/v1/chat/completions",
        {"json": {"messages": [{"role": "user", "content": "a"}], "top_p": 5}},
        "<= 1.0",
        "top_p",
    ),
}


def test_error_messages_say_what_is_wrong_and_where(clip_llama):
    import asyncio

    from litestar.testing import TestClient

    from mm_engine.api.app import create_app
    from mm_engine.api.settings import ServerSettings
    from mm_engine.async_llm import AsyncLLM

    llm = AsyncLLM.from_engine_args(clip_llama, kv_cache_memory_bytes=4 * 1024**2)
    try:
        with TestClient(create_app(llm, ServerSettings(served_model_names=["m"]))) as client:
            for name, (route, kwargs, message, param) in ERROR_CASES.items():
                headers = {"content-type": "application/json"} if "content" in kwargs else None
                r = client.post(route, headers=headers, **kwargs)
                assert r.status_code == 400, (name, r.text)
                error = r.json()["error"]
                assert message in error["message"] and error["param"] == param, (name, error)
    finally:
        asyncio.run(llm.shutdown())
