"""The OpenEnv adapter (``env: openenv``) against a real OpenEnv server started in the test: an environment built
with OpenEnv's own API (`Environment`, `Action`, `Observation`, `create_fastapi_app`), served by uvicorn on a
loopback port, driven over its WebSocket protocol by OpenEnv's `GenericEnvClient` inside posttrain's episode loop.

Importing OpenEnv's server side imports gradio (tens of seconds on a loaded machine), once per test session.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest
from test_envs_scripted import ScriptedEngine

from posttrain.envs import rollout_episode, rollout_many
from posttrain.tasks import get_domain, sample_tasks
from posttrain.types import FailureClass, SamplingParams

END = "<|end|>"
WORDS = ["apple", "river", "stone", "cloud", "tiger"]


def _build_app():
    from openenv.core.env_server import Action, Environment, Observation, State, create_fastapi_app

    class SayAction(Action):
        message: str

    class SayObservation(Observation):
        prompt: str = ""

    class SayEnv(Environment):
        """Say the words shown, one per step: a step reward of 1 per correct word; `crash` makes step 2 raise."""

        SUPPORTS_CONCURRENT_SESSIONS = True

        def __init__(self):
            super().__init__()
            self._state = State(episode_id=None, step_count=0)

        def reset(self, seed=None, episode_id=None, length=2, crash=False, **kwargs):
            self.words = [WORDS[(int(seed or 0) + i) % len(WORDS)] for i in range(length)]
            self.crash = crash
            self._state = State(episode_id=episode_id, step_count=0)
            return SayObservation(prompt=f"Say: {self.words[0]}")

        def step(self, action, timeout_s=None, **kwargs):
            position = self._state.step_count
            if self.crash and position == 1:
                raise RuntimeError("the environment's database went away")
            self._state.step_count += 1
            reward = 1.0 if action.message.strip() == self.words[position] else 0.0
            done = self._state.step_count == len(self.words)
            prompt = "" if done else f"Say: {self.words[self._state.step_count]}"
            return SayObservation(prompt=prompt, done=done, reward=reward)

        @property
        def state(self):
            return self._state

    return create_fastapi_app(SayEnv, SayAction, SayObservation, max_concurrent_envs=8)


@pytest.fixture(scope="module")
def server_url():
    import uvicorn

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(_build_app(), host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=10)


def words_of(prompt: str) -> str:
    return prompt.rsplit("Say: ", 1)[1].split("<", 1)[0]


def tasks(url, count=1, **args):
    domain = get_domain("openenv", base_url=url, instructions="Repeat the word.", step_timeout_s=5.0, **args)
    return sample_tasks(domain, count, level=1, seed=1)


def run(task, tokenizer, script):
    engine = ScriptedEngine(tokenizer, script)
    return asyncio.run(rollout_episode(engine, task, tokenizer, SamplingParams(max_new_tokens=16))), engine


def test_an_episode_is_driven_over_the_server_and_scored_by_its_rewards(tiny_tokenizer, server_url):
    task = tasks(server_url, reset_kwargs={"length": 3}, pass_threshold=3.0)[0]
    trajectory, engine = run(task, tiny_tokenizer, lambda prompt, turn: (words_of(prompt) if turn != 1 else "no") + END)
    reward = trajectory.reward
    assert trajectory.steps == 3 and reward.details["step_rewards"] == [1.0, 0.0, 1.0]
    assert (reward.score, reward.passed, reward.failure) == (2.0, False, FailureClass.WRONG_ANSWER)
    assert reward.components == {"env_return": 2.0, "process": pytest.approx(2 / 3)}
    users = [m["content"] for m in trajectory.messages if m["role"] == "user"]
    assert [u.split(": ")[0] for u in users] == ["Say", "Say", "Say"]  # the server's observations, in turn
    policy_ids = [t for t, m in zip(trajectory.token_ids, trajectory.loss_mask) if m]
    assert policy_ids == [i for turn in engine.returned[task.id] for i in turn]  # the sampled ids, verbatim


def test_concurrent_episodes_get_their_own_sessions(tiny_tokenizer, server_url):
    batch = tasks(server_url, count=3, reset_kwargs={"length": 2}, pass_threshold=2.0)
    engine = ScriptedEngine(tiny_tokenizer, lambda prompt, turn: words_of(prompt) + END)
    trajectories = asyncio.run(rollout_many(engine, batch, tiny_tokenizer, SamplingParams(max_new_tokens=16), n=2))
    assert len(trajectories) == 6 and all(t.reward.passed and t.reward.score == 2.0 for t in trajectories)


def test_a_crashing_environment_is_an_infrastructure_failure(tiny_tokenizer, server_url):
    task = tasks(server_url, reset_kwargs={"length": 3, "crash": True})[0]
    trajectory, _ = run(task, tiny_tokenizer, lambda prompt, turn: words_of(prompt) + END)
    assert trajectory.reward.failure is FailureClass.INFRA and sum(trajectory.loss_mask) == 0
    assert "OpenEnv step" in trajectory.reward.details["error"]


def test_a_server_that_is_not_there_is_an_infrastructure_failure(tiny_tokenizer):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # closed again: nothing listens there
    task = tasks(f"http://127.0.0.1:{port}")[0]
    trajectory, _ = run(task, tiny_tokenizer, ["apple" + END])
    assert trajectory.reward.failure is FailureClass.INFRA and trajectory.reward.score == 0.0
    assert "OpenEnv server" in trajectory.reward.details["error"]
