"""The shapes every room passes to every other: tasks, rewards, generations and trajectories.

This module is the bottom of the import graph (it imports nothing of ours), so that `verify`, `envs`,
`rollout`, `rl` and `evaluate` can speak the same language without importing each other upwards.
Everything here is a plain dataclass or a `typing.Protocol`; everything a checkpoint or a log holds
round-trips through `to_dict` / `from_dict` as JSON.

Messages are Hugging Face chat messages: ``{"role": "system|user|assistant|tool", "content": str}``, an
assistant message may carry ``"tool_calls": [{"type": "function", "function": {"name": str,
"arguments": dict}}]`` and a tool message a ``"name"``.
"""

from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any, Protocol, Sequence, runtime_checkable

Message = dict[str, Any]


class PosttrainError(Exception):
    """Base of every error that is the user's to fix (bad recipe, bad data, missing file).

    The CLI prints these as one line and exits non-zero; anything else is a bug and shows a traceback.
    Each room subclasses it once (``ConfigError``, ``DataError``, ``SandboxError`` ...).
    """


class FailureClass(str, enum.Enum):
    """Why an attempt did not succeed. The same classes label RL trajectories and eval bad cases.

    ``INFRA`` and ``SANDBOX`` are the system's failures, not the model's: they are retried or masked,
    never scored as a reward of 0.
    """

    NONE = "none"  # solved
    FORMAT = "format"  # no parsable answer / malformed output
    WRONG_ANSWER = "wrong_answer"
    TOOL_ERROR = "tool_error"  # the episode ended with failed tool calls and no solution
    TIMEOUT = "timeout"  # the model's code or the episode ran out of time
    TRUNCATED = "truncated"  # hit max new tokens / context before finishing
    SANDBOX = "sandbox_failure"  # the jail could not run the program (infrastructure)
    INFRA = "infra"  # engine error, worker died, anything not the model's fault

    @property
    def is_infrastructure(self) -> bool:
        return self in (FailureClass.SANDBOX, FailureClass.INFRA)


@dataclass
class Reward:
    """A verifier's judgement. ``score`` is in [0, 1] unless a verifier documents another range.

    ``components`` holds the named parts of a combined reward (e.g. ``{"correct": 1.0, "format": 0.5}``)
    so they can be reported separately; ``details`` is free-form evidence for a human.
    """

    score: float
    passed: bool
    failure: FailureClass = FailureClass.NONE
    components: dict[str, float] = field(default_factory=dict)
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def is_infrastructure_failure(self) -> bool:
        return self.failure.is_infrastructure

    def to_dict(self) -> dict[str, Any]:
        return {
            "score": self.score,
            "passed": self.passed,
            "failure": self.failure.value,
            "components": dict(self.components),
            "details": self.details,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Reward:
        return cls(
            score=float(data["score"]),
            passed=bool(data["passed"]),
            failure=FailureClass(data.get("failure", "none")),
            components=dict(data.get("components", {})),
            details=dict(data.get("details", {})),
        )


@dataclass
class Task:
    """One thing to do, and how it will be judged.

    ``verifier`` names a registered verifier (``posttrain.verify``) and ``verifier_args`` are its keyword
    arguments (the reference answer, tests, schema ...). ``env`` names a registered environment
    (``"single_turn"``, ``"tools"``, ...). The same task drives RL and evaluation, so they cannot drift apart.
    """

    id: str
    domain: str
    messages: list[Message]
    verifier: str
    verifier_args: dict[str, Any] = field(default_factory=dict)
    difficulty: int = 1
    env: str = "single_turn"
    env_args: dict[str, Any] = field(default_factory=dict)
    tools: list[str] = field(default_factory=list)
    max_steps: int = 1
    timeout_s: float = 60.0
    metadata: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt(self) -> str:
        """The last user message: a short handle for logs and dedup."""
        for message in reversed(self.messages):
            if message.get("role") == "user":
                return str(message.get("content", ""))
        return ""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Task:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})


# --------------------------------------------------------------------------------------------------
# Generation: the InferenceEngine contract
# --------------------------------------------------------------------------------------------------


@dataclass
class SamplingParams:
    """How to sample. ``temperature == 0`` means greedy; ``n`` completions per request."""

    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    n: int = 1
    stop: list[str] = field(default_factory=list)  # stop strings, checked on decoded text
    stop_token_ids: list[int] = field(default_factory=list)  # besides the tokenizer's eos
    seed: int | None = None
    include_stop_in_output: bool = True

    def batch_key(self, *, ignore_seed: bool = False) -> tuple:
        """Requests with equal keys can share one engine call (``ignore_seed``: the engine seeds per request)."""
        return tuple((name, tuple(value) if isinstance(value, list) else value) for name, value in vars(self).items()
                     if not (ignore_seed and name == "seed"))


