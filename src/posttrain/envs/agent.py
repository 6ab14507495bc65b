"""Black-box agents: any program that talks to an OpenAI-compatible endpoint, run per episode in the sandbox
and trained on, token-exactly.

    Task(..., env="agent", env_args={"command": ["{python}", "/abs/path/my_agent.py"], "max_calls": 8})

One episode (`AgentEnv.drive`, called by `posttrain.envs.rollout_episode`):

1. a `RecordingEndpoint` (``posttrain.envs.agent_endpoint``) is served on a unix socket in an endpoint directory
   of this process (mode 0700 above it; one directory per concurrent episode, reused, so a sandbox launcher
   binds a bounded number of them);
2. the agent runs in a fresh jail (`posttrain.sandbox`: no network but a loopback of its own, read-only system)
   on this machine, beside its endpoint: in the sandbox's pool when it is local, else (Ray's sandbox workers run
   the tools and verifiers elsewhere) in `posttrain.sandbox.local_pool()` -- on Ray, the rollout worker's; with
   ``jails: N`` in a pool of N slots of its own (an agent holds its jail while it waits on the model, so a slot
   per CPU would let only that many episodes reach the engine at once).
   Its work dir holds the task's files and ``task.json`` (the task's id, messages and tool names -- never the
   verifier's arguments); read-only inside: the endpoint directory (the socket and `_agent_jail.py`, the
   loopback proxy that starts the agent with ``OPENAI_BASE_URL``), the trainer's Python when the command says
   ``{python}``, and every absolute path of the command. ``OPENAI_API_KEY`` is this episode's own key;
3. every call is sampled from the policy and recorded (see the endpoint's docstring for how calls join);
4. when the agent exits, the final state is judged by the task's verifier: ``answer`` (the agent's stdout, or
   the file ``answer_file`` when set) and ``files`` (the work dir's text files, ``task.json`` left out).

Failures: an agent that exits non-zero, is killed (time, memory, output), or whose jail cannot start is an
infrastructure failure (``infra`` / ``sandbox_failure``: masked, never scored 0) -- unless a limit of the
episode (calls, completion tokens, context) was hit first: running out of budget is the model's doing, so the
final state is judged and a failure is ``TRUNCATED``. A policy that fails mid-episode is ``infra``.

The trajectory is the episode's last segment (one causal sequence); when the agent broke the chain of calls
(edited, truncated or summarised its history), the earlier segments are kept token-exact in
``metadata["agent"]["earlier_segments"]``, and the trainer trains on every one of them: `trajectory_segments`
(``posttrain.envs.episode``) makes each its own sequence with the episode's reward and advantage.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from posttrain.envs.agent_endpoint import EndpointLimits, RecordingEndpoint
from posttrain.envs.agent_http import UnixHTTPServer
from posttrain.envs.base import Action, EnvError, Observation, StepResult, environment
from posttrain.envs.sandboxing import default_sandbox
from posttrain.envs.tokens import TranscriptTokens
from posttrain.sandbox import JailOptions, Sandbox, SandboxPool, local_pool, python_runtime_paths
from posttrain.types import Task

PYTHON_PLACEHOLDER = "{python}"
TASK_FILE = "task.json"
_PROXY_SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_agent_jail.py")
_SOCKET = "endpoint.sock"
_START_MARGIN_S = 2.0  # of the episode's time, kept for tearing the jail down and judging
_ANSWER_CHARS = 20_000
_FILE_BYTES = 200_000


@dataclass
class DrivenEpisode:
    """What an environment that drives the policy itself reports to the episode loop."""

    tokens: TranscriptTokens
    steps: int = 0
    truncated: bool = False
    timed_out: bool = False
    final_answer: str | None = None
    finish_reasons: list[str] = field(default_factory=list)
    infra: tuple[str, str] | None = None  # (failure class value, message) when the episode is the system's fault
    metadata: dict[str, Any] = field(default_factory=dict)


class _EndpointDirs:
    """Directories for endpoint sockets: one per concurrent episode, reused (a launcher stages each once)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._base: str | None = None
        self._free: list[str] = []
        self._count = 0
        self._owner = os.getpid()

    def acquire(self) -> str:
        with self._lock:
            if self._base is None or self._owner != os.getpid():
                self._base, self._free, self._count, self._owner = (
                    tempfile.mkdtemp(prefix="posttrain-agents-"), [], 0, os.getpid())
                os.chmod(self._base, 0o700)  # nobody else on the host reaches the sockets
                atexit.register(shutil.rmtree, self._base, True)
            if self._free:
                return self._free.pop()
            path = os.path.join(self._base, f"e{self._count}")
            self._count += 1
        os.mkdir(path)
        os.chmod(path, 0o755)  # the jail's uid traverses it (through the launcher's staging bind)
        return path

    def release(self, path: str) -> None:
        for name in os.listdir(path):
            os.unlink(os.path.join(path, name))
        with self._lock:
            self._free.append(path)


