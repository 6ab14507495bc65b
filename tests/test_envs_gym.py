"""The Gymnasium adapter (``env: gym``): real text envs registered with `gymnasium.register` in the test, driven
by the episode loop with a scripted policy; the env's rewards become the outcome and the process component, its
crashes and hangs infrastructure failures."""

from __future__ import annotations

import asyncio
import string
import time

import gymnasium
import pytest
from gymnasium import spaces
from test_envs_scripted import ScriptedEngine

from posttrain.envs import rollout_episode
from posttrain.tasks import get_domain, sample_tasks
from posttrain.types import FailureClass, SamplingParams

END = "<|end|>"
WORDS = ["apple", "river", "stone", "cloud", "tiger"]


class WordChain(gymnasium.Env):
    """Say the word shown; one point per correct word; the episode ends after `length` words."""

    metadata = {"render_modes": []}

    def __init__(self, length: int = 3, crash_at: int | None = None, hang_s: float = 0.0):
        self.length, self.crash_at, self.hang_s = length, crash_at, hang_s
        self.action_space = spaces.Text(max_length=8)
        self.observation_space = spaces.Text(max_length=64, charset=string.printable)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.words = [WORDS[int(i)] for i in self.np_random.integers(0, len(WORDS), self.length)]
        self.position = 0
        return f"Say: {self.words[0]}", {}

    def step(self, action):
        if self.crash_at == self.position:
            raise RuntimeError("the simulator segfaulted")
        time.sleep(self.hang_s)
        reward = 1.0 if action == self.words[self.position] else 0.0
        self.position += 1
        done = self.position == self.length
        observation = "" if done else f"Say: {self.words[self.position]}"
        return observation, reward, done, False, {}


gymnasium.register("posttrain-test/WordChain-v0", entry_point=WordChain)


def run(task, tokenizer, script):
    engine = ScriptedEngine(tokenizer, script)
    trajectory = asyncio.run(rollout_episode(engine, task, tokenizer, SamplingParams(max_new_tokens=16)))
    return trajectory, engine


def words_of(prompt: str) -> str:
    return prompt.rsplit("Say: ", 1)[1].split("<", 1)[0]


def one_task(**args):
    domain = get_domain("gym", env_id="posttrain-test/WordChain-v0", instructions="Repeat the word.", **args)
    return sample_tasks(domain, 1, level=1, seed=3)[0]


def test_a_perfect_episode_scores_the_return_with_its_process_component(tiny_tokenizer):
    task = one_task(max_steps=5, env_kwargs={"length": 3}, pass_threshold=3.0)
    trajectory, engine = run(task, tiny_tokenizer, lambda prompt, turn: words_of(prompt) + END)
    reward = trajectory.reward
    assert (reward.score, reward.passed, reward.failure) == (3.0, True, FailureClass.NONE)
    assert reward.components == {"env_return": 3.0, "process": 1.0}
    assert reward.details["step_rewards"] == [1.0, 1.0, 1.0] and trajectory.steps == 3
    # The observations are the env's text, in user turns after the instructions.
    users = [m["content"] for m in trajectory.messages if m["role"] == "user"]
    assert len(users) == 3 and all(u.startswith("Say: ") for u in users)
    assert trajectory.messages[0] == {"role": "system", "content": "Repeat the word."}
    # Token in, token out: the policy's tokens are the engine's ids, in order.
    policy_ids = [t for t, m in zip(trajectory.token_ids, trajectory.loss_mask) if m]
    assert policy_ids == [i for turn in engine.returned[task.id] for i in turn]


def test_partial_credit_is_the_process_signal_and_the_outcome_can_fail(tiny_tokenizer):
    task = one_task(max_steps=5, env_kwargs={"length": 3}, pass_threshold=3.0)
    trajectory, _ = run(task, tiny_tokenizer, lambda prompt, turn: (words_of(prompt) if turn == 0 else "zebra") + END)
    reward = trajectory.reward
    assert (reward.score, reward.passed, reward.failure) == (1.0, False, FailureClass.WRONG_ANSWER)
    assert reward.components["process"] == pytest.approx(1 / 3)


def test_the_recipe_step_limit_ends_the_episode_early(tiny_tokenizer):
    task = one_task(max_steps=2, env_kwargs={"length": 4}, pass_threshold=4.0)
    trajectory, _ = run(task, tiny_tokenizer, lambda prompt, turn: words_of(prompt) + END)
    assert trajectory.steps == 2 and trajectory.reward.score == 2.0 and not trajectory.reward.passed


def test_an_action_outside_the_space_is_a_format_failure(tiny_tokenizer):
    task = one_task(env_kwargs={"length": 2})
    trajectory, _ = run(task, tiny_tokenizer, ["abcdefghijk" + END])  # longer than the Text space allows
    assert trajectory.reward.failure is FailureClass.FORMAT and trajectory.reward.score == 0.0
    assert trajectory.steps == 1


@pytest.mark.parametrize("env_kwargs", [{"crash_at": 1}, {"hang_s": 1.0}])
def test_a_crashing_or_hanging_env_is_an_infrastructure_failure(tiny_tokenizer, env_kwargs):
    task = one_task(env_kwargs={"length": 3, **env_kwargs}, step_timeout_s=0.3)
    trajectory, _ = run(task, tiny_tokenizer, lambda prompt, turn: words_of(prompt) + END)
    assert trajectory.reward.failure is FailureClass.INFRA, trajectory.reward.details
    assert trajectory.reward.is_infrastructure_failure and sum(trajectory.loss_mask) == 0  # masked, not a 0
    assert "WordChain" in trajectory.reward.details["error"]


def test_levels_pick_env_kwargs_and_heldout_seeds_are_disjoint():
    domain = get_domain("gym", env_id="posttrain-test/WordChain-v0", levels={1: {"length": 1}, 2: {"length": 3}})
    assert domain.max_level == 2
    hard = sample_tasks(domain, 3, level=2, seed=0)
    assert all(t.env_args["env_kwargs"] == {"length": 3} and t.verifier == "environment" for t in hard)
    train = {t.metadata["seed"] for t in sample_tasks(domain, 50, level=1, seed=0)}
    heldout = {t.metadata["seed"] for t in sample_tasks(domain, 5, level=1, split="heldout", seed=0)}
    assert not train & heldout