@dataclass
class GenerationRequest:
    """A prompt as token ids: the engine never re-tokenizes text the policy or env produced."""

    prompt_token_ids: list[int]
    request_id: str = ""
    # An image prompt (`posttrain.models.vision_request`): the processor's image tensors for this prompt alone
    # (``pixel_values`` and whatever else the model's forward takes beside the ids: ``image_sizes``,
    # ``image_grid_thw`` ...). `prompt_token_ids` already hold the image tokens the processor expanded them to.
    image_inputs: dict[str, Any] | None = None


@dataclass
class Completion:
    """One sampled continuation.

    ``logprobs[i]`` is the log-probability of ``token_ids[i]`` given everything before it under the
    temperature-scaled distribution ``log_softmax(logits / temperature)`` (temperature 1 when greedy), before
    any top-p/top-k truncation. A teacher-forced forward pass of the same weights, with the logits divided by
    the same temperature, computes the same numbers: that is how the trainer checks the engine.
    """

    token_ids: list[int]
    text: str
    logprobs: list[float]
    finish_reason: str  # "stop" (eos / stop string / stop token) or "length"
    policy_version: int
    request_id: str = ""


@runtime_checkable
class InferenceEngine(Protocol):
    """Samples from a policy and takes new weights in place.

    ``generate`` returns, per request, a list of ``sampling.n`` completions. ``update_weights`` swaps in
    a state dict (parameter name -> tensor) without touching disk and tags later completions with
    ``version``.
    """

    @property
    def policy_version(self) -> int: ...

    def generate(
        self, requests: Sequence[GenerationRequest], sampling: SamplingParams
    ) -> list[list[Completion]]: ...

    def update_weights(self, state: dict[str, Any], version: int) -> None: ...


# --------------------------------------------------------------------------------------------------
# Trajectories: what the trainer scores
# --------------------------------------------------------------------------------------------------


@dataclass
class Trajectory:
    """Everything one episode produced, token-exact.

    ``token_ids`` is the whole sequence the trainer will score: the prompt, then alternating policy
    segments (sampled by the engine, ``loss_mask`` 1) and observation segments (tokenized env output,
    ``loss_mask`` 0). ``behaviour_logprobs`` and ``policy_versions`` are aligned with ``token_ids`` and
    meaningful only where ``loss_mask`` is 1. Nothing here was ever re-tokenized from text.
    """

    task_id: str
    domain: str
    token_ids: list[int]
    loss_mask: list[int]
    behaviour_logprobs: list[float]
    policy_versions: list[int]
    prompt_length: int
    reward: Reward
    messages: list[Message] = field(default_factory=list)  # human-readable transcript
    difficulty: int = 1
    steps: int = 0
    tool_calls: int = 0
    tool_calls_ok: int = 0
    failed_steps: int = 0
    truncated: bool = False
    wall_s: float = 0.0
    group_id: str = ""  # trajectories sampled for the same task in one group share it
    metadata: dict[str, Any] = field(default_factory=dict)
    # An image prompt's tensors (``pixel_values`` ...: `GenerationRequest.image_inputs`, shared by a group), which
    # the trainer's forward takes beside `token_ids`. In this process only: `to_dict` (checkpointed batches) keeps
    # the reference to the images -- the image parts of `messages`, the task's own -- not the pixels, and the
    # trainer renders them again where they are missing (`posttrain.rl.vision.ProcessorRenderer.attach`).
    image_inputs: dict[str, Any] | None = None

    @property
    def policy_tokens(self) -> int:
        return int(sum(self.loss_mask))

    @property
    def observation_tokens(self) -> int:
        return len(self.token_ids) - self.prompt_length - self.policy_tokens

    @property
    def min_policy_version(self) -> int:
        """Of this token sequence only; an episode's staleness over all its segments (a black-box agent's earlier
        ones): `posttrain.envs.oldest_policy_version`."""
        versions = [v for v, m in zip(self.policy_versions, self.loss_mask) if m]
        return min(versions) if versions else -1

    @property
    def failure(self) -> FailureClass:
        return self.reward.failure

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(dataclasses.replace(self, image_inputs=None))
        data["reward"] = self.reward.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Trajectory:
        data = dict(data)
        data["reward"] = Reward.from_dict(data["reward"])
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in data.items() if k in names})
