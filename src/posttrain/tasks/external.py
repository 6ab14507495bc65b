"""Domains over other ecosystems' environments. ``gym`` and ``openenv``: every task is one seeded episode of a
Gymnasium env or of an OpenEnv server, judged by the environment's own reward (the ``environment`` verifier).
``verifiers``: the tasks of a prime-rl verifiers taskset, judged by its rewards (the ``verifiers`` verifier).

    domains:
      - {name: gym, args: {env_id: MyTextEnv-v0, max_steps: 4, instructions: "Answer with one word."}}
      - {name: openenv, args: {base_url: "http://127.0.0.1:8000", max_steps: 6}}

A task's problem is its seed, so the held-out split holds seeds training never draws. ``levels`` maps a difficulty
level to extra environment arguments (gym: ``env_kwargs``, openenv: ``reset_kwargs``), e.g.
``levels: {1: {length: 2}, 2: {length: 4}}``; without it the domain has one level. ``instructions`` is the
system message before the env's first observation (a generic one by default). Episode limits: ``max_steps`` turns, ``timeout_s`` of
wall time, ``step_timeout_s`` per call into the environment (longer is an infrastructure failure). Register your
Gymnasium env in a module named under the recipe's ``imports:``. See docs/envs.md.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from posttrain.data import SFTSample
from posttrain.envs import vf_task_messages
from posttrain.tasks.base import TaskError, domain, task_id
from posttrain.types import Task
from posttrain.usercode import is_file_ref

_SEEDS = 10**9
# A task needs a message of its own (prompts are rendered before an episode starts, for batching and statistics).
DEFAULT_INSTRUCTIONS = "Each user message is an observation from the environment; reply with your action."


class _SeededEpisodes:
    """One task per seed: the env args, the level's extra args under `level_key`, the seed."""

    name = ""
    level_key = ""

    def __init__(self, env_args: dict[str, Any], identity: str, levels: dict[Any, dict[str, Any]] | None,
                 instructions: str | None, max_steps: int, timeout_s: float):
        if max_steps < 1:
            raise TaskError(f"{self.name}: max_steps must be at least 1")
        self.env_args = env_args
        self.identity = identity
        self.levels = {int(level): dict(extra) for level, extra in (levels or {1: {}}).items()}
        if sorted(self.levels) != list(range(1, len(self.levels) + 1)):
            raise TaskError(f"{self.name}: levels must be numbered 1..N, got {sorted(self.levels)}")
        self.max_level = len(self.levels)
        self.instructions = instructions
        self.max_steps = max_steps
        self.timeout_s = timeout_s

    def make_task(self, rng: random.Random, level: int) -> Task:
        seed = rng.randrange(_SEEDS)
        key = f"{self.name}:{self.identity}:{level}:{seed}"
        env_args = {**self.env_args, "seed": seed}
        extra = self.levels[level]
        if extra:
            env_args[self.level_key] = {**env_args.get(self.level_key, {}), **extra}
        messages = [{"role": "system", "content": self.instructions or DEFAULT_INSTRUCTIONS}]
        return Task(id=task_id(self.name, key), domain=self.name, messages=messages, verifier="environment",
                    difficulty=level, env=self.name, env_args=env_args, max_steps=self.max_steps,
                    timeout_s=self.timeout_s, metadata={"problem_key": key, "seed": seed})

    def demonstration(self, task: Task) -> SFTSample:
        raise TaskError(f"{self.name}: an external environment has no demonstrations (train it with RL)")


@domain("gym")
class GymDomain(_SeededEpisodes):
    name = "gym"
    level_key = "env_kwargs"

    def __init__(self, env_id: str, env_kwargs: dict[str, Any] | None = None, levels: dict[Any, dict] | None = None,
                 instructions: str | None = None, max_steps: int = 8, timeout_s: float = 60.0,
                 step_timeout_s: float = 30.0, outcome: str = "return", pass_threshold: float = 1.0):
        env_args = {"env_id": env_id, "env_kwargs": dict(env_kwargs or {}), "outcome": outcome,
                    "pass_threshold": pass_threshold, "step_timeout_s": step_timeout_s}
        super().__init__(env_args, env_id, levels, instructions, max_steps, timeout_s)


