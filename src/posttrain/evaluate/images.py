"""Image tasks on an engine: sample answers to image prompts, judge them with each task's own verifier, score suites.

A task of an image domain (`posttrain.tasks.shapes`: its user message holds the image as a ``data:`` URL part) is
read into a chat with ``{"type": "image"}`` parts and its images (`posttrain.data.validate_vision_record`), turned
into an engine request by the model's processor (`posttrain.models.vision_request`: image tokens expanded, pixel
tensors beside the ids) and sampled by the built-in engine (`posttrain.rollout.HFEngine`, generic runner). The
completion's token ids and behaviour log-probs are kept exactly as sampled, so the RL update scores the same tokens
(`posttrain.rl.vision`), and the reward is `posttrain.verify.verify` on the decoded text: the same judge for the RL
reward and the eval score.

`score_image_suite` gives per-domain pass@1 (greedy unless told) and the cases a report shows: every case keeps a
thumbnail of its image (a PNG ``data:`` URL, `thumbnail_px` on its longer side) beside the question, the expected
answer and the model's answer (`posttrain.evaluate.image_report.image_section`).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Sequence

from posttrain.data import VisionSample, validate_vision_record
from posttrain.models import vision_request
from posttrain.tasks import png_data_url
from posttrain.types import Completion, Reward, SamplingParams, Task
from posttrain.verify import verify

THUMBNAIL_PX = 96


@dataclass
class ImageAnswer:
    """One sampled answer to an image task: the request it came from, the completion as sampled, its reward."""

    task: Task
    prompt_ids: list[int]
    image_inputs: dict[str, Any] | None
    completion: Completion
    reward: Reward


@dataclass
class ImageCase:
    """An evaluated image task, for a report: the image's thumbnail and what was asked, expected and answered."""

    task_id: str
    domain: str
    difficulty: int
    question: str
    expected: str
    answer: str
    passed: bool
    thumbnail: str  # data:image/png;base64,...


@dataclass
class ImageSuiteScore:
    """Pass@1 over a suite of image tasks, per domain and overall, with every case."""

    name: str
    pass_at_1: float
    per_domain: dict[str, float]
    cases: list[ImageCase] = field(default_factory=list)

    @property
    def failures(self) -> list[ImageCase]:
        return [case for case in self.cases if not case.passed]


def image_sample(task: Task) -> VisionSample:
    """The task's prompt as a chat with ``{"type": "image"}`` parts and its decoded images."""
    return validate_vision_record({"messages": task.messages}, require_assistant=False)


def sample_image_tasks(engine: Any, processor: Any, tasks: Sequence[Task], sampling: SamplingParams
                       ) -> list[list[ImageAnswer]]:
    """Per task, `sampling.n` answers from `engine` to its image prompt, each judged by the task's verifier."""
    requests = []
    for task in tasks:
        sample = image_sample(task)
        requests.append(vision_request(processor, sample.messages, sample.images, request_id=task.id))
    groups = engine.generate(requests, sampling)
    return [[ImageAnswer(task, request.prompt_token_ids, request.image_inputs, completion,
                         verify(task, completion.text)) for completion in group]
            for task, request, group in zip(tasks, requests, groups)]


def thumbnail(image: Any, size: int = THUMBNAIL_PX) -> str:
    """A PNG ``data:`` URL of `image` scaled to `size` pixels on its longer side (nearest neighbour: the pixels
    the model saw stay visible, not blurred)."""
    from PIL import Image

    scale = size / max(image.size)
    small = image.resize((max(1, round(image.width * scale)), max(1, round(image.height * scale))),
                         Image.Resampling.NEAREST)
    return png_data_url(small)


def _question(sample: VisionSample) -> str:
    last = sample.messages[-1]["content"]
    if isinstance(last, str):
        return last
    return " ".join(part.get("text", "") for part in last if part.get("type") == "text")


def score_image_suite(engine: Any, processor: Any, tasks: Sequence[Task], *, name: str = "images",
                      max_new_tokens: int = 8, temperature: float = 0.0, seed: int = 0,
                      thumbnail_px: int = THUMBNAIL_PX) -> ImageSuiteScore:
    """Pass@1 of one answer per task (greedy by default), per domain and overall, with every case."""
    sampling = SamplingParams(n=1, max_new_tokens=max_new_tokens, temperature=temperature, seed=seed)
    answers = sample_image_tasks(engine, processor, tasks, sampling)
    by_domain: dict[str, list[bool]] = defaultdict(list)
    cases = []
    for (answer,) in answers:
        task, sample = answer.task, image_sample(answer.task)
        by_domain[task.domain].append(answer.reward.passed)
        cases.append(ImageCase(task.id, task.domain, task.difficulty, _question(sample),
                               str(task.metadata.get("answer", "")), answer.completion.text.strip(),
                               answer.reward.passed, thumbnail(sample.images[0], thumbnail_px)))
    passed = [case.passed for case in cases]
    return ImageSuiteScore(name, sum(passed) / max(1, len(passed)),
                           {domain: sum(v) / len(v) for domain, v in sorted(by_domain.items())}, cases)
