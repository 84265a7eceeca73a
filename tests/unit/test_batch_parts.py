"""The batch API's parts without a server: the streamed multipart parser over any split of the body,
line checks, a result file cut mid-line by a crash, a batch line's priority."""

from __future__ import annotations

import asyncio
import json
import random

import httpx
import msgspec
import pytest

from mm_engine.api.caller import BatchCaller
from mm_engine.api.errors import APIError
from mm_engine.api.settings import ServerSettings
from mm_engine.batch.lines import NotJSONL, read_lines
from mm_engine.batch.multipart import MultipartError, boundary_of, save_upload
from mm_engine.batch.results import ResultFile, answered, refused


def _form(files: dict, data: dict) -> tuple[str, bytes]:
    request = httpx.Request("POST", "http://x/v1/files", files=files, data=data)
    return request.headers["content-type"], request.read()


async def _chunks(body: bytes, rng: random.Random):
    at = 0
    while at < len(body):
        n = rng.choice([1, 2, 3, 7, 64, 1000, 100_000])
        yield body[at : at + n]
        at += n


@pytest.mark.parametrize("seed", range(8))
def test_multipart_file_part_is_the_same_over_any_split_of_the_body(tmp_path, seed):
    rng = random.Random(seed)
    # Content that looks like a boundary's start, CRLFs, and bytes of every value.
    payload = b"\r\n--" + bytes(range(256)) * 50 + b"\r\n-" + rng.randbytes(5000)
    kind, body = _form({"file": ("in.jsonl", payload)}, {"purpose": "batch"})
    dest = tmp_path / "f"
    upload = asyncio.run(save_upload(_chunks(body, rng), boundary_of(kind), "file", dest, 1 << 20))
    assert dest.read_bytes() == payload and upload.file_bytes == len(payload)
    assert upload.fields == {"purpose": "batch"} and upload.filename == "in.jsonl"


def test_multipart_limits_and_malformed_bodies(tmp_path):
    kind, body = _form({"file": ("a", b"x" * 1000)}, {"purpose": "batch"})
    rng = random.Random(0)
    with pytest.raises(MultipartError, match="over the limit of 999"):
        asyncio.run(save_upload(_chunks(body, rng), boundary_of(kind), "file", tmp_path / "f", 999))
    with pytest.raises(MultipartError, match="ended early"):
        asyncio.run(save_upload(_chunks(body[:-10], rng), boundary_of(kind), "file", tmp_path / "f", 10**6))
    kind2, body2 = _form({"other": ("a", b"x")}, {"purpose": "batch"})
    with pytest.raises(MultipartError, match="no 'file' part"):
        asyncio.run(save_upload(_chunks(body2, rng), boundary_of(kind2), "file", tmp_path / "f", 10**6))
    endless = b"preamble without a boundary " * 10_000
    with pytest.raises(MultipartError, match="over the limit"):
        asyncio.run(save_upload(_chunks(endless, rng), boundary_of(kind), "file", tmp_path / "f", 1000))
    many, body3 = _form({"file": ("a", b"x")}, {f"f{i}": "v" for i in range(20)})
    with pytest.raises(MultipartError, match="more than 16 parts"):
        asyncio.run(save_upload(_chunks(body3, rng), boundary_of(many), "file", tmp_path / "f", 10**6))
    with pytest.raises(MultipartError, match="multipart/form-data"):
        boundary_of("application/json")
    with pytest.raises(MultipartError, match="boundary"):
        boundary_of("multipart/form-data")


def _line(cid, **body) -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/completions", "body": body})


def test_lines_are_checked_one_by_one_with_their_numbers(tmp_path):
    path = tmp_path / "in.jsonl"
    long = _line("long", prompt="x" * 500)
    rows = [_line("a", prompt="hi"), "", "nope", _line("a", prompt="again"), _line("b", prompt="hi", n="2"),
            _line("c", prompt="hi", stream=True), long, _line("d", prompt=[1, 2], max_tokens=3)]  # fmt: skip
    path.write_text("\n".join(rows) + "\n")
    got = {x.number: x for x in read_lines(path, "/v1/completions", 400)}
    assert sorted(got) == [1, 3, 4, 5, 6, 7, 8]  # the blank line 2 is skipped
    assert got[1].error is None and got[8].error is None and got[8].body.prompt == [1, 2]
    assert got[3].code == "invalid_json_line" and got[4].code == "duplicate_custom_id"
    assert "Expected `int`, got `str`" in got[5].error and "stream" in got[6].error
    assert got[7].code == "line_too_long"
    wrong = list(read_lines(path, "/v1/chat/completions", 400))
    assert {x.code for x in wrong if x.custom_id == "a"} == {"mismatched_endpoint"}
    path.write_text("[1, 2]\nhello\n")
    with pytest.raises(NotJSONL):
        list(read_lines(path, "/v1/completions", 400))


def test_a_result_file_cut_mid_line_is_read_back_without_it(tmp_path):
    path = tmp_path / "out.jsonl"
    out = ResultFile.open(path)
    body = {"id": "cmpl-1", "usage": {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}}
    out.append(answered("a", 200, body))
    out.append(answered("b", 400, {"error": {"message": "bad"}}))
    out.append(refused(None, "invalid_json_line", "line 3 is not valid JSON", 3))
    out.close()
    whole = path.read_bytes()
    path.write_bytes(whole + msgspec.json.encode(answered("c", 200, body))[:40])  # a crash mid-write
    back = ResultFile.open(path)
    assert back.done == {"a", "b"} and back.refused_lines == {3} and back.lines == 3
    assert (back.usage.input_tokens, back.usage.output_tokens) == (5, 2)
    back.append(answered("c", 200, body))
    back.close()
    rows = [msgspec.json.decode(x) for x in path.read_bytes().splitlines()]
    assert [r["custom_id"] for r in rows] == ["a", "b", None, "c"]


def test_a_batch_line_never_goes_ahead_of_its_batch():
    closed, open_ = ServerSettings(), ServerSettings(allow_client_priority=True)
    assert BatchCaller(10).priority(0, closed) == 10
    assert BatchCaller(10).priority(3, open_) == 13 and BatchCaller(10).priority(-5, open_) == 10
    with pytest.raises(APIError, match="priority"):
        BatchCaller(10).priority(3, closed)


def test_the_validation_pass_stops_when_its_batch_is_cancelled(tmp_path):
    """The runner's pass over a file runs on a thread; a cancel sets its event and the pass ends
    at the next line instead of reading the rest of the file."""
    import threading

    from mm_engine.batch.job import report_refused

    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(["nope"] * 3 + [_line(f"l{i}", prompt="hi") for i in range(100)]) + "\n")
    stop = threading.Event()
    read = []

    def lines():
        for line in read_lines(path, "/v1/completions", 400):
            read.append(line.number)
            if len(read) == 5:
                stop.set()  # the cancel arrives while line 5 is being read
            yield line

    out = ResultFile.open(tmp_path / "err.jsonl")
    assert report_refused(lines(), out, stop) == 4 and len(read) == 5
    assert out.refused_lines == {1, 2, 3}
    out.close()
    full = ResultFile.open(tmp_path / "err2.jsonl")
    assert report_refused(read_lines(path, "/v1/completions", 400), full) == 103
    full.close()
