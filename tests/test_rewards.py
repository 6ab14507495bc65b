"""Reward functions the TRL way: a user's `(completion, task) -> float` (sync or async) summed with verifiers,
each term reported by name; a function that raises is an infrastructure failure with its traceback, never a 0."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
import time

import pytest
from test_envs_scripted import ScriptedEngine

from posttrain.config import ConfigError, RLRecipe, load_recipe
from posttrain.envs import run_episodes
from posttrain.rl import reward_metrics, reward_terms, with_rewards
from posttrain.types import FailureClass, SamplingParams, Task
from posttrain.verify.rewards import REWARD_TERMS_KEY, judge_terms, with_reward_terms

END = "<|end|>"
REWARDS = '''
import asyncio

calls = []


def brevity(completion, task):
    calls.append(task.id)
    return -len(completion) / 100


async def polite(completion, task):
    await asyncio.sleep(0)
    return 1.0 if "please" in completion else 0.0


def broken(completion, task):
    return {"score": 1}[completion]  # a KeyError: the user's bug


def not_a_number(completion, task):
    return "high"


def hangs(completion, task):  # a judge that does not answer within the tests' timeouts
    import os
    import time
    time.sleep(float(os.environ.get("HANG_S", "3")))
    return 1.0


async def hangs_async(completion, task):
    await asyncio.sleep(3)
    return 1.0
'''


@pytest.fixture()
def rewards_file(tmp_path):
    path = tmp_path / "my_rewards.py"
    path.write_text(REWARDS)
    return str(path)


def _task(reference: str = "42") -> Task:
    return Task(id="t1", domain="math", messages=[{"role": "user", "content": "6*7?"}], verifier="math",
                verifier_args={"reference": reference})


def _terms(rewards_file: str, *functions: tuple[str, float]) -> list[dict]:
    recipe = RLRecipe(rewards=[{"verifier": "math", "weight": 1.0},
                               *({"function": f"{rewards_file}:{name}", "weight": w} for name, w in functions)])
    return reward_terms(recipe)


def test_functions_and_verifiers_sum_with_their_weights(rewards_file):
    task = with_reward_terms(_task(), _terms(rewards_file, ("brevity", 0.2), ("polite", 0.5)))
    completion = "please: \\boxed{42}"
    reward = asyncio.run(judge_terms(task, completion))
    assert reward.passed and reward.failure == FailureClass.NONE
    assert reward.components == {"math": 1.0, "brevity": -len(completion) / 100, "polite": 1.0}
    assert reward.score == pytest.approx(1.0 + 0.2 * (-len(completion) / 100) + 0.5)
    wrong = asyncio.run(judge_terms(task, "\\boxed{41}"))
    assert not wrong.passed and wrong.failure == FailureClass.WRONG_ANSWER
    assert wrong.score == pytest.approx(0.2 * (-len("\\boxed{41}") / 100))


@pytest.mark.parametrize("name, message", [("broken", "KeyError"), ("not_a_number", "returned 'high', not a number")])
def test_a_failing_function_is_an_infrastructure_failure_with_its_traceback(rewards_file, caplog, name, message):
    task = with_reward_terms(_task(), _terms(rewards_file, (name, 1.0)))
    with caplog.at_level(logging.ERROR, logger="posttrain.verify.rewards"):
        reward = asyncio.run(judge_terms(task, "\\boxed{42}"))
    assert reward.failure == FailureClass.INFRA and reward.is_infrastructure_failure and reward.score == 0.0
    detail = reward.details[name]
    assert message in detail["error"] and "Traceback" in detail["traceback"]
    assert any(f"reward function {rewards_file}:{name} failed" in r.message for r in caplog.records)


def test_episodes_are_judged_by_the_terms_and_a_broken_function_is_retried_not_scored(tiny_tokenizer, rewards_file):
    tasks = [_task()]
    good = with_rewards(lambda ts, s: run_episodes(ScriptedEngine(tiny_tokenizer, ["\\boxed{42}" + END]), ts,
                                                   tiny_tokenizer, s, n=2, infra_retries=1),
                        RLRecipe(rewards=[{"verifier": "task"}, {"function": f"{rewards_file}:brevity",
                                                                 "weight": 0.5, "name": "short"}]))
    trajectories = good(tasks, SamplingParams(max_new_tokens=16))
    assert all(t.reward.passed and set(t.reward.components) == {"task", "short"} for t in trajectories)
    assert tasks[0].metadata == {}  # the sampler's task is not changed
    metrics = reward_metrics(trajectories)
    assert metrics["reward/task"] == 1.0 and metrics["reward/short"] == pytest.approx(-0.1)

    bad = with_rewards(lambda ts, s: run_episodes(ScriptedEngine(tiny_tokenizer, ["\\boxed{42}" + END]), ts,
                                                  tiny_tokenizer, s, n=1, infra_retries=1),
                       RLRecipe(rewards=[{"function": f"{rewards_file}:broken"}]))
    [failed] = bad(tasks, SamplingParams(max_new_tokens=16))
    assert failed.reward.is_infrastructure_failure and failed.metadata["attempts"] == 2
    assert reward_metrics([failed]) == {}


def test_recipe_errors(tmp_path, rewards_file):
    recipe = tmp_path / "rl.yaml"
    recipe.write_text("stage: rl\nrewards:\n  - {function: brevity}\n")
    with pytest.raises(ConfigError, match="rl.yaml:3: .*'module:function'"):
        load_recipe(recipe)
    recipe.write_text("stage: rl\nrewards:\n  - {function: 'a:b', verifier: math}\n")
    with pytest.raises(ConfigError, match="exactly one of"):
        load_recipe(recipe)
    recipe.write_text("stage: rl\ndomains: [{name: math}]\nrewards:\n  - {verifier: math}\n")
    with pytest.raises(ConfigError, match=r"term names \['math'\] are taken by reward/<domain>"):
        load_recipe(recipe)  # its figure would overwrite the domain's reward/math
    recipe.write_text("stage: rl\nrollout: {engine: vllm}\n")
    with pytest.raises(ConfigError, match="rollout.engine: vllm needs model.path"):
        load_recipe(recipe)
    recipe.write_text(f"stage: rl\nrewards:\n  - {{verifier: math}}\n  - {{function: '{rewards_file}:nope'}}\n")
    with pytest.raises(Exception, match="has no 'nope'"):
        reward_terms(load_recipe(recipe))
    task = _task()
    with pytest.raises(Exception, match="verifier 'code'"):
        with_reward_terms(task, [{"name": "code", "weight": 1.0, "verifier": "code", "args": None}])
    assert REWARD_TERMS_KEY not in task.metadata


@pytest.mark.bwrap
def test_a_binary_verifier_term_scores_the_verdict_not_the_partial_credit():
    """`binary: true` on a verifier term: the code verifier's share of cases passed becomes 1 or 0 (RLVR's
    all-or-nothing reward); its own score stays in the details; a function term cannot be binary."""
    cases = [{"args": [x], "expected": x > 3} for x in (-5, 0, 2, 4, 9, 20)]
    task = Task(id="c1", domain="code", messages=[{"role": "user", "content": "is_big(x): x > 3"}], verifier="code",
                verifier_args={"tests": {"function": "is_big", "cases": cases}})
    wrong_constant = "```python\ndef is_big(x):\n    return x > 1\n```"  # fails only the case x = 2
    right = "```python\ndef is_big(x):\n    return x > 3\n```"
    partial = with_reward_terms(task, reward_terms(RLRecipe(rewards=[{"verifier": "task"}])))
    binary = with_reward_terms(task, reward_terms(RLRecipe(rewards=[{"verifier": "task", "binary": True}])))
    assert asyncio.run(judge_terms(partial, wrong_constant)).score == pytest.approx(5 / 6)
    judged = asyncio.run(judge_terms(binary, wrong_constant))
    assert judged.score == 0.0 and not judged.passed and judged.components == {"task": 0.0}
    assert judged.details["task"]["verifier_score"] == pytest.approx(5 / 6)
    assert asyncio.run(judge_terms(binary, right)).score == 1.0
    with pytest.raises(Exception, match="binary: only a verifier term"):
        RLRecipe(rewards=[{"function": "m:f", "binary": True}])


@pytest.mark.parametrize("name", ["hangs", "hangs_async"])
def test_a_function_that_does_not_return_in_its_timeout_is_an_infrastructure_failure(rewards_file, caplog, name):
    """An HTTP judge that never answers held the RL step forever; past `timeout_s` the episode is an infrastructure
    failure (retried, then masked), and a hung synchronous one does not take the blocking verifiers' threads."""
    terms = reward_terms(RLRecipe(rewards=[{"verifier": "math"}, {"function": f"{rewards_file}:{name}",
                                                                   "timeout_s": 0.5}]))
    assert terms[1]["timeout_s"] == 0.5
    task = with_reward_terms(_task(), terms)

    async def judge_while_hung():
        started = time.monotonic()
        hung = asyncio.gather(*(judge_terms(task, "\\boxed{42}") for _ in range(40)))  # more than any pool's threads
        await asyncio.sleep(0.1)
        # asyncio's default pool (the blocking verifiers', asyncio.to_thread) is still free
        assert await asyncio.wait_for(asyncio.to_thread(lambda: "free"), 2) == "free"
        return await hung, time.monotonic() - started

    with caplog.at_level(logging.ERROR, logger="posttrain.verify.rewards"):
        rewards, seconds = asyncio.run(judge_while_hung())
    assert seconds < 10
    for reward in rewards:
        assert reward.is_infrastructure_failure and reward.score == 0.0
        assert "did not return within timeout_s=0.5 s" in reward.details[name]["error"]
    assert any(f"reward function {rewards_file}:{name} failed" in r.message for r in caplog.records)


