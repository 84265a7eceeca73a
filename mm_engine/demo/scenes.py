"""Generated scenes of coloured shapes and the plain-English texts the demo model learns.

A scene holds 1 to 3 non-overlapping shapes (circle, square, triangle) in red, green, blue or
yellow on a white or light-grey background, on an image of random size and aspect ratio. Each
shape's size is 15% to 50% of the image's longer side (and at most its shorter side): the model
squeezes every image to a square, and this keeps the smallest shape over a patch wide there. The
targets use exactly those words:

    caption   "a red circle, a green triangle and a blue square."   (left to right)
    count     "How many shapes are there?"     -> "three."
    colour    "What color is the circle?"      -> "red."   (only when one circle is there)
    yes/no    "Is there a blue square?"        -> "yes." / "no."

Two choices keep every target well defined: shape centres are at least `MIN_DX` of the width
apart, so "left to right" has one answer, and no two shapes of a scene share both colour and kind,
so "Is there a red circle?" and the caption never depend on which of two twins is meant.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from PIL import Image, ImageDraw

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (240, 200, 30),
}
SHAPES = ("circle", "square", "triangle")
NUMBERS = ("zero", "one", "two", "three")

MIN_SIDE, MAX_SIDE = 64, 256  # image sides in pixels
MAX_ASPECT = 1.5  # longer side / shorter side
MIN_SIZE, MAX_SIZE = 0.15, 0.5  # shape size as a fraction of the longer side
MIN_DX = 0.1  # centres at least this fraction of the width apart
COLOUR_JITTER = 12  # per channel, so the model learns colour names rather than exact values

CAPTION_PROMPT = "Describe the image."
COUNT_QUESTION = "How many shapes are there?"
CHAT_PROMPT = "USER: <image> {question} ASSISTANT:"  # what the chat template writes for one turn


@dataclass(frozen=True, slots=True)
class Shape:
    kind: str  # one of SHAPES
    colour: str  # one of COLOURS
    box: tuple[int, int, int, int]  # x0, y0, x1, y1, inclusive, in image pixels

    @property
    def cx(self) -> float:
        return (self.box[0] + self.box[2]) / 2

    @property
    def name(self) -> str:
        return f"{self.colour} {self.kind}"


@dataclass(frozen=True, slots=True)
class Scene:
    image: Image.Image
    shapes: tuple[Shape, ...]  # left to right

    @property
    def size(self) -> tuple[int, int]:
        return self.image.size


def draw_shape(draw: ImageDraw.ImageDraw, shape: Shape, fill: int | tuple[int, int, int]) -> None:
    x0, y0, x1, y1 = shape.box
    if shape.kind == "circle":
        draw.ellipse(shape.box, fill=fill)
    elif shape.kind == "square":
        draw.rectangle(shape.box, fill=fill)
    else:  # upright triangle filling its box
        draw.polygon([((x0 + x1) / 2, y0), (x1, y1), (x0, y1)], fill=fill)


def random_image_size(rng: random.Random) -> tuple[int, int]:
    while True:
        w, h = rng.randint(MIN_SIDE, MAX_SIDE), rng.randint(MIN_SIDE, MAX_SIDE)
        if max(w, h) <= MAX_ASPECT * min(w, h):
            return w, h


def _place(rng: random.Random, n: int, w: int, h: int) -> list[tuple[int, int, int, int]] | None:
    """n square boxes that do not overlap (2 px apart) and whose centres are MIN_DX*w apart."""
    boxes: list[tuple[int, int, int, int]] = []
    for _ in range(n):
        for _attempt in range(50):
            s = min(round(rng.uniform(MIN_SIZE, MAX_SIZE) * max(w, h)), min(w, h))
            x0, y0 = rng.randint(0, w - s), rng.randint(0, h - s)
            box = (x0, y0, x0 + s - 1, y0 + s - 1)
            cx = x0 + (s - 1) / 2
            if all(
                abs(cx - (b[0] + b[2]) / 2) >= MIN_DX * w
                and (box[0] > b[2] + 2 or b[0] > box[2] + 2 or box[1] > b[3] + 2 or b[1] > box[3] + 2)
                for b in boxes
            ):
                boxes.append(box)
                break
        else:
            return None
    return boxes


def random_scene(rng: random.Random, n_shapes: int | None = None) -> Scene:
    """A scene drawn from `rng` alone, so a seed gives the same scenes on every machine."""
    n = n_shapes if n_shapes is not None else rng.randint(1, 3)
    if not 1 <= n <= 3:
        raise ValueError(f"a scene has 1 to 3 shapes, not {n}")
    while True:
        w, h = random_image_size(rng)
        boxes = _place(rng, n, w, h)
        if boxes is not None:
            break
    kinds = rng.sample([(k, c) for k in SHAPES for c in COLOURS], n)  # no two alike
    shapes = sorted((Shape(k, c, b) for (k, c), b in zip(kinds, boxes, strict=True)), key=lambda s: s.cx)
    grey = 255 if rng.random() < 0.5 else rng.randint(205, 235)
    image = Image.new("RGB", (w, h), (grey, grey, grey))
    draw = ImageDraw.Draw(image)
    for shape in shapes:
        jitter = [rng.randint(-COLOUR_JITTER, COLOUR_JITTER) for _ in range(3)]
        rgb = tuple(min(255, max(0, v + j)) for v, j in zip(COLOURS[shape.colour], jitter, strict=True))
        draw_shape(draw, shape, rgb)
    return Scene(image, tuple(shapes))


def held_out_scenes(n: int, seed: int = 0) -> list[Scene]:
    """Evaluation scenes, a third with each number of shapes, from a seed stream ("held-out-N")
    that training never draws from."""
    rng = random.Random(f"held-out-{seed}")
    return [random_scene(rng, n_shapes=i % 3 + 1) for i in range(n)]


def caption(shapes: tuple[Shape, ...] | Scene) -> str:
    """Every shape with its colour, left to right: 'a red circle and a blue square.'"""
    if isinstance(shapes, Scene):
        shapes = shapes.shapes
    names = [f"a {s.name}" for s in shapes]
    if len(names) == 1:
        return names[0] + "."
    return ", ".join(names[:-1]) + " and " + names[-1] + "."


def count_answer(shapes: tuple[Shape, ...]) -> str:
    return NUMBERS[len(shapes)] + "."


def colour_question(kind: str) -> str:
    return f"What color is the {kind}?"


def yes_no_question(colour: str, kind: str) -> str:
    return f"Is there a {colour} {kind}?"


def colour_questions(shapes: tuple[Shape, ...]) -> list[tuple[str, str]]:
    """(question, answer) for every kind present exactly once; asking about twins is ambiguous."""
    kinds = [s.kind for s in shapes]
    return [(colour_question(s.kind), s.colour + ".") for s in shapes if kinds.count(s.kind) == 1]


def yes_no_questions(shapes: tuple[Shape, ...], rng: random.Random) -> list[tuple[str, str]]:
    """One question answered yes (a shape of the scene) and one answered no.

    Half of the no-questions are near misses (a present colour with another kind, or a present
    kind in another colour), so "yes" must come from the pair, not from one word."""
    present = {(s.colour, s.kind) for s in shapes}
    colour, kind = rng.choice(sorted(present))
    absent = sorted((c, k) for c in COLOURS for k in SHAPES if (c, k) not in present)
    near = [(c, k) for c, k in absent if any(c == pc or k == pk for pc, pk in present)]
    no_colour, no_kind = rng.choice(near if near and rng.random() < 0.5 else absent)
    return [(yes_no_question(colour, kind), "yes."), (yes_no_question(no_colour, no_kind), "no.")]


def qa_pairs(scene: Scene, rng: random.Random) -> list[tuple[str, str]]:
    """Every target of a scene: caption, count, colour and yes/no questions with their answers."""
    pairs = [(CAPTION_PROMPT, caption(scene)), (COUNT_QUESTION, count_answer(scene.shapes))]
    return pairs + colour_questions(scene.shapes) + yes_no_questions(scene.shapes, rng)


def prompt(question: str) -> str:
    """The plain prompt the demo model expects for one image and one question."""
    return CHAT_PROMPT.format(question=question)
