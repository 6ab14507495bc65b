"""The bar-chart domain: every answer is read back from the pixels (the asked bar's height in grid units), the exact
verifier judges it, the levels hold, and the held-out split never overlaps train."""

from __future__ import annotations

import pytest

from posttrain.data import validate_vision_record
from posttrain.tasks import TaskError, get_domain, sample_tasks
from posttrain.tasks.charts import LEVELS, MARGIN
from posttrain.tasks.shapes import COLOURS
from posttrain.verify import verify


def _image(task):
    [image] = validate_vision_record({"messages": task.messages}, require_assistant=False).images
    return image


def _bar_heights(image) -> dict[str, int]:
    """Per bar colour, the tallest run of its pixels in any column."""
    pixels, (width, height) = image.load(), image.size
    names = {rgb: name for name, rgb in COLOURS.items() if name != "black"}  # black: the baseline
    tallest: dict[str, int] = {}
    for x in range(width):
        column = [names.get(pixels[x, y]) for y in range(height)]
        for name in set(column) - {None}:
            tallest[name] = max(tallest.get(name, 0), column.count(name))
    return tallest


@pytest.mark.parametrize("canvas", [32, 64])
@pytest.mark.parametrize("level", [1, 2, 3])
def test_every_bar_value_is_read_back_from_the_pixels(level, canvas):
    (low, high), max_value = LEVELS[level]
    unit = (canvas - 2 * MARGIN) // max_value
    for task in sample_tasks(get_domain("bar_value", canvas=canvas), 25, level=[level], split="train", seed=level):
        heights = _bar_heights(_image(task))
        bars = dict(task.metadata["bars"])
        assert low <= len(bars) <= high and set(heights) == set(bars)
        assert {name: h / unit for name, h in heights.items()} == bars
        assert task.metadata["answer"] == str(bars[task.metadata["asked"]])
        assert task.metadata["asked"] in task.messages[-1]["content"][1]["text"]


def test_the_exact_verifier_judges_the_value_and_the_split_is_disjoint():
    domain = get_domain("bar_value")
    task = sample_tasks(domain, 1, level=[2], split="train")[0]
    answer = task.metadata["answer"]
    assert verify(task, f"{answer}.").passed and not verify(task, str(int(answer) + 1)).passed
    train = {t.metadata["problem_key"] for t in sample_tasks(domain, 60, level=[1], split="train")}
    test = {t.metadata["problem_key"] for t in sample_tasks(domain, 60, level=[1], split="heldout")}
    assert train and test and not train & test
    with pytest.raises(TaskError, match="level"):
        sample_tasks(domain, 1, level=[4], split="train")