def test_the_function_timeout_is_the_recipe_default_and_only_a_function_term_takes_one(rewards_file):
    from posttrain.config.rl import FUNCTION_TIMEOUT_S as RECIPE_DEFAULT
    from posttrain.verify.rewards import FUNCTION_TIMEOUT_S

    assert RECIPE_DEFAULT == FUNCTION_TIMEOUT_S == 120.0
    [term] = reward_terms(RLRecipe(rewards=[{"function": f"{rewards_file}:brevity"}]))
    assert term["timeout_s"] == FUNCTION_TIMEOUT_S
    [term] = reward_terms(RLRecipe(rewards=[{"function": f"{rewards_file}:brevity", "timeout_s": None}]))
    assert term["timeout_s"] is None  # no bound, as asked
    with pytest.raises(Exception, match="timeout_s: only a function term"):
        RLRecipe(rewards=[{"verifier": "math", "timeout_s": 5}])
    # a recipe saved with its defaults loads back (the verifier term's default timeout_s is not "set")
    recipe = RLRecipe(rewards=[{"verifier": "math"}, {"function": f"{rewards_file}:brevity", "timeout_s": 3}])
    again = RLRecipe.model_validate(recipe.model_dump(mode="json"))
    assert [t.timeout_s for t in again.rewards] == [FUNCTION_TIMEOUT_S, 3]


def test_a_hung_reward_function_does_not_keep_the_process_from_exiting(rewards_file):
    """A pool's threads are joined at the interpreter's exit: a judge that never answers kept a finished run's
    process alive. Here the judge sleeps 120 s past its 0.5 s timeout; the process must end long before."""
    script = f"""
import asyncio
from posttrain.config import RLRecipe
from posttrain.rl import reward_terms
from posttrain.types import Task
from posttrain.verify.rewards import judge_terms, with_reward_terms
task = Task(id="t", domain="math", messages=[{{"role": "user", "content": "6*7?"}}], verifier="math",
            verifier_args={{"reference": "42"}})
terms = reward_terms(RLRecipe(rewards=[{{"function": "{rewards_file}:hangs", "timeout_s": 0.5}}]))
print(asyncio.run(judge_terms(with_reward_terms(task, terms), "42")).failure.value)
"""
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=100,
                          env={**os.environ, "HANG_S": "120"})
    assert done.returncode == 0 and done.stdout.strip() == FailureClass.INFRA.value, done.stderr
    assert time.monotonic() - started < 100
