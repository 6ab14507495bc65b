"""Image domains drawn with Pillow: count the shapes, and the colour of the largest shape.

A scene is a few filled circles, squares and triangles on a white canvas, placed so that no two overlap (their
bounding boxes keep a gap), so every shape is a separate blob and the count is unambiguous. The task's user message
holds the image as a PNG ``data:`` URL in an OpenAI-style ``image_url`` part followed by the question, so the prompt
is plain JSON chat that `posttrain.data.validate_vision_record` reads; the answer is judged by the ``exact``
verifier. The problem key is the scene itself (kind, colour, place and size of every shape, and the question), and
the held-out split is by its hash like every other domain.

``shape_count`` (answer: a number, ``3``):
    level 1: 1-4 shapes of one kind and one colour; "How many shapes are in the image?"
    level 2: 2-7 shapes of mixed kinds and colours; the same question
    level 3: 3-9 mixed shapes; "How many circles (squares, triangles) are in the image?" (0 is a possible answer)
``largest_colour`` (answer: a colour name, ``blue``): every shape has its own colour, and the largest's area is at
least `ratio` times the second largest's:
    level 1: 2 shapes, ratio 2.0;  level 2: 3-4 shapes, ratio 1.5;  level 3: 4-6 shapes, ratio 1.25
Areas are the drawn shapes' geometric areas (a circle pi r^2, a square s^2, a triangle s^2 / 2).
"""

from __future__ import annotations

import base64
import io
import math
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING

from posttrain.data import SFTSample, pillow
from posttrain.tasks.base import TaskError, demo_sample, domain, task_id
from posttrain.types import Message, Task

if TYPE_CHECKING:  # Pillow is the `vision` extra, imported when a scene is drawn
    from PIL import Image

KINDS = ("circle", "square", "triangle")
COLOURS = {"red": (220, 30, 30), "green": (30, 160, 50), "blue": (40, 70, 220), "yellow": (235, 200, 20),
           "purple": (140, 50, 170), "orange": (245, 130, 20), "black": (0, 0, 0)}
_GAP = 3  # pixels kept between bounding boxes


@dataclass(frozen=True)
class Shape:
    kind: str
    colour: str
    x: int  # top-left corner of the bounding box
    y: int
    size: int  # side of the bounding box (a circle's diameter)

    @property
    def area(self) -> float:
        if self.kind == "circle":
            return math.pi * (self.size / 2) ** 2
        return float(self.size**2) if self.kind == "square" else self.size**2 / 2

    @property
    def key(self) -> str:
        return f"{self.kind[0]}{self.colour}@{self.x},{self.y}s{self.size}"


def render(shapes: list[Shape], canvas: int) -> Image.Image:
    """The scene as an RGB image on a white canvas."""
    pillow()  # a clear error naming the extra when Pillow is missing
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (canvas, canvas), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    for shape in shapes:
        box = (shape.x, shape.y, shape.x + shape.size - 1, shape.y + shape.size - 1)
        fill = COLOURS[shape.colour]
        if shape.kind == "circle":
            draw.ellipse(box, fill=fill)
        elif shape.kind == "square":
            draw.rectangle(box, fill=fill)
        else:  # right isosceles triangle: half the box
            draw.polygon([(box[0], box[3]), (box[2], box[3]), (box[0], box[1])], fill=fill)
    return image


def data_url(image: Image.Image) -> str:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", optimize=True)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


def place(rng: random.Random, kinds_colours: list[tuple[str, str]], sizes: list[int], canvas: int) -> list[Shape]:
    """Shapes of the given kinds, colours and sizes at random places, no two bounding boxes within `_GAP`."""
    for _ in range(200):
        shapes: list[Shape] = []
        for (kind, colour), size in zip(kinds_colours, sizes):
            for _ in range(100):
                x, y = rng.randint(1, canvas - size - 1), rng.randint(1, canvas - size - 1)
                if all(_apart(x, y, size, other) for other in shapes):
                    shapes.append(Shape(kind, colour, x, y, size))
                    break
            else:
                break
        if len(shapes) == len(sizes):
            return shapes
    raise TaskError(f"could not place {len(sizes)} shapes of sizes {sizes} on a {canvas}px canvas")


def _apart(x: int, y: int, size: int, other: Shape) -> bool:
    return (x + size + _GAP <= other.x or other.x + other.size + _GAP <= x
            or y + size + _GAP <= other.y or other.y + other.size + _GAP <= y)


