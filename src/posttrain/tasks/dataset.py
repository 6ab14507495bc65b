"""A dataset of problems with reference answers (GSM8K / MATH style) as a task domain.

    get_domain("dataset", path="gsm8k_test.jsonl", answer_format="gsm8k", domain_name="gsm8k")
    get_domain("dataset", path="math_saved/", question_field="problem", answer_field="solution",
               answer_format="boxed", level_field="level")

`path` is a JSONL file (one object a line), a Parquet file, or a directory written by
``datasets.Dataset.save_to_disk``, read by `posttrain.data.read_records`.
Field names are configurable; `answer_format` says how to read the reference from the answer field:
``plain`` (the field is the answer), ``gsm8k`` (the text after ``####``; the text before it is the worked
solution) or ``boxed`` (the last ``\\boxed{...}`` of a worked solution). A ``level_field`` (an integer or
"Level 3") gives the difficulty levels, otherwise every problem is level 1. A problem's identity (its split key)
is its question text. Judged by ``math``; the demonstration ends with ``\\boxed{answer}`` and carries the worked
solution, when the record has one, as its reasoning trace.

``image_field`` names a field holding an image (a path relative to the file, a ``data:`` URL, a datasets ``Image``
value): each problem's prompt is then the image (as a PNG ``data:`` URL part) and the question, for a
vision-language model (docs/multimodal.md); the problem's identity is the question and the image's pixels.

A bad file is a `TaskError` naming the file, the line (or row) and the field: ``gsm8k.jsonl:17: field
'question' missing (did you mean 'questoin'?)``.
"""

from __future__ import annotations

import difflib
import hashlib
import random
import re
from pathlib import Path
from typing import Any, Iterator

from posttrain.data import SFTSample
from posttrain.tasks.base import (
    TaskError,
    demo_sample,
    domain,
    draw_task,
    file_tasks,
    task_id,
    task_records,
    tasks_by_level,
)
from posttrain.types import Task

ANSWER_FORMATS = ("plain", "gsm8k", "boxed")
# The verifier argument that holds the reference answer, where it is not `reference` (math's)
_REFERENCE_ARGUMENT = {"exact": "answer"}
DEFAULT_INSTRUCTION = "Solve the problem. Put the final answer in \\boxed{}."


