"""Image domains drawn with Pillow: count the shapes, the colour of the largest shape, read the digits.

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
``read_digits`` (answer: the digits, ``4071``): a number written in black in Pillow's default font (its size
  drawn from a range, the position random, the whole number inside the canvas); "What number is written in the
  image?". Level 1: 1-2 digits, level 2: 3-4, level 3: 5-6. The font is Pillow's, so the pixels may differ
  between Pillow versions; the problem key (number, size, place) and so the split do not.
"""

from __future__ import annotations

import base64
import io
import math
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

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


class ImageDomain:
    """An image domain: `draw(domain, rng, level)` makes one task; the canvas, the system prompt, the level check,
    the task around an image and the demonstration (the answer alone) are shared by every image domain."""

    max_level = 3

    def __init__(self, name: str, draw: Callable[[ImageDomain, random.Random, int], Task], canvas: int = 64,
                 system_prompt: str | None = None):
        if not 32 <= canvas <= 512:
            raise TaskError(f"{name}: canvas must be 32..512 pixels, got {canvas}")
        self.name, self.draw, self.canvas, self.system_prompt = name, draw, canvas, system_prompt

    def make_task(self, rng: random.Random, level: int) -> Task:
        if not 1 <= level <= self.max_level:
            raise TaskError(f"{self.name}: level must be in 1..{self.max_level}, got {level}")
        return self.draw(self, rng, level)

    def demonstration(self, task: Task) -> SFTSample:
        return demo_sample(task, task.metadata["answer"], None)

    def shapes_task(self, level: int, shapes: list[Shape], question: str, answer: str) -> Task:
        problem = f"{self.canvas}|{';'.join(s.key for s in shapes)}|{question}"
        return self.image_task(level, render(shapes, self.canvas), problem, question, answer,
                               {"shapes": [s.__dict__ for s in shapes]})

    def image_task(self, level: int, image: Image.Image, problem: str, question: str, answer: str,
                   details: dict) -> Task:
        content = [{"type": "image_url", "image_url": {"url": data_url(image)}}, {"type": "text", "text": question}]
        messages: list[Message] = [{"role": "user", "content": content}]
        if self.system_prompt:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return Task(
            id=task_id(self.name, problem), domain=self.name, difficulty=level, messages=messages,
            verifier="exact", verifier_args={"answer": answer}, max_steps=1, timeout_s=10.0,
            metadata={"problem_key": problem, "answer": answer, "modality": "image", "canvas": self.canvas,
                      **details},
        )


def _count_task(source: ImageDomain, rng: random.Random, level: int) -> Task:
    low, high = {1: (1, 4), 2: (2, 7), 3: (3, 9)}[level]
    count = rng.randint(low, high)
    if level == 1:
        kinds_colours = [(rng.choice(KINDS), rng.choice(list(COLOURS)))] * count
    else:
        kinds_colours = [(rng.choice(KINDS), rng.choice(list(COLOURS))) for _ in range(count)]
    smallest, largest = max(6, source.canvas // 10), max(8, source.canvas // 5)
    shapes = place(rng, kinds_colours, [rng.randint(smallest, largest) for _ in range(count)], source.canvas)
    if level < 3:
        question, answer = "How many shapes are in the image?", count
    else:
        kind = rng.choice(KINDS)
        question, answer = f"How many {kind}s are in the image?", sum(s.kind == kind for s in shapes)
    return source.shapes_task(level, shapes, question, str(answer))


LARGEST_RATIOS = {1: 2.0, 2: 1.5, 3: 1.25}  # the largest shape's area over the second largest's, at least


def _largest_task(source: ImageDomain, rng: random.Random, level: int) -> Task:
    low, high = {1: (2, 2), 2: (3, 4), 3: (4, 6)}[level]
    count = rng.randint(low, high)
    colours = rng.sample(list(COLOURS), count)
    kinds = [rng.choice(KINDS) for _ in range(count)]
    smallest, largest = max(6, source.canvas // 10), max(12, source.canvas * 2 // 5)
    for _ in range(500):
        sizes = [rng.randint(smallest, largest) for _ in range(count)]
        areas = sorted((Shape(k, c, 0, 0, s).area for k, c, s in zip(kinds, colours, sizes)), reverse=True)
        roomy = sum((size + _GAP) ** 2 for size in sizes) <= 0.4 * source.canvas**2  # placeable at random
        if roomy and areas[0] >= LARGEST_RATIOS[level] * areas[1]:
            break
    else:
        raise TaskError(f"{source.name}: no sizes with a clear largest shape at level {level}")
    shapes = place(rng, list(zip(kinds, colours)), sizes, source.canvas)
    answer = max(shapes, key=lambda s: s.area).colour
    question = "What colour is the largest shape in the image? Answer with one word."
    return source.shapes_task(level, shapes, question, answer)


def _digits_task(source: ImageDomain, rng: random.Random, level: int) -> Task:
    low, high = {1: (1, 2), 2: (3, 4), 3: (5, 6)}[level]
    number = "".join(rng.choice("0123456789") for _ in range(rng.randint(low, high)))
    size = rng.randint(max(10, source.canvas // 6), max(12, source.canvas // 4))
    image, box = written(number, size, (0, 0), source.canvas)
    width, height = box[2] - box[0], box[3] - box[1]
    while width > source.canvas - 2 and size > 6:  # a long number at a large size: shrink until it fits
        size -= 1
        image, box = written(number, size, (0, 0), source.canvas)
        width, height = box[2] - box[0], box[3] - box[1]
    x = rng.randint(1, max(1, source.canvas - width - 1)) - box[0]
    y = rng.randint(1, max(1, source.canvas - height - 1)) - box[1]
    image, _ = written(number, size, (x, y), source.canvas)
    question = "What number is written in the image? Answer with the digits."
    problem = f"{source.canvas}|{number}@{x},{y}s{size}|{question}"
    return source.image_task(level, image, problem, question, number,
                           {"number": number, "font_size": size, "at": [x, y]})


def written(text: str, size: int, at: tuple[int, int], canvas: int) -> tuple[Image.Image, tuple[int, int, int, int]]:
    """`text` in black at `at` in Pillow's default font of `size`, and the ink's bounding box."""
    pillow()
    from PIL import Image, ImageDraw, ImageFont

    image = Image.new("RGB", (canvas, canvas), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    font = ImageFont.load_default(size=size)
    draw.text(at, text, fill=(0, 0, 0), font=font)
    return image, draw.textbbox(at, text, font=font)


def _register(name: str, draw: Callable[[ImageDomain, random.Random, int], Task]) -> None:
    def factory(canvas: int = 64, system_prompt: str | None = None) -> ImageDomain:
        return ImageDomain(name, draw, canvas, system_prompt)

    domain(name)(factory)


_register("shape_count", _count_task)
_register("largest_colour", _largest_task)
_register("read_digits", _digits_task)
