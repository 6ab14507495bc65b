"""Reward terms, the TRL way: functions of your own summed with registered verifiers, each part kept by name.

    rewards:                                       # an RL recipe (posttrain.config.RewardTerm)
      - {function: "my_rewards:brevity", weight: 0.2}
      - {verifier: math, weight: 1.0}

    def brevity(completion: str, task: Task) -> float:      # or `async def`
        return -len(completion) / 200

The episode's reward is ``score = sum(weight * term)`` over the terms (a sum, as TRL does, so a score may leave
[0, 1]); ``components`` holds each term's raw value under its name (the trainer logs ``reward/<name>``). A
``verifier`` term runs that registered verifier with its ``args`` (default: the task's own ``verifier_args``;
``verifier: task`` is the task's own verifier; ``binary: true`` makes the term 1 when the verifier passes and 0
otherwise, dropping its partial credit). ``passed`` is the verifier terms' verdict (all of them pass); with
function terms only, a positive score passes.

A function that raises, returns something that is not a finite number, or does not return within its term's
``timeout_s`` (default 120 s; an HTTP judge that never answers) makes the episode an infrastructure failure
(``FailureClass.INFRA``, its traceback in ``details`` and in the log) - retried by the episode loop and masked out
of training if it persists, never a reward of 0 the model would learn from. So does a verifier term's
own infrastructure failure.

The terms travel on the task (``task.metadata[REWARD_TERMS_KEY]``, plain dicts), so a Ray rollout worker judges
exactly as the local process does; a function is imported where it runs (`posttrain.usercode.resolve_function`).
A synchronous function runs on a daemon thread of its own, so one that hangs holds up neither the event loop,
nor the blocking verifiers (asyncio's default pool), nor the process's exit (a pool's threads are joined at exit:
a judge that never answers kept a finished run from ending); past its timeout the thread cannot be stopped and
runs on in the background, named in the log.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import logging
import math
import threading
import traceback
from typing import Any, Callable

from posttrain.types import FailureClass, Reward, Task
from posttrain.usercode import UserCodeError, resolve_function
from posttrain.verify.errors import VerifyError
from posttrain.verify.registry import check_verifier_args, get_verifier, is_blocking

log = logging.getLogger(__name__)

# Task.metadata: [{"name", "weight", "function", "timeout_s"} | {"name", "weight", "verifier", "args"[, "binary"]}]
REWARD_TERMS_KEY = "reward_terms"
FUNCTION_TIMEOUT_S = 120.0  # a function term's default bound on one call
_reported: set[tuple[str, str]] = set()  # (term, error) already logged with its traceback: once each per process


def with_reward_terms(task: Task, terms: list[dict[str, Any]]) -> Task:
    """A copy of `task` judged by `terms` (the recipe's `rewards:` as dicts) instead of its verifier alone."""
    for term in terms:
        if "verifier" in term:
            check_verifier_args(_verifier_name(term, task), _verifier_args(term, task))
    return dataclasses.replace(task, metadata={**task.metadata, REWARD_TERMS_KEY: terms})


async def judge_terms(task: Task, completion: str, final_state: dict[str, Any] | None = None) -> Reward:
    """The task's reward from its terms (see the module doc)."""
    terms = task.metadata[REWARD_TERMS_KEY]
    parts: dict[str, Reward] = {}
    for term in terms:
        parts[term["name"]] = (await _function_term(term, task, completion) if "function" in term
                               else await _verifier_term(term, task, completion, final_state))
    return _total(terms, parts)


def _total(terms: list[dict[str, Any]], parts: dict[str, Reward]) -> Reward:
    components = {name: reward.score for name, reward in parts.items()}
    details: dict[str, Any] = {name: reward.details for name, reward in parts.items() if reward.details}
    details["weights"] = {term["name"]: float(term.get("weight", 1.0)) for term in terms}
    broken = [reward for reward in parts.values() if reward.is_infrastructure_failure]
    if broken:
        return Reward(0.0, False, broken[0].failure, components=components, details=details)
    score = sum(float(term.get("weight", 1.0)) * parts[term["name"]].score for term in terms)
    verdicts = [parts[term["name"]] for term in terms if "verifier" in term]
    passed = all(reward.passed for reward in verdicts) if verdicts else score > 0
    failure = FailureClass.NONE if passed else next(
        (reward.failure for reward in verdicts if not reward.passed), FailureClass.WRONG_ANSWER)
    return Reward(score, passed, failure, components=components, details=details)


async def _verifier_term(term: dict[str, Any], task: Task, completion: str,
                         final_state: dict[str, Any] | None) -> Reward:
    name = _verifier_name(term, task)
    judge = functools.partial(get_verifier(name), completion, final_state=final_state, **_verifier_args(term, task))
    reward = judge() if not is_blocking(name) else await asyncio.to_thread(judge)
    if term.get("binary") and not reward.is_infrastructure_failure:  # the verdict, not the partial credit
        return dataclasses.replace(reward, score=float(reward.passed),
                                   details={**reward.details, "verifier_score": reward.score})
    return reward


async def _function_term(term: dict[str, Any], task: Task, completion: str) -> Reward:
    ref = term["function"]
    timeout = term.get("timeout_s", FUNCTION_TIMEOUT_S)
    try:
        call = _call(_function(ref), completion, task)
        try:
            value = await (asyncio.wait_for(call, timeout) if timeout is not None else call)
        except asyncio.TimeoutError:
            raise UserCodeError(f"reward function {ref} did not return within timeout_s={timeout:g} s (a "
                                "synchronous one runs on in the background: its thread cannot be stopped)") from None
        score = _number(value, ref)
    except Exception as error:  # noqa: BLE001 - the user's function failed: the system's failure, never a 0
        trace = traceback.format_exc(limit=8)
        key = (term["name"], f"{type(error).__name__}: {error}")
        if key not in _reported:
            _reported.add(key)
            log.error("reward function %s failed on task %s (the episode counts as an infrastructure failure):\n%s",
                      ref, task.id, trace)
        return Reward(0.0, False, FailureClass.INFRA,
                      details={"reward_function": ref, "error": key[1], "traceback": trace})
    return Reward(score, True)


async def _call(function: Callable[..., Any], completion: str, task: Task) -> Any:
    if inspect.iscoroutinefunction(function):
        return await function(completion, task)
    # it may wait (an HTTP judge, a subprocess): keep the event loop serving other episodes
    value = await _on_daemon_thread(functools.partial(function, completion, task))
    return await value if inspect.isawaitable(value) else value


async def _on_daemon_thread(call: Callable[[], Any]) -> Any:
    """`call()` on a thread of its own that never holds up the interpreter's exit (see the module doc)."""
    loop = asyncio.get_running_loop()
    done: asyncio.Future = loop.create_future()

    def settle(value: Any, error: BaseException | None) -> None:
        if not done.done():  # a timeout cancelled the wait
            done.set_exception(error) if error is not None else done.set_result(value)

    def run() -> None:
        try:
            value, error = call(), None
        except BaseException as failure:  # noqa: BLE001 - handed to the awaiting episode, which reports it
            value, error = None, failure
        try:
            loop.call_soon_threadsafe(settle, value, error)
        except RuntimeError:  # the loop is closed: nobody waits for the answer any more
            pass

    threading.Thread(target=run, name="posttrain-reward-fn", daemon=True).start()
    return await done


@functools.lru_cache(maxsize=None)
def _function(ref: str) -> Callable[..., Any]:
    return resolve_function(ref)


def _number(value: Any, ref: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        try:
            value = float(value)  # numpy and torch scalars
        except (TypeError, ValueError):
            raise UserCodeError(f"reward function {ref} returned {value!r:.60}, not a number") from None
    if not math.isfinite(value):
        raise UserCodeError(f"reward function {ref} returned {value}, not a finite number")
    return float(value)


def _verifier_name(term: dict[str, Any], task: Task) -> str:
    return task.verifier if term["verifier"] == "task" else term["verifier"]


def _verifier_args(term: dict[str, Any], task: Task) -> dict[str, Any]:
    args = term.get("args")
    return dict(task.verifier_args) if args is None else dict(args)


def check_terms(terms: list[dict[str, Any]]) -> None:
    """Fail early (before any rollout) on a function that cannot be imported or a verifier that is unknown."""
    for term in terms:
        if "function" in term:
            _function(term["function"])
        elif term["verifier"] != "task":
            try:
                get_verifier(term["verifier"])
            except VerifyError as error:
                raise VerifyError(f"rewards: {error}") from None
