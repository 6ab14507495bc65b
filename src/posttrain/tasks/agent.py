"""The ``agent`` domain: another domain's tasks, each done by a black-box agent program (`posttrain.envs.agent`).

    domains:                                                     # an RL recipe
      - name: agent
        args:
          command: ["{python}", "${recipe_dir}/data/blackbox_agent.py"]   # any program; {python} = the trainer's
          tasks: {name: calculator}                              # whose tasks (and verifier) the agent gets
          max_calls: 4                                           # chat completions per episode
          max_completion_tokens: 256                             # sampled tokens per episode
          timeout_s: 60                                          # wall time per episode
          jails: 32                                              # agents run at once (default: a slot per CPU)

The inner domain's task keeps its messages, verifier and level; its environment becomes ``agent`` with the
program and the limits, and the files it seeded (``env_args["files"]``, e.g. ``repo_fix``'s repository) become
the agent's work dir. So the same verifier judges the agent's final state (its answer, its files) that judges the
built-in environments. Demonstrations (for SFT) are the inner domain's.
"""

from __future__ import annotations

import os
import random
from typing import Any

from posttrain.data import SFTSample
from posttrain.tasks.base import TaskError, domain, get_domain
from posttrain.types import Task

PYTHON_PLACEHOLDER = "{python}"


@domain("agent")
class AgentDomain:
    def __init__(self, command: list[str], tasks: dict[str, Any], *, max_calls: int = 16,
                 max_completion_tokens: int = 4096, timeout_s: float = 120.0, memory_mb: int = 1024,
                 processes: int = 64, ro_paths: list[str] | None = None, env: dict[str, str] | None = None,
                 files: dict[str, str] | None = None, answer_file: str | None = None, jails: int | None = None):
        if not isinstance(command, list) or not command or not all(isinstance(a, str) and a for a in command):
            raise TaskError(f"agent: command must be a non-empty list of strings (the program's argv), got {command!r}")
        for position, argument in enumerate(command):
            if os.path.isabs(argument) and not os.path.exists(argument):
                raise TaskError(f"agent: command[{position}]: {argument} does not exist")
        for path in ro_paths or []:
            if not os.path.isabs(path) or not os.path.exists(path):
                raise TaskError(f"agent: ro_paths: {path!r} must be an existing absolute path")
        if not isinstance(tasks, dict) or not isinstance(tasks.get("name"), str) or set(tasks) - {"name", "args"}:
            raise TaskError(f"agent: tasks must be {{name: DOMAIN, args: {{...}}}}, got {tasks!r}")
        if tasks["name"] == "agent":
            raise TaskError("agent: tasks names the agent domain itself; name the domain whose tasks the agent does")
        if jails is not None and (isinstance(jails, bool) or not isinstance(jails, int) or jails < 1):
            raise TaskError(f"agent: jails must be a positive integer (agents run at once), got {jails!r}")
        for name, value in (("max_calls", max_calls), ("max_completion_tokens", max_completion_tokens),
                            ("timeout_s", timeout_s), ("memory_mb", memory_mb), ("processes", processes)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise TaskError(f"agent: {name} must be a positive number, got {value!r}")
        self.inner = get_domain(tasks["name"], **dict(tasks.get("args") or {}))
        self.name = "agent"
        self.max_level = self.inner.max_level
        self.timeout_s = float(timeout_s)
        self.env_args: dict[str, Any] = {
            "command": list(command), "max_calls": int(max_calls), "max_completion_tokens": int(max_completion_tokens),
            "memory_mb": int(memory_mb), "processes": int(processes), "ro_paths": list(ro_paths or []),
            "env": dict(env or {}), "answer_file": answer_file, "jails": jails,
        }
        self.files = dict(files or {})

    def make_task(self, rng: random.Random, level: int) -> Task:
        inner = self.inner.make_task(rng, level)
        files = {**dict(inner.env_args.get("files") or {}), **self.files}
        return Task(
            id=f"agent/{inner.id}", domain=self.name, messages=inner.messages, verifier=inner.verifier,
            verifier_args=inner.verifier_args, difficulty=inner.difficulty, env="agent",
            env_args={**self.env_args, "files": files}, tools=list(inner.tools),
            max_steps=self.env_args["max_calls"], timeout_s=self.timeout_s,
            metadata={**inner.metadata, "inner_domain": inner.domain, "inner_id": inner.id},
        )

    def demonstration(self, task: Task) -> SFTSample:
        inner = Task.from_dict({**task.to_dict(), "id": task.metadata.get("inner_id", task.id),
                                "domain": task.metadata.get("inner_domain", task.domain)})
        return self.inner.demonstration(inner)