class DatasetDomain:
    def __init__(
        self,
        path: str,
        domain_name: str = "dataset",
        question_field: str = "question",
        answer_field: str = "answer",
        answer_format: str = "plain",
        solution_field: str | None = None,
        level_field: str | None = None,
        id_field: str | None = None,
        instruction: str | None = DEFAULT_INSTRUCTION,
        system_prompt: str | None = None,
        verifier: str = "math",
        image_field: str | None = None,
    ):
        if answer_format not in ANSWER_FORMATS:
            raise TaskError(f"dataset: answer_format must be one of {ANSWER_FORMATS}, got {answer_format!r}")
        self.name = domain_name
        self.path = path
        self.fields = {"question": question_field, "answer": answer_field}
        self.answer_format = answer_format
        self.solution_field = solution_field
        self.level_field = level_field
        self.id_field = id_field
        self.instruction = instruction
        self.system_prompt = system_prompt
        self.verifier = verifier
        self.image_field = image_field
        self.by_level = tasks_by_level(self._read(), path)
        self.max_level = max(self.by_level)

    def make_task(self, rng: random.Random, level: int) -> Task:
        return draw_task(self.by_level, rng, level, self.path)

    def tasks(self, split: str | None = None, heldout_fraction: float = 0.1) -> list[Task]:
        """Every problem of the file (of one split, if given), in file order: what an evaluation suite runs."""
        return file_tasks(self.by_level, split, heldout_fraction)

    def demonstration(self, task: Task) -> SFTSample:
        answer = task.verifier_args[_REFERENCE_ARGUMENT.get(self.verifier, "reference")]
        return demo_sample(task, f"The answer is \\boxed{{{answer}}}.", task.metadata.get("solution"),
                           source=self.path)

    # ----------------------------------------------------------------------------------------------

    def _read(self) -> Iterator[Task]:
        for where, row, record in task_records(self.path):
            yield self._task(where, row, record)

    def _task(self, where: str, row: int, record: Any) -> Task:
        if not isinstance(record, dict):
            raise TaskError(f"{where}: expected an object, got {type(record).__name__}")
        question = self._text(where, record, self.fields["question"])
        raw_answer = self._text(where, record, self.fields["answer"])
        reference, solution = self._reference(where, raw_answer)
        if self.solution_field:
            solution = self._text(where, record, self.solution_field)
        level = self._level(where, record)
        content = f"{question}\n{self.instruction}" if self.instruction else question
        messages = [{"role": "user", "content": content}]
        if self.image_field:  # the image first, then the question: one user turn with both parts
            image_url, digest = self._image(where, record)
            messages[0]["content"] = [{"type": "image_url", "image_url": {"url": image_url}},
                                      {"type": "text", "text": content}]
            question = f"{question}\x1f{digest}"  # the problem: the question about this image (the split key)
        if self.system_prompt:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        key = str(record[self.id_field]) if self.id_field and self.id_field in record else question
        return Task(
            id=task_id(self.name, key),
            domain=self.name,
            difficulty=level,
            messages=messages,
            verifier=self.verifier,
            verifier_args={_REFERENCE_ARGUMENT.get(self.verifier, "reference"): reference},
            max_steps=1,
            timeout_s=60.0,
            metadata={"problem_key": question, "row": row, "source": where, "solution": solution},
        )

    def _text(self, where: str, record: dict, field: str) -> str:
        if field not in record:
            close = difflib.get_close_matches(field, list(record), n=1)
            hint = f" (did you mean '{close[0]}'?)" if close else ""
            raise TaskError(f"{where}: field '{field}' missing{hint}; fields present: {', '.join(record)}")
        value = record[field]
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            value = str(value)
        if not isinstance(value, str) or not value.strip():
            raise TaskError(f"{where}: field '{field}' must be a non-empty string, got {value!r:.80}")
        return value.strip()

    def _image(self, where: str, record: dict) -> tuple[str, str]:
        """The record's image as a PNG ``data:`` URL (the task carries its pixels), and the pixels' digest.
        A path is relative to the data file; a bad image is a `TaskError` naming the file, the line and the field."""
        from posttrain.data import load_image
        from posttrain.tasks.shapes import data_url

        if record.get(self.image_field) is None:
            raise TaskError(f"{where}: field '{self.image_field}' missing; fields present: {', '.join(record)}")
        try:
            image = load_image(record[self.image_field], base_dir=Path(self.path).parent)
        except ValueError as error:
            raise TaskError(f"{where}: field '{self.image_field}': {error}") from None
        return data_url(image), hashlib.sha256(image.tobytes()).hexdigest()[:16]

    def _reference(self, where: str, raw: str) -> tuple[str, str | None]:
        """The reference answer and, where the field holds a worked solution, that solution."""
        field = self.fields["answer"]
        if self.answer_format == "plain":
            return raw, None
        if self.answer_format == "gsm8k":
            if "####" not in raw:
                raise TaskError(f"{where}: field '{field}' has no '#### <answer>' line (answer_format gsm8k)")
            solution, answer = raw.rsplit("####", 1)
            solution = re.sub(r"<<[^>]*>>", "", solution).strip()  # GSM8K's calculator annotations
            return answer.strip().replace(",", ""), solution or None
        boxed = last_boxed(raw)
        if boxed is None:
            raise TaskError(f"{where}: field '{field}' has no \\boxed{{...}} answer (answer_format boxed)")
        return boxed, raw

    def _level(self, where: str, record: dict) -> int:
        if not self.level_field:
            return 1
        if self.level_field not in record:
            raise TaskError(f"{where}: field '{self.level_field}' missing; fields present: {', '.join(record)}")
        match = re.search(r"\d+", str(record[self.level_field]))
        if not match or int(match.group()) < 1:
            raise TaskError(f"{where}: field '{self.level_field}' must hold a level >= 1, "
                            f"got {record[self.level_field]!r}")
        return int(match.group())


@domain("dataset")
def dataset_domain(**kwargs: Any) -> Any:
    """The ``dataset`` domain; with ``kind`` (math, code, structured, format) a file of tasks of that kind (the
    ``tasks`` domain, `posttrain.tasks.task_file`), so an eval dataset suite reads code problems too."""
    if "kind" in kwargs:
        from posttrain.tasks.task_file import TaskFileDomain

        return TaskFileDomain(**kwargs)
    return DatasetDomain(**kwargs)


def last_boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{...}`` (or ``\\fbox{...}``), braces balanced; None if there is none."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    position = text.index("{", start) + 1
    depth, begin = 1, position
    while position < len(text):
        depth += {"{": 1, "}": -1}.get(text[position], 0)
        if depth == 0:
            return text[begin:position].strip()
        position += 1
    return None


