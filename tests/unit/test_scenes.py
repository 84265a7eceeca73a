"""The scene generator draws what its shapes say, and the target texts follow from the shapes."""

from __future__ import annotations

import random

import numpy as np
import pytest

from mm_engine.demo import scenes
from mm_engine.demo.scenes import Shape


def _scenes(n: int, seed: int = 0) -> list[scenes.Scene]:
    rng = random.Random(seed)
    return [scenes.random_scene(rng) for _ in range(n)]


def test_same_seed_same_scenes():
    a, b = _scenes(20, seed=3), _scenes(20, seed=3)
    for x, y in zip(a, b, strict=True):
        assert x.shapes == y.shapes
        assert x.image.tobytes() == y.image.tobytes()
    assert [s.shapes for s in _scenes(20, seed=4)] != [s.shapes for s in a]


def test_layout_rules():
    seen_counts, seen_sizes = set(), set()
    for scene in _scenes(400):
        w, h = scene.size
        assert min(w, h) >= scenes.MIN_SIDE and max(w, h) <= scenes.MAX_SIDE
        assert max(w, h) <= scenes.MAX_ASPECT * min(w, h)
        seen_sizes.add((w, h))
        shapes = scene.shapes
        seen_counts.add(len(shapes))
        assert [s.cx for s in shapes] == sorted(s.cx for s in shapes)
        assert len({(s.colour, s.kind) for s in shapes}) == len(shapes)  # no twins
        for s in shapes:
            x0, y0, x1, y1 = s.box
            assert x0 >= 0 and y0 >= 0 and x1 < w and y1 < h
            side = x1 - x0 + 1
            assert side == y1 - y0 + 1
            assert scenes.MIN_SIZE * max(w, h) - 1 <= side <= min(scenes.MAX_SIZE * max(w, h) + 1, min(w, h))
        for a, b in zip(shapes, shapes[1:], strict=False):
            assert b.cx - a.cx >= scenes.MIN_DX * w
        for i, a in enumerate(shapes):
            for b in shapes[i + 1 :]:
                apart_x = a.box[2] < b.box[0] or b.box[2] < a.box[0]
                apart_y = a.box[3] < b.box[1] or b.box[3] < a.box[1]
                assert apart_x or apart_y
    assert seen_counts == {1, 2, 3}
    assert len(seen_sizes) > 100


def test_pixels_show_the_shapes():
    """The centre of each shape's box (the triangle's: lower middle) has the shape's colour, and
    the background is white or light grey."""
    for scene in _scenes(100, seed=1):
        pixels = np.asarray(scene.image).astype(int)
        for s in scene.shapes:
            x0, y0, x1, y1 = s.box
            cy = (y0 + 3 * y1) // 4 if s.kind == "triangle" else (y0 + y1) // 2
            rgb = pixels[cy, (x0 + x1) // 2]
            assert np.abs(rgb - np.array(scenes.COLOURS[s.colour])).max() <= scenes.COLOUR_JITTER
        corners = [pixels[y, x] for y in (0, -1) for x in (0, -1)]  # a shape may cover some
        assert any((p == p[0]).all() and p[0] >= 205 for p in corners)


def _shape(kind: str, colour: str, x: int) -> Shape:
    return Shape(kind, colour, (x, 10, x + 20, 30))


def test_caption_and_count():
    one = (_shape("circle", "red", 0),)
    two = (*one, _shape("square", "blue", 50))
    three = (*two, _shape("triangle", "green", 90))
    assert scenes.caption(one) == "a red circle."
    assert scenes.caption(two) == "a red circle and a blue square."
    assert scenes.caption(three) == "a red circle, a blue square and a green triangle."
    assert [scenes.count_answer(s) for s in (one, two, three)] == ["one.", "two.", "three."]


def test_colour_questions_only_when_unambiguous():
    shapes = (_shape("circle", "red", 0), _shape("circle", "blue", 40), _shape("square", "yellow", 80))
    assert scenes.colour_questions(shapes) == [("What color is the square?", "yellow.")]


@pytest.mark.parametrize("seed", range(5))
def test_yes_no_questions(seed):
    rng = random.Random(seed)
    for scene in _scenes(50, seed=seed):
        (yes_q, yes_a), (no_q, no_a) = scenes.yes_no_questions(scene.shapes, rng)
        assert (yes_a, no_a) == ("yes.", "no.")
        names = {s.name for s in scene.shapes}
        assert yes_q.removeprefix("Is there a ").removesuffix("?") in names
        assert no_q.removeprefix("Is there a ").removesuffix("?") not in names


def test_qa_pairs_and_prompt():
    rng = random.Random(0)
    scene = scenes.random_scene(rng, n_shapes=2)
    pairs = scenes.qa_pairs(scene, rng)
    assert pairs[0] == (scenes.CAPTION_PROMPT, scenes.caption(scene))
    assert pairs[1] == (scenes.COUNT_QUESTION, "two.")
    assert scenes.prompt("Describe the image.") == "USER: <image> Describe the image. ASSISTANT:"
    with pytest.raises(ValueError):
        scenes.random_scene(rng, n_shapes=4)
