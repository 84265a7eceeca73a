"""What a captioning job captions: image and video files, folders, globs and JSONL manifests
turned into a deterministic list of `CaptionInput`s, `--shard i/n` to split that list between machines, and
`--resume` to leave out what a results file already has.

Only names and prompts are listed here (a few hundred bytes an input); images are read later, a
bounded number at a time, by the job.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

from mm_engine.vision.image_io import ImageLimits

MANIFEST_SUFFIXES = (".jsonl", ".ndjson")
# Clips are known by extension (their containers have no short magic number in common).
VIDEO_EXTENSIONS = frozenset({".mp4", ".m4v", ".mov", ".mkv", ".webm", ".avi"})


@dataclass(slots=True)
class CaptionInput:
    """One thing to caption. `image` is the name written to the results; `path` is where the bytes
    are read from (they differ for manifest entries relative to the manifest's folder); `data`,
    when set, is the encoded image itself (e.g. bytes from Ray Data) and nothing is read."""

    id: str
    image: str | None
    path: str | None = None
    prompt: str | None = None  # None: the job's prompt
    data: bytes | None = None
    error: str | None = None  # set when the input is broken before any image is read (a bad manifest line)
    video: bool = False  # a clip: `image` then names the video


def _allowed_formats() -> frozenset[str]:
    return ImageLimits().allowed_formats


def image_extensions() -> frozenset[str]:
    """Extensions Pillow maps to the formats the engine accepts (.png, .jpg, .jpeg, .webp, ...)."""
    allowed = _allowed_formats()
    return frozenset(ext for ext, fmt in Image.registered_extensions().items() if fmt in allowed)


def looks_like_image(path: str | os.PathLike) -> bool:
    """Whether the file starts like an image of an allowed format (only the first bytes are read)."""
    try:
        with open(path, "rb") as f:
            prefix = f.read(16)
    except OSError:
        return False
    Image.init()
    for fmt in _allowed_formats():
        accept = Image.OPEN.get(fmt, (None, None))[1]
        verdict = accept(prefix) if accept is not None else False
        if verdict and not isinstance(verdict, str):  # a str is Pillow's "recognised, unsupported"
            return True
    return False


def is_image_file(path: str | os.PathLike, extensions: frozenset[str]) -> bool:
    return os.path.splitext(path)[1].lower() in extensions or looks_like_image(path)


def is_video_file(path: str | os.PathLike) -> bool:
    return os.path.splitext(path)[1].lower() in VIDEO_EXTENSIONS


def _input(path: str) -> CaptionInput:
    return CaptionInput(path, path, path, video=is_video_file(path))


def walk_folder(folder: str) -> list[str]:
    """Image and video files under `folder`, recursively, sorted by path components so the order is the same
    on every machine and run. Hidden files and folders (a leading '.') are left out, as globs do;
    an image-named file that turns out not to decode is still listed (and later gets an error)."""
    extensions = image_extensions()
    found: list[tuple[str, ...]] = []
    for root, dirs, files in os.walk(folder):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        rel = Path(root).relative_to(folder).parts
        for name in files:
            path = os.path.join(root, name)
            if not name.startswith(".") and (is_video_file(name) or is_image_file(path, extensions)):
                found.append((*rel, name))
    found.sort()
    base = Path(folder)
    return [base.joinpath(*parts).as_posix() for parts in found]


def read_manifest(manifest: str) -> Iterator[CaptionInput]:
    """`{"image": path, "prompt": optional, "id": optional}` per line (`"video": path` for a clip);
    a relative path is relative to the manifest's folder. A broken line becomes an input with
    `error` set, never a silent skip."""
    base = Path(manifest).parent
    with open(manifest, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{manifest}:{lineno}"
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                yield CaptionInput(where, None, error=f"manifest line {lineno} is not valid JSON")
                continue
            problem = _manifest_problem(entry)
            if problem:
                yield CaptionInput(where, None, error=f"manifest line {lineno}: {problem}")
                continue
            video = "video" in entry
            image = entry["video" if video else "image"]
            raw_id = entry.get("id")
            yield CaptionInput(
                id=image if raw_id is None else str(raw_id),
                image=image,
                path=(base / image).as_posix(),
                prompt=entry.get("prompt"),
                video=video,
            )


def _manifest_problem(entry: object) -> str | None:
    if not isinstance(entry, dict):
        return "must be a JSON object"
    if "image" in entry and "video" in entry:
        return "has both 'image' and 'video': one input per line"
    key = "video" if "video" in entry else "image"
    if not isinstance(entry.get(key), str) or not entry[key]:
        return "needs an 'image' (or 'video') path"
    if "://" in entry[key]:
        return f"'{key}' must be a local path (URLs are not fetched)"
    if entry.get("prompt") is not None and not isinstance(entry["prompt"], str):
        return "'prompt' must be a string"
    if entry.get("id") is not None and not isinstance(entry["id"], str | int):
        return "'id' must be a string or an integer"
    unknown = set(entry) - {"image", "video", "prompt", "id"}
    if unknown:
        return f"unknown field(s) {', '.join(sorted(unknown))}"
    return None


def _expand(spec: str) -> Iterator[CaptionInput]:
    if os.path.isdir(spec):
        for path in walk_folder(spec):
            yield _input(path)
    elif os.path.isfile(spec):
        if spec.lower().endswith(MANIFEST_SUFFIXES):
            yield from read_manifest(spec)
        else:  # named explicitly: an input whatever its extension (a clip by its extension)
            yield _input(spec)
    elif glob.has_magic(spec):
        matches = sorted(glob.glob(spec, recursive=True))
        if not matches:
            raise ValueError(f"no file matches {spec!r}")
        extensions = image_extensions()
        for match in matches:  # each match as if named, except that non-image files are left out
            if os.path.isdir(match) or match.lower().endswith(MANIFEST_SUFFIXES):
                yield from _expand(match)
            elif is_video_file(match) or is_image_file(match, extensions):
                yield _input(match)
    else:
        raise ValueError(f"{spec!r} is not a file, a folder or a glob that matches anything")


def discover(specs: Iterable[str]) -> list[CaptionInput]:
    """All inputs named by `specs`, in order. Ids are made unique: a repeated id (the same file
    named twice, one image with several prompts in a manifest) gets `#2`, `#3`, ... in order of
    appearance, so every input has its own line and `--resume` can tell them apart."""
    used: set[str] = set()
    last_suffix: dict[str, int] = {}
    out: list[CaptionInput] = []
    for spec in specs:
        for inp in _expand(os.fspath(spec)):
            base = inp.id
            if base in used:
                k = last_suffix.get(base, 1) + 1
                while f"{base}#{k}" in used:  # "a.png#2" may itself be an id that was given
                    k += 1
                last_suffix[base] = k
                inp.id = f"{base}#{k}"
            used.add(inp.id)
            out.append(inp)
    return out


def parse_shard(value: str | tuple[int, int] | None) -> tuple[int, int] | None:
    """`"i/n"` (or `(i, n)`) with 0 <= i < n."""
    if value is None:
        return None
    if isinstance(value, str):
        index, sep, count = value.partition("/")
        if not (sep and index.strip().isdigit() and count.strip().isdigit()):
            raise ValueError(f"shard must look like i/n (e.g. 0/4), got {value!r}")
        value = (int(index), int(count))
    index, count = value
    if count < 1 or not 0 <= index < count:
        raise ValueError(f"shard i/n needs 0 <= i < n, got {index}/{count}")
    return index, count


def in_shard(input_id: str, shard: tuple[int, int] | None) -> bool:
    """Whether `input_id` belongs to shard i of n. A hash of the id (not the position in the list),
    so shards stay disjoint and stable when files are added to the folder between runs."""
    if shard is None:
        return True
    index, count = shard
    digest = hashlib.sha256(input_id.encode("utf-8", "surrogateescape")).digest()
    return int.from_bytes(digest[:8], "big") % count == index


def read_done_ids(path: Path) -> set[str]:
    """Ids of the complete lines of a results file. A last line without its newline (the job was
    killed while writing it) is cut off, so that appended lines start on a line of their own."""
    done: set[str] = set()
    offset = 0
    with open(path, "r+b") as f:
        for line in f:
            if not line.endswith(b"\n"):
                f.truncate(offset)
                break
            offset += len(line)
            try:
                rec = json.loads(line)
            except ValueError:
                continue  # not one of ours: its input is captioned again
            if isinstance(rec, dict) and isinstance(rec.get("id"), str):
                done.add(rec["id"])
    return done


def check_output(path: Path, resume: bool, overwrite: bool) -> set[str]:
    """The ids `path` already has when resuming; refuse to mix a new job into old results."""
    if resume and overwrite:
        raise ValueError("resume and overwrite exclude each other")
    if path.is_dir():
        raise ValueError(f"the output {str(path)!r} is a folder; give a file name like results.jsonl")
    path.parent.mkdir(parents=True, exist_ok=True)
    if overwrite or not path.exists() or path.stat().st_size == 0:
        return set()
    if not resume:
        raise ValueError(f"{str(path)!r} already exists; pass --resume to continue it or --overwrite")
    return read_done_ids(path)
