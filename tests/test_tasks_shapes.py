"""The image domains: the answers are read back from the pixels, the exact verifier judges them, the held-out split
never overlaps train, and the prompts are chats with images that the data room reads."""

from __future__ import annotations

from collections import Counter

import pytest

from posttrain.data import validate_vision_record
from posttrain.tasks import TaskError, get_domain, sample_tasks
from posttrain.tasks.shapes import COLOURS
from posttrain.verify import verify

WHITE = (255, 255, 255)


def _image(task):
    sample = validate_vision_record({"messages": task.messages}, require_assistant=False)
    [image] = sample.images
    return image


def _blobs(image) -> list[tuple[tuple[int, int, int], int]]:
    """(colour, pixel count) of every 8-connected blob of non-white pixels."""
    width, height = image.size
    pixels = image.load()
    seen: set[tuple[int, int]] = set()
    blobs = []
    for start in ((x, y) for y in range(height) for x in range(width)):
        if start in seen or pixels[start] == WHITE:
            continue
        colour, stack, size = pixels[start], [start], 0
        seen.add(start)
        while stack:
            x, y = stack.pop()
            size += 1
            for nx in (x - 1, x, x + 1):
                for ny in (y - 1, y, y + 1):
                    if 0 <= nx < width and 0 <= ny < height and (nx, ny) not in seen and pixels[nx, ny] != WHITE:
                        seen.add((nx, ny))
                        stack.append((nx, ny))
        blobs.append((colour, size))
    return blobs


@pytest.mark.parametrize("level", [1, 2, 3])
def test_shape_count_answers_match_the_blobs_in_the_picture(level):
    domain = get_domain("shape_count")
    for task in sample_tasks(domain, 12, level=level, seed=level):
        blobs = _blobs(_image(task))
        shapes = task.metadata["shapes"]
        assert len(blobs) == len(shapes)  # no two shapes touch: each is its own blob
        assert all(colour in COLOURS.values() for colour, _ in blobs)
        question = task.messages[-1]["content"][-1]["text"]
        if level < 3:
            assert task.metadata["answer"] == str(len(blobs)) and question == "How many shapes are in the image?"
        else:
            kind = question.split()[2][:-1]
            assert task.metadata["answer"] == str(sum(s["kind"] == kind for s in shapes))
        if level == 1:
            assert len({c for c, _ in blobs}) == 1 and len({s["kind"] for s in shapes}) == 1


@pytest.mark.parametrize("level", [1, 2, 3])
def test_largest_colour_is_the_colour_with_the_most_pixels(level):
    domain = get_domain("largest_colour")
    names = {rgb: name for name, rgb in COLOURS.items()}
    for task in sample_tasks(domain, 12, level=level, seed=level):
        blobs = _blobs(_image(task))
        assert len({c for c, _ in blobs}) == len(blobs) == len(task.metadata["shapes"])  # one colour per shape
        areas = sorted(blobs, key=lambda blob: -blob[1])
        assert names[areas[0][0]] == task.metadata["answer"]
        assert areas[0][1] >= 1.1 * areas[1][1]  # clearly the largest in pixels too, not only in geometry


def test_the_exact_verifier_judges_and_demonstrations_pass():
    for name, wrong in (("shape_count", "99"), ("largest_colour", "white"), ("read_digits", "x")):
        domain = get_domain(name)
        for task in sample_tasks(domain, 10, level=[1, 2, 3], seed=5):
            demo = domain.demonstration(task)
            assert demo.messages[:-1] == task.messages
            assert verify(task, demo.messages[-1]["content"], {}).score == 1.0
            assert verify(task, f" {task.metadata['answer'].upper()}.", {}).score == 1.0  # case and a period
            assert verify(task, wrong, {}).score == 0.0
            sample = validate_vision_record(demo.to_dict())  # a demonstration is a valid chat with an image
            assert sample.images[0].size == (64, 64)


def test_held_out_never_overlaps_train_and_draws_are_deterministic():
    for name in ("shape_count", "largest_colour", "read_digits"):
        domain = get_domain(name)
        train = sample_tasks(domain, 300, level=[1, 2, 3], split="train", seed=0)
        heldout = sample_tasks(domain, 40, level=[1, 2, 3], split="heldout", seed=0)
        train_keys = {t.metadata["problem_key"] for t in train}
        assert len(train_keys) == 300 and not train_keys & {t.metadata["problem_key"] for t in heldout}
        again = sample_tasks(domain, 5, level=2, seed=7)
        assert [t.messages for t in again] == [t.messages for t in sample_tasks(domain, 5, level=2, seed=7)]
        assert Counter(t.difficulty for t in train) == {1: 100, 2: 100, 3: 100}


def test_bad_settings_are_task_errors():
    with pytest.raises(TaskError, match="level 4 outside 1..3"):
        sample_tasks(get_domain("shape_count"), 1, level=4)
    with pytest.raises(TaskError, match="canvas must be 32..512"):
        get_domain("largest_colour", canvas=8)
    big = get_domain("shape_count", canvas=128)
    assert _image(sample_tasks(big, 1, level=2)[0]).size == (128, 128)


def test_an_image_task_is_refused_by_the_text_chat_path(tiny_tokenizer):
    from posttrain.chat import ChatTemplateError, render_chat
    from posttrain.data import DataError, prompt_ids

    task = sample_tasks(get_domain("shape_count"), 1, level=1)[0]
    with pytest.raises(ChatTemplateError, match="message 0 holds an image part"):
        render_chat(tiny_tokenizer, task.messages, generation_prompt=True)
    with pytest.raises(DataError, match="image part"):  # what the text engine and trainers call
        prompt_ids(tiny_tokenizer, [task.messages])
    text_only = [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    render_chat(tiny_tokenizer, text_only, generation_prompt=True)  # text parts still go to the template


@pytest.mark.parametrize("level, digits", [(1, (1, 2)), (2, (3, 4)), (3, (5, 6))])
def test_read_digits_writes_the_whole_number_inside_the_canvas(level, digits):
    from PIL import ImageOps

    from posttrain.tasks.shapes import written

    domain = get_domain("read_digits")
    tasks = sample_tasks(domain, 10, level=level, seed=level)
    images = {}
    for task in tasks:
        number = task.metadata["answer"]
        assert number.isdigit() and digits[0] <= len(number) <= digits[1]
        image = _image(task)
        left, top, right, bottom = ImageOps.invert(image.convert("L")).getbbox()  # the ink
        assert left >= 1 and top >= 1 and right <= 63 and bottom <= 63  # no digit cut off at an edge
        again, _ = written(number, task.metadata["font_size"], tuple(task.metadata["at"]), 64)
        assert list(again.getdata()) == list(image.getdata())  # the picture is exactly that number, drawn there
        images.setdefault(number, image)
        assert verify(task, number, {}).score == 1.0 and verify(task, number + "1", {}).score == 0.0
    shown = list(images.values())
    assert all(list(a.getdata()) != list(b.getdata()) for i, a in enumerate(shown) for b in shown[i + 1:])