_DIRS = _EndpointDirs()

@environment("agent")
class AgentEnv:
    """The environment of a black-box agent program (see the module doc). It drives the policy itself, so
    `step` is never called: the episode loop calls `drive`."""

    def __init__(self, command: list[str], sandbox: Any = None, parser: Any = None, files: dict[str, str] | None = None,
                 ro_paths: list[str] | tuple[str, ...] = (), env: dict[str, str] | None = None,
                 max_calls: int = 16, max_completion_tokens: int = 4096, memory_mb: int = 1024,
                 processes: int = 64, answer_file: str | None = None, jails: int | None = None, **options: Any):
        if not isinstance(command, list) or not command or not all(isinstance(a, str) for a in command):
            raise EnvError(f"agent: command must be a non-empty list of strings, got {command!r}")
        self.command = list(command)
        self.sandbox = sandbox
        self.parser = parser
        self.files = dict(files or {})
        self.ro_paths = tuple(ro_paths)
        self.env = dict(env or {})
        self.max_calls, self.max_completion_tokens = int(max_calls), int(max_completion_tokens)
        self.memory_mb, self.processes = int(memory_mb), int(processes)
        self.answer_file = answer_file
        self.jails = int(jails) if jails else None
        self.options = options
        self.task: Task | None = None
        self.state: dict[str, Any] = {"answer": None, "files": {}}

    async def reset(self, task: Task) -> Observation:
        self.task = task
        return Observation(messages=[dict(m) for m in task.messages])

    async def step(self, action: Action) -> StepResult:
        raise EnvError("the agent environment drives the policy itself (AgentEnv.drive); it takes no steps")

    def final_state(self) -> dict[str, Any]:
        return dict(self.state)

    async def drive(self, policy: Any, task: Task, tokenizer: Any, sampling: Any, *, deadline: float,
                    max_context_tokens: int | None = None, template_kwargs: dict[str, Any] | None = None
                    ) -> DrivenEpisode:
        """Run the agent once against a recording endpoint of `policy`; the final state is in `final_state`."""
        self.task = task
        limits = EndpointLimits(self.max_calls, self.max_completion_tokens, max_context_tokens)
        endpoint = RecordingEndpoint(policy, tokenizer, sampling, limits, parser=self.parser,
                                     template_kwargs=template_kwargs)
        directory = _DIRS.acquire()
        server = UnixHTTPServer(os.path.join(directory, _SOCKET), endpoint.handle)
        try:
            shutil.copyfile(_PROXY_SOURCE, os.path.join(directory, "_agent_jail.py"))
            await server.start()
            os.chmod(server.path, 0o666)  # the jail's uid connects; the 0700 directory above keeps others out
            result = await self._run_jail(task, directory, endpoint.api_key, deadline)
        finally:
            await server.close()
            _DIRS.release(directory)
        return self._report(task, tokenizer, template_kwargs, endpoint, result)

    async def _run_jail(self, task: Task, directory: str, api_key: str, deadline: float) -> Any:
        box = self.sandbox if self.sandbox is not None else default_sandbox()
        # The endpoint's socket lives in this process: a jail on a remote sandbox worker (Ray's sandbox workers)
        # could not reach it, so the agent runs in a pool on this machine, beside its endpoint.
        # with `jails`, a pool of that many slots: an agent holds its jail while it waits on the model, so a slot
        # per CPU would let only that many episodes reach the engine at once
        if self.jails:
            pool = local_pool(self.jails)
        else:
            pool = box.pool if isinstance(box.pool, SandboxPool) else local_pool()
        command, ro_paths = self._command()
        timeout_s = max(1.0, deadline - time.monotonic() - _START_MARGIN_S)
        limits = box.limits.replace(timeout_s=timeout_s, cpu_s=timeout_s, memory_mb=self.memory_mb,
                                    processes=self.processes)
        jail = JailOptions(python=box.jail.python, ro_paths=(directory, *ro_paths))
        agent_box = Sandbox(limits, pool=pool, jail=jail)
        files = {**self.files, TASK_FILE: _task_json(task)}
        environment_vars = {**self.env, "OPENAI_API_KEY": api_key, "POSTTRAIN_TASK": TASK_FILE,
                            "POSTTRAIN_MODEL": "policy"}
        argv = [box.jail.python, "-S", "-E", os.path.join(directory, "_agent_jail.py"),
                os.path.join(directory, _SOCKET), "--", *command]
        try:
            return await agent_box.arun(argv, files=files, env=environment_vars, collect=True)
        except Exception as error:  # noqa: BLE001 - the sandbox itself failed: the system's fault
            return error

    def _command(self) -> tuple[list[str], tuple[str, ...]]:
        """The argv with ``{python}`` resolved, and the host paths it needs read-only in the jail."""
        command, paths = [], set(self.ro_paths)
        for argument in self.command:
            if argument == PYTHON_PLACEHOLDER:
                argument = sys.executable
                paths.update(python_runtime_paths(sys.executable))
            elif os.path.isabs(argument) and os.path.exists(argument) and not argument.startswith("/usr/"):
                paths.add(argument)
            command.append(argument)
        return command, tuple(sorted(paths))

    def _report(self, task: Task, tokenizer: Any, template_kwargs: dict[str, Any] | None,
                endpoint: RecordingEndpoint, result: Any) -> DrivenEpisode:
        segments = endpoint.segments
        tokens = segments[-1] if segments else TranscriptTokens(tokenizer, task.messages, None, template_kwargs)
        calls = endpoint.calls
        driven = DrivenEpisode(tokens=tokens, steps=len(calls),
                               finish_reasons=[c.completion.finish_reason for c in calls])
        calls_per_segment = Counter(c.segment for c in calls)
        driven.metadata = {
            "calls": len(calls), "segments": len(segments), "completion_tokens": endpoint.completion_tokens,
            "limit_hit": endpoint.limit_hit, "refused_calls": endpoint.refused_calls,
            "ignored_params": sorted(endpoint.ignored_params),
            "earlier_segments": [_segment_dict(s, calls_per_segment[i]) for i, s in enumerate(segments[:-1])],
        }
        # Only the episode's own limits truncate it: a call cut at its max_tokens is the agent's to handle (it
        # got finish_reason "length"), as a human-written client would.
        driven.truncated = endpoint.limit_hit is not None
        if endpoint.engine_error:
            driven.infra = ("infra", f"policy: {endpoint.engine_error}")
            return driven
        if isinstance(result, Exception):
            driven.infra = ("sandbox_failure", f"sandbox: {type(result).__name__}: {result}")
            return driven
        driven.metadata.update({"exit_code": result.exit_code, "status": str(result.status),
                                "stderr_tail": result.stderr[-2000:], "duration_s": result.duration_s})
        if result.is_infra_error:
            driven.infra = ("sandbox_failure", f"sandbox infra_error: {result.error[-300:]}")
            return driven
        self.state = self._final_state(result)
        driven.final_answer = self.state["answer"]
        if not result.ok and endpoint.limit_hit is None:
            driven.timed_out = str(result.status) == "timeout"
            what = "timed out" if driven.timed_out else f"failed ({result.status}, exit {result.exit_code})"
            if endpoint.last_answer_at is not None:
                idle = time.monotonic() - endpoint.last_answer_at
                what += f" after {len(calls)} call(s), the last answered {idle:.1f} s before the end"
            driven.infra = ("infra", f"agent {what}: {result.stderr[-300:].strip()}")
        return driven

    def _final_state(self, result: Any) -> dict[str, Any]:
        files = {}
        for path, data in sorted(result.files.items()):
            if path == TASK_FILE or len(data) > _FILE_BYTES:
                continue
            files[path] = data.decode("utf-8", errors="replace")
        if self.answer_file is not None:
            answer = files.get(self.answer_file)
        else:
            answer = result.stdout[-_ANSWER_CHARS:].strip()
        return {"answer": answer, "files": files, "agent_exit_code": result.exit_code}


def _task_json(task: Task) -> str:
    return json.dumps({"id": task.id, "domain": task.domain, "messages": task.messages, "tools": task.tools})


def _segment_dict(tokens: TranscriptTokens, calls: int) -> dict[str, Any]:
    return {"token_ids": list(tokens.token_ids), "loss_mask": list(tokens.loss_mask),
            "behaviour_logprobs": list(tokens.behaviour_logprobs), "policy_versions": list(tokens.policy_versions),
            "prompt_length": tokens.prompt_length, "calls": calls, "messages": [dict(m) for m in tokens.messages]}