class _Scenes:
    """What both domains share: the canvas, the system prompt, level checks and the task around a scene."""

    def __init__(self, name: str, max_level: int, canvas: int, system_prompt: str | None):
        if not 32 <= canvas <= 512:
            raise TaskError(f"{name}: canvas must be 32..512 pixels, got {canvas}")
        self.name, self.max_level, self.canvas, self.system_prompt = name, max_level, canvas, system_prompt

    def check(self, level: int) -> None:
        if not 1 <= level <= self.max_level:
            raise TaskError(f"{self.name}: level must be in 1..{self.max_level}, got {level}")

    def task(self, level: int, shapes: list[Shape], question: str, answer: str) -> Task:
        problem = f"{self.canvas}|{';'.join(s.key for s in shapes)}|{question}"
        content = [{"type": "image_url", "image_url": {"url": data_url(render(shapes, self.canvas))}},
                   {"type": "text", "text": question}]
        messages: list[Message] = [{"role": "user", "content": content}]
        if self.system_prompt:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return Task(
            id=task_id(self.name, problem), domain=self.name, difficulty=level, messages=messages,
            verifier="exact", verifier_args={"answer": answer}, max_steps=1, timeout_s=10.0,
            metadata={"problem_key": problem, "answer": answer, "modality": "image",
                      "shapes": [s.__dict__ for s in shapes], "canvas": self.canvas},
        )


@domain("shape_count")
class ShapeCount:
    name = "shape_count"
    max_level = 3

    def __init__(self, canvas: int = 64, system_prompt: str | None = None):
        self.scenes = _Scenes(self.name, self.max_level, canvas, system_prompt)
        self.canvas = canvas

    def make_task(self, rng: random.Random, level: int) -> Task:
        self.scenes.check(level)
        low, high = {1: (1, 4), 2: (2, 7), 3: (3, 9)}[level]
        count = rng.randint(low, high)
        if level == 1:
            kinds_colours = [(rng.choice(KINDS), rng.choice(list(COLOURS)))] * count
        else:
            kinds_colours = [(rng.choice(KINDS), rng.choice(list(COLOURS))) for _ in range(count)]
        smallest, largest = max(6, self.canvas // 10), max(8, self.canvas // 5)
        shapes = place(rng, kinds_colours, [rng.randint(smallest, largest) for _ in range(count)], self.canvas)
        if level < 3:
            question, answer = "How many shapes are in the image?", count
        else:
            kind = rng.choice(KINDS)
            question, answer = f"How many {kind}s are in the image?", sum(s.kind == kind for s in shapes)
        return self.scenes.task(level, shapes, question, str(answer))

    def demonstration(self, task: Task) -> SFTSample:
        return demo_sample(task, task.metadata["answer"], None)


@domain("largest_colour")
class LargestColour:
    name = "largest_colour"
    max_level = 3
    RATIOS = {1: 2.0, 2: 1.5, 3: 1.25}

    def __init__(self, canvas: int = 64, system_prompt: str | None = None):
        self.scenes = _Scenes(self.name, self.max_level, canvas, system_prompt)
        self.canvas = canvas

    def make_task(self, rng: random.Random, level: int) -> Task:
        self.scenes.check(level)
        low, high = {1: (2, 2), 2: (3, 4), 3: (4, 6)}[level]
        count = rng.randint(low, high)
        colours = rng.sample(list(COLOURS), count)
        kinds = [rng.choice(KINDS) for _ in range(count)]
        smallest, largest = max(6, self.canvas // 10), max(12, self.canvas * 2 // 5)
        for _ in range(500):
            sizes = [rng.randint(smallest, largest) for _ in range(count)]
            areas = sorted((Shape(k, c, 0, 0, s).area for k, c, s in zip(kinds, colours, sizes)), reverse=True)
            roomy = sum((size + _GAP) ** 2 for size in sizes) <= 0.4 * self.canvas**2  # placeable at random
            if roomy and areas[0] >= self.RATIOS[level] * areas[1]:
                break
        else:
            raise TaskError(f"{self.name}: no sizes with a clear largest shape at level {level}")
        shapes = place(rng, list(zip(kinds, colours)), sizes, self.canvas)
        answer = max(shapes, key=lambda s: s.area).colour
        question = "What colour is the largest shape in the image? Answer with one word."
        return self.scenes.task(level, shapes, question, answer)

    def demonstration(self, task: Task) -> SFTSample:
        return demo_sample(task, task.metadata["answer"], None)
