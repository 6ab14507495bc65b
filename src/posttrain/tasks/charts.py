"""A chart domain drawn with Pillow: read one bar's value from a bar chart (``bar_value``).

The chart: 2-5 vertical bars of distinct colours standing on a black baseline, with a light grey gridline at every
unit of value, so a bar's value is the number of grid cells it fills (its height is exactly ``value * unit`` pixels,
``unit = (canvas - 2 * margin) // max_value``). The question names a bar by its colour ("What is the value of the
blue bar? Answer with a number."); the answer is the integer value, judged by the ``exact`` verifier.

    level 1: 2-3 bars, values 1-4       level 2: 3-4 bars, values 1-8       level 3: 4-5 bars, values 1-12

Pillow draws it (no matplotlib needed): the pixels are a function of the problem alone, and the problem key (the
bars' colours and values, which bar is asked) decides the held-out split by its hash as in every domain.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

from posttrain.data import pillow
from posttrain.tasks.shapes import COLOURS, ImageDomain, _register
from posttrain.types import Task

if TYPE_CHECKING:
    from PIL import Image

MARGIN = 3  # pixels between the canvas edge and the plot area
GRID = (215, 215, 215)
BAR_COLOURS = ("red", "green", "blue", "orange", "purple")  # distinct from the black baseline and the grey grid
LEVELS = {1: ((2, 3), 4), 2: ((3, 4), 8), 3: ((4, 5), 12)}  # (bar count range, largest value)


def bar_chart(values: list[tuple[str, int]], max_value: int, canvas: int) -> Image.Image:
    """Bars of (colour, value), left to right, on a white canvas with a gridline per unit and a black baseline."""
    pillow()
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (canvas, canvas), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    unit = (canvas - 2 * MARGIN) // max_value
    base = MARGIN + unit * max_value  # the baseline's row
    for level in range(1, max_value + 1):
        draw.line([(MARGIN, base - level * unit), (canvas - MARGIN - 1, base - level * unit)], fill=GRID)
    slot = (canvas - 2 * MARGIN) // len(values)
    width = max(2, slot * 2 // 3)
    for index, (colour, value) in enumerate(values):
        left = MARGIN + index * slot + (slot - width) // 2
        draw.rectangle([left, base - value * unit, left + width - 1, base - 1], fill=COLOURS[colour])
    draw.line([(MARGIN, base), (canvas - MARGIN - 1, base)], fill=(0, 0, 0))
    return image


def _bar_task(source: ImageDomain, rng: random.Random, level: int) -> Task:
    (low, high), max_value = LEVELS[level]
    colours = rng.sample(BAR_COLOURS, rng.randint(low, high))
    values = [(colour, rng.randint(1, max_value)) for colour in colours]
    asked, answer = rng.choice(values)
    question = f"What is the value of the {asked} bar? Answer with a number."
    problem = f"{source.canvas}|{','.join(f'{c}={v}' for c, v in values)}|max{max_value}|{question}"
    image = bar_chart(values, max_value, source.canvas)
    return source.image_task(level, image, problem, question, str(answer),
                             {"bars": [[c, v] for c, v in values], "max_value": max_value, "asked": asked})


_register("bar_value", _bar_task)
