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

import json
import threading
from collections import OrderedDict, defaultdict
from dataclasses import dataclass, field
from typing import Any, Sequence

from posttrain.chat import IMAGE_PART_TYPES, first_image_message, render_chat
from posttrain.data import VisionSample, validate_vision_record
from posttrain.envs import EnvError
from posttrain.evaluate.metrics import ItemEpisodes
from posttrain.evaluate.suites import by_suite
from posttrain.models import vision_request
from posttrain.tasks import png_data_url
from posttrain.types import Completion, Reward, SamplingParams, Task, Trajectory
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
    cases = [image_case(answer.task, answer.completion.text, answer.reward.passed, thumbnail_px)
             for (answer,) in answers]
    return suite_score(name, cases)


def image_case(task: Task, answer: str, passed: bool, thumbnail_px: int = THUMBNAIL_PX) -> ImageCase:
    """An answered image task as a report shows it: the thumbnail of its (first) image, the question, the expected
    answer (the task's ``answer``, else its verifier's reference answer) and the model's answer."""
    sample = image_sample(task)
    args = task.verifier_args
    expected = task.metadata.get("answer", args.get("answer", args.get("reference", "")))
    return ImageCase(task.id, task.domain, task.difficulty, _question(sample), str(expected), answer.strip(), passed,
                     thumbnail(sample.images[0], thumbnail_px))


def suite_score(name: str, cases: Sequence[ImageCase]) -> ImageSuiteScore:
    """Pass@1 over `cases`, overall and per domain."""
    by_domain: dict[str, list[bool]] = defaultdict(list)
    for case in cases:
        by_domain[case.domain].append(case.passed)
    passed = [case.passed for case in cases]
    return ImageSuiteScore(name, sum(passed) / max(1, len(passed)),
                           {domain: sum(v) / len(v) for domain, v in sorted(by_domain.items())}, list(cases))


def image_suite_scores(suites: Sequence[Any], items: Sequence[ItemEpisodes]) -> dict[str, ImageSuiteScore]:
    """The eval recipe's image suites (those whose tasks hold an image) scored from their episodes (`items`, in
    suite order as `run_items` returns them): each item's first episode (the greedy one when run) as a case.
    An item whose episode failed on infrastructure counts as not passed, with its error as the answer."""
    scores = {}
    for suite, mine in by_suite(suites, items):
        cases = []
        for item in mine:
            if first_image_message(item.task.messages) is None or not item.primary:
                continue
            episode = item.primary[0]
            cases.append(image_case(item.task, _answer(episode), episode.reward.passed))
        if cases:
            scores[suite.name] = suite_score(suite.name, cases)
    return scores


def _answer(trajectory: Trajectory) -> str:
    replies = [m.get("content") for m in trajectory.messages if m.get("role") == "assistant"]
    if replies and isinstance(replies[-1], str):
        return replies[-1]
    return f"({trajectory.reward.failure})" if trajectory.reward.is_infrastructure_failure else ""


# ---- image prompts in the episode loop (eval suites, RL) ---------------------------------------------------------

_PROMPT_CACHE_SIZE = 512  # rendered image prompts kept (a group's episodes share one)


class ProcessorRenderer:
    """The episode loop's `envs.PromptRenderer` for a vision-language model: a task's prompt (image parts as
    ``image_url``/``image`` parts, e.g. a ``data:`` URL) read with `data.validate_vision_record` and turned into ids
    and image tensors by the model's processor (`models.vision_request`, as the self-test and `run_vision_grpo`
    do); transcripts rendered by the processor's template (`chat.render_chat` with ``images=True``). Rendered
    prompts are cached (a GRPO group shares one: its members share the tensors, read only)."""

    def __init__(self, processor: Any):
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self._cache: OrderedDict[str, tuple[list[int], dict[str, Any] | None]] = OrderedDict()
        self._lock = threading.Lock()

    def prompt(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
               template_kwargs: dict[str, Any] | None = None) -> tuple[list[int], dict[str, Any] | None]:
        if tools or template_kwargs:
            raise EnvError("an image prompt takes no tools or chat-template arguments yet (the processor renders it)")
        key = json.dumps(messages, sort_keys=True, default=str)
        with self._lock:
            if key in self._cache:
                self._cache.move_to_end(key)
                ids, images = self._cache[key]
                return list(ids), images
        sample = validate_vision_record({"messages": messages}, require_assistant=False)
        request = vision_request(self.processor, sample.messages, sample.images)
        with self._lock:
            self._cache[key] = (request.prompt_token_ids, request.image_inputs)
            if len(self._cache) > _PROMPT_CACHE_SIZE:
                self._cache.popitem(last=False)
        return list(request.prompt_token_ids), request.image_inputs

    def render(self, messages: list[dict[str, Any]], *, generation_prompt: bool,
               tools: list[dict[str, Any]] | None = None, template_kwargs: dict[str, Any] | None = None) -> str:
        return render_chat(self.processor, [_placeholders(m) for m in messages], generation_prompt=generation_prompt,
                           tools=tools, template_kwargs=template_kwargs, images=True)

    def attach(self, trajectories: Sequence[Trajectory]) -> int:
        """Render again the image tensors of trajectories that hold image parts but lost their tensors (a batch
        restored from a checkpoint keeps the images' reference, not the pixels); returns how many."""
        restored = 0
        for trajectory in trajectories:
            if trajectory.image_inputs is None and first_image_message(trajectory.messages) is not None:
                prompt = _prompt_turns(trajectory.messages)
                trajectory.image_inputs = self.prompt(prompt)[1]
                restored += 1
        return restored


def _placeholders(message: dict[str, Any]) -> dict[str, Any]:
    """`message` as `data.validate_vision_record` writes it for the processor (text parts; each image part a bare
    ``{"type": "image"}``), without decoding its images."""
    content = message.get("content")
    if isinstance(content, str) or content is None:
        parts = [{"type": "text", "text": content or ""}]
    else:
        parts = [{"type": "image"} if isinstance(part, dict) and part.get("type") in IMAGE_PART_TYPES
                 else {"type": "text", "text": part if isinstance(part, str) else part.get("text", "")}
                 for part in content]
    return {**message, "content": parts}


def _prompt_turns(messages: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    for index, message in enumerate(messages):
        if message.get("role") == "assistant":
            return list(messages[:index])
    return list(messages)