@domain("openenv")
class OpenEnvDomain(_SeededEpisodes):
    name = "openenv"
    level_key = "reset_kwargs"

    def __init__(self, base_url: str, reset_kwargs: dict[str, Any] | None = None, action_field: str = "message",
                 observation_field: str | None = None, levels: dict[Any, dict] | None = None,
                 instructions: str | None = None, max_steps: int = 8, timeout_s: float = 60.0,
                 step_timeout_s: float = 30.0, outcome: str = "return", pass_threshold: float = 1.0):
        env_args = {"base_url": base_url, "reset_kwargs": dict(reset_kwargs or {}), "action_field": action_field,
                    "observation_field": observation_field, "outcome": outcome, "pass_threshold": pass_threshold,
                    "step_timeout_s": step_timeout_s}
        super().__init__(env_args, base_url, levels, instructions, max_steps, timeout_s)


@domain("verifiers")
class VerifiersDomain:
    """The tasks of a prime-rl `verifiers` taskset (an installed taskset id, or a module exporting one `Taskset`),
    built with `config`; each draw is one of its tasks, judged by its own rewards (`posttrain.envs.verifiers_env`).
    One level; ``max_steps`` > 1 gives a task with toolsets room for tool calls; ``turn_scores: true`` has the
    rubric score each turn's prefix too, the process component (`posttrain.verify.verifiers_rubric`);
    ``score_timeout_s`` bounds each scoring (the whole trace's, each turn prefix's) on its own."""

    name = "verifiers"
    max_level = 1

    def __init__(self, taskset: str, config: dict[str, Any] | None = None, max_steps: int = 1,
                 timeout_s: float = 60.0, tool_timeout_s: float = 30.0, pass_threshold: float | None = None,
                 max_tasks: int = 100_000, turn_scores: bool = False, score_timeout_s: float = 60.0):
        from posttrain.verify import VerifyError, verifiers_tasks

        if max_steps < 1:
            raise TaskError("verifiers: max_steps must be at least 1")
        try:
            self.tasks = verifiers_tasks(taskset, config, max_tasks)
        except VerifyError as error:
            raise TaskError(str(error)) from None
        self.taskset, self.config, self.max_tasks = taskset, dict(config or {}), max_tasks
        self.source = Path(taskset).stem if is_file_ref(taskset) else taskset
        self.max_steps, self.timeout_s, self.tool_timeout_s = max_steps, timeout_s, tool_timeout_s
        self.pass_threshold, self.turn_scores = pass_threshold, bool(turn_scores)
        self.score_timeout_s = float(score_timeout_s)

    def make_task(self, rng: random.Random, level: int) -> Task:
        index = rng.randrange(len(self.tasks))
        vf_task = self.tasks[index]
        key = f"verifiers:{self.source}:{vf_task.key}"  # a file's stem, not its path: the split is the same anywhere
        where = {"taskset": self.taskset, "index": index, "config": self.config, "max_tasks": self.max_tasks}
        return Task(id=task_id(self.name, key), domain=self.name, messages=vf_task_messages(vf_task),
                    verifier="verifiers", verifier_args={**where, "pass_threshold": self.pass_threshold,
                                                          "turn_scores": self.turn_scores,
                                                          "timeout_s": self.score_timeout_s},
                    env="verifiers", env_args={**where, "tool_timeout_s": self.tool_timeout_s},
                    max_steps=self.max_steps, timeout_s=self.timeout_s,
                    metadata={"problem_key": key, "verifiers_index": index})

    def demonstration(self, task: Task) -> SFTSample:
        raise TaskError("verifiers: a verifiers taskset has no demonstrations here (train it with RL)")
