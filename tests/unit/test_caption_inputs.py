"""What a captioning job takes as its inputs (folders, globs, manifests, explicit files), how
`--shard i/n` splits them, and how `--resume` reads a results file. No model is needed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from helpers.images import make_image
from mm_engine.jobs.caption_inputs import discover, in_shard, parse_shard, read_done_ids


def _png(path: Path, seed: int = 0) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    make_image(seed, (8, 8)).save(path, "PNG")
    return path


def _ids(specs) -> list[str]:
    return [inp.id for inp in discover([str(s) for s in specs])]


def test_folder_is_recursive_sorted_and_sniffs_content(tmp_path):
    root = tmp_path / "imgs"
    for rel in ["b.png", "a/z.jpg", "a/b/c.gif", "a.webp", "B.PNG", "c/d.bmp"]:
        _png(root / rel)  # the extension need not match the content: it is decoded later
    _png(root / "no_extension")  # an image by content: an input
    (root / "notes.txt").write_text("not an image")  # neither extension nor content: not an input
    (root / "fake.jpg").write_text("an image name, text inside")  # an input (it will get an error line)
    _png(root / ".hidden.png")
    _png(root / ".cache" / "x.png")
    got = _ids([root])
    names = [Path(p).relative_to(root).as_posix() for p in got]
    expected = ["B.PNG", "a/b/c.gif", "a/z.jpg", "a.webp", "b.png", "c/d.bmp", "fake.jpg", "no_extension"]
    assert names == expected
    assert got == _ids([root])  # the same order every time


def test_globs_and_explicit_files(tmp_path):
    for rel in ["x/1.png", "x/2.jpg", "x/deep/3.png"]:
        _png(tmp_path / rel)
    (tmp_path / "x" / "readme.md").write_text("hi")
    base = tmp_path.as_posix()
    assert _ids([f"{base}/x/*.png"]) == [f"{base}/x/1.png"]
    assert _ids([f"{base}/x/**/*.png"]) == [f"{base}/x/1.png", f"{base}/x/deep/3.png"]
    # A glob matching a folder takes the folder's images; the markdown file is not one.
    assert _ids([f"{base}/x*"]) == [f"{base}/x/1.png", f"{base}/x/2.jpg", f"{base}/x/deep/3.png"]
    # A file named explicitly is an input whatever it holds (here it will get an error line).
    assert _ids([f"{base}/x/readme.md"]) == [f"{base}/x/readme.md"]
    with pytest.raises(ValueError, match="no file matches"):
        discover([f"{base}/x/*.tiff"])
    with pytest.raises(ValueError, match="not a file, a folder or a glob"):
        discover([f"{base}/missing.png"])


def test_manifest_lines_paths_prompts_ids_and_broken_lines(tmp_path):
    _png(tmp_path / "data" / "cat.png")
    manifest = tmp_path / "data" / "list.jsonl"
    lines = [
        {"image": "cat.png"},
        {"image": "cat.png", "prompt": "what color"},  # the same image again: id made unique
        {"image": "cat.png", "id": 7, "prompt": "how many"},
        "{not json",
        {"prompt": "no image"},
        {"image": "https://example.com/a.png"},
        {"image": "cat.png", "extra": 1},
        {"image": "/abs/elsewhere.png", "id": "e"},
    ]
    text = "\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines)
    manifest.write_text(text + "\n\n")
    got = discover([str(manifest)])
    assert [i.id for i in got] == [
        "cat.png",
        "cat.png#2",
        "7",
        f"{manifest}:4",
        f"{manifest}:5",
        f"{manifest}:6",
        f"{manifest}:7",
        "e",
    ]
    # Relative paths are read next to the manifest; the results keep the name as written.
    assert got[0].image == "cat.png" and got[0].path == (tmp_path / "data" / "cat.png").as_posix()
    assert [i.prompt for i in got[:3]] == [None, "what color", "how many"]
    assert got[7].path == "/abs/elsewhere.png"
    errors = [i.error for i in got[3:7]]
    assert all(errors) and "not valid JSON" in errors[0] and "'image'" in errors[1]
    assert "URLs are not fetched" in errors[2] and "unknown field" in errors[3]
    assert all(i.error is None for i in got[:3] + got[7:])


def test_repeated_ids_get_suffixes_that_do_not_collide(tmp_path):
    img = _png(tmp_path / "a.png")
    manifest = tmp_path / "m.jsonl"
    manifest.write_text("\n".join(json.dumps({"image": "a.png", "id": i}) for i in ["k", "k#2", "k", "k"]))
    assert _ids([manifest]) == ["k", "k#2", "k#3", "k#4"]
    assert _ids([img, img]) == [str(img), f"{img}#2"]


def test_shards_partition_the_inputs_stably(tmp_path):
    ids = [f"img_{i:04d}.png" for i in range(1000)]
    for n in (1, 2, 3, 8):
        shards = [{x for x in ids if in_shard(x, (i, n))} for i in range(n)]
        assert sum(len(s) for s in shards) == len(ids) and set().union(*shards) == set(ids)
        assert all(len(s) > len(ids) / n / 2 for s in shards)  # a hash spreads them evenly enough
    # Fixed by the id alone (not Python's per-process salted hash(), not the position in the list),
    # so every machine agrees and a folder that grows keeps its old files where they were.
    halves = [[x for x in "abcdefgh" if in_shard(f"{x}.png", (i, 2))] for i in range(2)]
    assert halves == [["a", "b", "d", "g"], ["c", "e", "f", "h"]]
    assert parse_shard("1/4") == (1, 4) and parse_shard((0, 1)) == (0, 1) and parse_shard(None) is None
    for bad in ["4/4", "-1/2", "1", "a/b", "1/0", "0/2/3"]:
        with pytest.raises(ValueError, match="shard"):
            parse_shard(bad)


def test_read_done_ids_cuts_a_half_written_last_line(tmp_path):
    out = tmp_path / "results.jsonl"
    out.write_text('{"id": "a", "caption": "x"}\n{"id": "b", "error": "bad"}\nnot json\n{"id": "c", "capt')
    assert read_done_ids(out) == {"a", "b"}
    assert out.read_text().endswith('"bad"}\nnot json\n')  # the next line will start cleanly
    assert read_done_ids(out) == {"a", "b"}
