"""The episode loop: generate -> execute -> observe until done, then verify the final state.

    trajectory = await rollout_episode(policy, task, tokenizer, SamplingParams(max_new_tokens=128))
    group = await rollout_group(policy, task, tokenizer, sampling, n=8)        # one GRPO group
    batch = await rollout_many(policy, tasks, tokenizer, sampling, n=8)        # many groups, concurrently

One episode: make the task's environment, reset it, tokenize the prompt once, then up to ``task.max_steps`` turns
of (the policy samples a turn from the exact token sequence so far; the env executes it; its observation is
appended as chat-template delta tokens, see `posttrain.envs.tokens`). It stops when the env says done, when
``task.timeout_s`` of the environment's wall time is spent, when a turn is cut off by the token limit, or when the
context is full. Time spent waiting for the engine (generation, and queueing behind other episodes' generation)
is not the model's and does not count against ``timeout_s``: a turn's length is bounded by its tokens, and on a
busy machine a correct answer that waited in the engine's queue must not be scored as a timeout. An engine that
produces nothing within ``ENGINE_WAIT_S`` is an infrastructure failure.
The final state is judged by the task's verifier, the same one evaluation uses.

Failure classes (``Trajectory.reward.failure``), first match wins:

* ``INFRA`` / ``SANDBOX``: the engine raised, the env crashed, a tool's sandbox failed to start, or the verifier
  reported an infrastructure failure. Such a trajectory is the system's fault: its ``loss_mask`` is zeroed and
  its score must be masked, never trained on as a 0 (`is_infrastructure_failure`);
* solved: ``NONE`` (even if truncated or out of time: the final state passed);
* ``TRUNCATED``: a turn hit the token limit or the context filled up;
* ``TIMEOUT``: the episode ran out of wall time;
* ``TOOL_ERROR``: tool calls failed, and no final answer was given, or the last step's call failed, or no call
  ever succeeded;
* otherwise the verifier's class (``FORMAT``, ``WRONG_ANSWER``, ``TIMEOUT`` of the model's code ...).

``env_args["step_cost"]`` adds a ``step_cost`` component (``-cost * (steps - 1)``) to the reward for the RL return; the
score itself stays the verifier's outcome, so evaluation and training read the same number.

**Process rewards.** A step may report ``info["step_reward"]`` (a Gymnasium or OpenEnv step reward, a verifiers
per-turn score, a tool env's step check: the share of the step's tool calls that succeeded). The mean over the
steps that reported one becomes the reward's ``process`` component (the step rewards are kept in
``details["step_rewards"]``), which the RL return weighs by ``returns.process_weight``
(`posttrain.rl.advantages.episode_return`); the score stays the outcome.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from collections import Counter
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Coroutine, Iterable, Sequence

from posttrain.envs.base import Action, ToolInfraError, make_environment
from posttrain.envs.policy import as_policy, turn_sampling
from posttrain.envs.tokens import PromptRenderer, TranscriptTokens, strip_eos
from posttrain.types import FailureClass, GenerationRequest, Reward, SamplingParams, Task, Trajectory

log = logging.getLogger(__name__)
# An engine that returns nothing for this long is broken or wedged: an infrastructure failure, never a timeout of the
# model's (queueing behind a long batch on a busy CPU takes seconds to minutes, not a quarter of an hour).
ENGINE_WAIT_S = 900.0
_CALLS = itertools.count()  # numbers rollout calls, so group ids are unique in a process and reproducible


class _Infra(Exception):
    def __init__(self, failure: FailureClass, message: str):
        super().__init__(message)
        self.failure = failure


@dataclass
class _Episode:
    """Mutable bookkeeping of one episode while it runs."""

    steps: int = 0
    tool_calls: int = 0
    tool_calls_ok: int = 0
    failed_steps: int = 0
    last_step_failed: bool = False
    truncated: bool = False
    timed_out: bool = False
    final_answer: str | None = None
    finish_reasons: list[str] = field(default_factory=list)
    metadata: dict[str, Any] = field(default_factory=dict)  # an environment's own report (agents: calls, segments)
    pending_infra: _Infra | None = None  # a driven episode that failed after its tokens were recorded
    step_rewards: list[float | None] = field(default_factory=list)  # per step: the env's ``step_reward``, if any
    judged: tuple[float, float] | None = None  # the verifier's (start, end) on the monotonic clock
    # when the episode's time is up (monotonic); each turn's wait for the engine moves it on by as much
    deadline: float = float("inf")


async def rollout_episode(
    policy: Any,
    task: Task,
    tokenizer: Any,
    sampling: SamplingParams,
    sandbox: Any = None,
    *,
    max_context_tokens: int | None = None,
    group_id: str = "",
    parser: Any = None,
    template_kwargs: dict[str, Any] | None = None,
    infra_retries: int = 0,
    renderer: PromptRenderer | None = None,
) -> Trajectory:
    """Run one episode of `task` with `policy` and return its verified, token-exact trajectory.

    `policy` is an async policy (``await policy.generate(request, sampling) -> list[Completion]``) or a sync
    `InferenceEngine`. An infrastructure failure is retried up to `infra_retries` times; the count of attempts
    is in ``metadata["attempts"]``. With a `renderer` (a vision-language model's processor,
    `posttrain.envs.tokens.PromptRenderer`) the prompt may hold images: its ids and image tensors are the
    renderer's, every turn's request carries the tensors and the trajectory keeps them (``image_inputs``).
    """
    policy = as_policy(policy)
    for attempt in range(infra_retries + 1):
        trajectory = await _run_episode(policy, task, tokenizer, sampling, sandbox, max_context_tokens,
                                        parser, template_kwargs, renderer)
        trajectory.group_id = group_id
        trajectory.metadata["attempts"] = attempt + 1
        if not trajectory.reward.is_infrastructure_failure:
            break
        log.warning("episode of task %s: %s (attempt %d)", task.id, trajectory.reward.details.get("error"),
                    attempt + 1)
    return trajectory


async def rollout_group(policy: Any, task: Task, tokenizer: Any, sampling: SamplingParams, n: int,
                        sandbox: Any = None, **kwargs: Any) -> list[Trajectory]:
    """`n` concurrent episodes of one task sharing a ``group_id`` (a seeded `sampling` gets seed + i)."""
    policy = as_policy(policy)
    group_id = kwargs.pop("group_id", None) or f"{task.id}#{next(_CALLS)}"
    episodes = [
        _announced(policy, rollout_episode(policy, task, tokenizer, _member_sampling(sampling, i), sandbox,
                                           group_id=group_id, **kwargs))
        for i in range(n)
    ]
    return list(await asyncio.gather(*episodes))


async def rollout_many(policy: Any, tasks: Sequence[Task], tokenizer: Any, sampling: SamplingParams, n: int = 1,
                       sandbox: Any = None, max_concurrency: int | None = None, **kwargs: Any) -> list[Trajectory]:
    """`n` episodes of every task, all in one event loop; results in task order, each group contiguous.

    `max_concurrency` bounds the episodes in flight (default: all at once, the engine batching them).
    """
    policy = as_policy(policy)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None

    async def one(task: Task, index: int, group_id: str) -> Trajectory:
        member = _member_sampling(sampling, index)
        episode = _announced(policy, rollout_episode(policy, task, tokenizer, member, sandbox, group_id=group_id,
                                                     **kwargs))
        if limit is None:
            return await episode
        async with limit:
            return await episode

    call = next(_CALLS)
    jobs = [one(task, i, f"{task.id}#{call}:{t}") for t, task in enumerate(tasks) for i in range(n)]
    return list(await asyncio.gather(*jobs))


async def _announced(policy: Any, episode: Coroutine[Any, Any, Trajectory]) -> Trajectory:
    """Run `episode` announced to the policy (`AsyncBatcher.client`: it batches without waiting when every
    announced episode waits on it), or just run it when the policy takes no announcement."""
    announce = getattr(policy, "client", None)
    with announce() if callable(announce) else nullcontext():
        return await episode


def run_episodes(policy: Any, tasks: Sequence[Task], tokenizer: Any, sampling: SamplingParams, n: int = 1,
                 **kwargs: Any) -> list[Trajectory]:
    """`rollout_many` from synchronous code (starts and closes its own event loop)."""
    return asyncio.run(rollout_many(policy, tasks, tokenizer, sampling, n=n, **kwargs))


def rollout_stats(trajectories: Iterable[Trajectory]) -> dict[str, Any]:
    """Counts a pipeline logs per batch: episodes, infrastructure failures, failure classes, process totals."""
    trajectories = list(trajectories)
    failures = Counter(t.reward.failure.value for t in trajectories)
    return {
        "episodes": len(trajectories),
        "infra_failures": sum(t.reward.is_infrastructure_failure for t in trajectories),
        "passed": sum(t.reward.passed for t in trajectories),
        "truncated": sum(t.truncated for t in trajectories),
        "failures": dict(failures),
        "steps": sum(t.steps for t in trajectories),
        "tool_calls": sum(t.tool_calls for t in trajectories),
        "tool_calls_ok": sum(t.tool_calls_ok for t in trajectories),
        "policy_tokens": sum(t.policy_tokens for t in trajectories),
        "observation_tokens": sum(t.observation_tokens for t in trajectories),
    }


def judging_wall_seconds(trajectories: Iterable[Trajectory]) -> float:
    """Wall seconds during which at least one of `trajectories` was being judged (the union of their verifier
    windows: concurrent judgements count once), for the share of a step spent waiting on verifiers."""
    windows = sorted(tuple(t.metadata["judge_window"]) for t in trajectories if t.metadata.get("judge_window"))
    total, end = 0.0, float("-inf")
    for start, stop in windows:
        if stop > end:
            total += stop - max(start, end)
            end = stop
    return total


# --------------------------------------------------------------------------------------------------
# One attempt
# --------------------------------------------------------------------------------------------------


async def _run_episode(policy, task, tokenizer, sampling, sandbox, max_context_tokens, parser, template_kwargs,
                       renderer):
    started = time.monotonic()
    episode = _Episode(deadline=started + float(task.timeout_s))
    tokens: TranscriptTokens | None = None
    failure: _Infra | None = None
    reward: Reward | None = None
    try:
        env = make_environment(task, sandbox=sandbox, **({"parser": parser} if parser is not None else {}))
        observation = await env.reset(task)
        if callable(getattr(env, "drive", None)):  # a black-box agent: it calls the policy, not the loop
            tokens = await _driven(env, policy, task, tokenizer, sampling, episode,
                                   _context_limit(max_context_tokens, tokenizer), template_kwargs)
        else:
            tokens = TranscriptTokens(tokenizer, observation.messages, observation.tools, template_kwargs, renderer)
            await _loop(policy, env, task, tokens, sampling, episode, _context_limit(max_context_tokens, tokenizer))
        if episode.pending_infra is not None:
            raise episode.pending_infra
        final_state = {**env.final_state(), "messages": tokens.messages, "trajectory_steps": episode.steps}
        judging = time.monotonic()
        reward = await _verify(task, final_state)
        episode.judged = (judging, time.monotonic())
    except _Infra as error:
        failure = error
    except ToolInfraError as error:
        failure = _Infra(FailureClass(error.failure) if error.failure in {"sandbox_failure", "infra"}
                         else FailureClass.SANDBOX, f"tool: {error}")
    except Exception as error:  # a bug or a crash of the env/verifier: the system's fault, never the model's 0
        log.exception("episode of task %s crashed", task.id)
        failure = _Infra(FailureClass.INFRA, f"{type(error).__name__}: {error}")
    if failure is not None:
        reward = Reward(score=0.0, passed=False, failure=failure.failure, details={"error": str(failure)})
    assert reward is not None
    reward = _classify(reward, episode, task)
    return _trajectory(task, tokens, reward, episode, time.monotonic() - started)


async def _loop(policy, env, task, tokens, sampling, episode, context_limit):
    for turn in range(max(1, task.max_steps)):
        room = context_limit - len(tokens.token_ids) if context_limit else sampling.max_new_tokens
        if room <= 0:
            episode.truncated = True
            return
        request = GenerationRequest(prompt_token_ids=list(tokens.token_ids), request_id=f"{task.id}:{turn}",
                                    image_inputs=tokens.image_inputs)
        if time.monotonic() >= episode.deadline:
            episode.timed_out = True
            return
        cap = min(sampling.max_new_tokens, room)
        completion = await _generation(policy, request, turn_sampling(sampling, turn, cap), episode)
        episode.steps += 1
        episode.finish_reasons.append(completion.finish_reason)
        text = strip_eos(completion.text, tokens.tokenizer)
        action = Action(text=text, finish_reason=completion.finish_reason)
        result = await _bounded(env.step(action), episode)
        if result is None:
            # Out of time while the env worked: keep the turn's tokens, recorded as the model wrote them.
            tokens.add_policy_turn(completion, {"role": "assistant", "content": action.text})
            return
        tokens.add_policy_turn(completion, result.info.get("assistant_message")
                               or {"role": "assistant", "content": action.text})
        episode.tool_calls += int(result.info.get("tool_calls", 0))
        episode.tool_calls_ok += int(result.info.get("tool_calls_ok", 0))
        episode.last_step_failed = bool(result.info.get("failed", False))
        episode.failed_steps += episode.last_step_failed
        step_reward = result.info.get("step_reward")
        episode.step_rewards.append(None if step_reward is None else float(step_reward))
        if "final_answer" in result.info:
            episode.final_answer = result.info["final_answer"]
        if action.truncated:
            episode.truncated = True
            return
        if result.done:
            return
        tokens.add_observation(result.observation.messages)  # a full context is caught at the next turn


async def _driven(env, policy, task, tokenizer, sampling, episode, context_limit, template_kwargs):
    """An environment that drives the policy itself (`posttrain.envs.agent`): its recorded tokens and counts.
    (The agent program runs against the episode's whole wall time, its calls to the engine included.)"""
    driven = await env.drive(policy, task, tokenizer, sampling, deadline=episode.deadline,
                             max_context_tokens=context_limit,
                             template_kwargs=template_kwargs)
    episode.steps, episode.truncated, episode.timed_out = driven.steps, driven.truncated, driven.timed_out
    episode.final_answer, episode.finish_reasons = driven.final_answer, list(driven.finish_reasons)
    episode.metadata.update(driven.metadata)
    if driven.infra is not None:
        episode.pending_infra = _Infra(FailureClass(driven.infra[0]), driven.infra[1])
    return driven.tokens


async def _generate(policy, request, sampling):
    try:
        completions = await policy.generate(request, sampling)
    except Exception as error:  # (the episode's own deadline cancels this coroutine: CancelledError, not caught)
        raise _Infra(FailureClass.INFRA, f"engine: {type(error).__name__}: {error}") from error
    if not completions:
        raise _Infra(FailureClass.INFRA, "engine returned no completion")
    return completions[0]


async def _generation(policy, request, sampling, episode):
    """One turn from the engine. Its wall time (queueing included) moves the episode's deadline on by as much: the
    task's timeout bounds what the environment does, a turn is bounded by its tokens."""
    waited = time.monotonic()
    try:
        completion = await asyncio.wait_for(_generate(policy, request, sampling), ENGINE_WAIT_S)
    except asyncio.TimeoutError:
        raise _Infra(FailureClass.INFRA, f"the engine returned no completion within {ENGINE_WAIT_S:.0f} s") from None
    episode.deadline += time.monotonic() - waited
    return completion


async def _bounded(awaitable, episode):
    """`awaitable`'s result, or None (and `timed_out`) once the episode's wall time is spent."""
    deadline = episode.deadline
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        episode.timed_out = True
        if asyncio.iscoroutine(awaitable):
            awaitable.close()
        return None
    try:
        return await asyncio.wait_for(awaitable, remaining)
    except asyncio.TimeoutError:
        if time.monotonic() < deadline - 0.01:  # raised inside the engine or env, not by our deadline
            raise _Infra(FailureClass.INFRA, "a timeout inside the engine or the environment") from None
        episode.timed_out = True
        return None


async def _verify(task: Task, final_state: dict[str, Any]) -> Reward:
    from posttrain.envs.judging import judge

    return await judge(task, final_state)


def _classify(reward: Reward, episode: _Episode, task: Task) -> Reward:
    reward.details.setdefault("steps", episode.steps)
    step_cost = float(task.env_args.get("step_cost", 0.0) or 0.0)
    if step_cost:
        # Same convention as the RL return (`posttrain.rl.advantages.episode_return`): the first step is free.
        reward.components["step_cost"] = -step_cost * max(0, episode.steps - 1)
    process = process_reward(episode.step_rewards)
    if process is not None and not reward.is_infrastructure_failure:
        reward.components.setdefault("process", process)
        reward.details.setdefault("step_rewards", list(episode.step_rewards))
    if reward.is_infrastructure_failure or reward.passed:
        if reward.passed:
            reward.failure = FailureClass.NONE
        return reward
    failed_tools = episode.tool_calls > episode.tool_calls_ok
    if episode.truncated:
        reward.failure = FailureClass.TRUNCATED
    elif episode.timed_out:
        reward.failure = FailureClass.TIMEOUT
    elif failed_tools and (episode.final_answer is None or episode.last_step_failed or not episode.tool_calls_ok):
        reward.failure = FailureClass.TOOL_ERROR
    elif reward.failure == FailureClass.NONE:
        reward.failure = FailureClass.WRONG_ANSWER
    return reward


def process_reward(step_rewards: Sequence[float | None]) -> float | None:
    """The episode's process reward: the mean of the step rewards its steps reported (None when none did)."""
    reported = [r for r in step_rewards if r is not None]
    return sum(reported) / len(reported) if reported else None


def _trajectory(task: Task, tokens: TranscriptTokens | None, reward: Reward, episode: _Episode,
                wall_s: float) -> Trajectory:
    if tokens is None:  # failed before the prompt was tokenized
        ids, mask, logprobs, versions, prompt_length, messages = [], [], [], [], 0, list(task.messages)
    else:
        ids, mask = tokens.token_ids, tokens.loss_mask
        logprobs, versions = tokens.behaviour_logprobs, tokens.policy_versions
        prompt_length, messages = tokens.prompt_length, tokens.messages
    metadata: dict[str, Any] = {
        "final_answer": episode.final_answer,
        "timed_out": episode.timed_out,
        "finish_reasons": episode.finish_reasons,
        "split": task.metadata.get("split"),
    }
    if episode.metadata:
        metadata["agent"] = dict(episode.metadata)
    if episode.judged is not None:
        # How long the verifier (a sandbox, for code) took, and when on this process's monotonic clock: a batch's
        # judging wall time is the union of its episodes' windows (`posttrain.envs.judging_wall_seconds`).
        metadata["judge_s"] = episode.judged[1] - episode.judged[0]
        metadata["judge_window"] = list(episode.judged)
    if reward.is_infrastructure_failure:
        # Belt and braces: a trainer that forgets to mask infrastructure failures still trains on nothing.
        metadata["policy_tokens_before_masking"] = sum(mask)
        mask = [0] * len(mask)
    return Trajectory(
        task_id=task.id,
        domain=task.domain,
        token_ids=list(ids),
        loss_mask=list(mask),
        behaviour_logprobs=list(logprobs),
        policy_versions=list(versions),
        prompt_length=prompt_length,
        reward=reward,
        messages=[dict(m) for m in messages],
        difficulty=task.difficulty,
        steps=episode.steps,
        tool_calls=episode.tool_calls,
        tool_calls_ok=episode.tool_calls_ok,
        failed_steps=episode.failed_steps,
        truncated=episode.truncated,
        wall_s=wall_s,
        metadata=metadata,
        image_inputs=getattr(tokens, "image_inputs", None),
    )


def trajectory_segments(trajectory: Trajectory) -> list[Trajectory]:
    """The episode's causal token sequences, one trajectory each, for the trainer.

    An episode is one sequence, except a black-box agent's whose calls did not extend one transcript (it edited,
    truncated or summarised its history: `posttrain.envs.agent_endpoint`). Its trajectory is the last segment;
    the earlier ones are kept token-exact in ``metadata["agent"]["earlier_segments"]``. Here each earlier segment
    becomes a trajectory of its own -- its own sampled ids, behaviour logprobs and policy versions, and the
    episode's reward, group and task -- followed by the episode's own (last) one, so every token the policy
    sampled is trained on with the episode's advantage. Advantages are computed per episode first (a group counts
    each episode once); the trainer then repeats an episode's advantage on each of its segments.
    An infrastructure failure trains on nothing: it is returned alone (its mask is zeroed).
    """
    earlier = (trajectory.metadata.get("agent") or {}).get("earlier_segments") or []
    if not earlier or trajectory.reward.is_infrastructure_failure:
        return [trajectory]
    count = len(earlier) + 1
    pieces = []
    for index, segment in enumerate(earlier):
        pieces.append(dataclasses.replace(
            trajectory, token_ids=list(segment["token_ids"]), loss_mask=list(segment["loss_mask"]),
            behaviour_logprobs=list(segment["behaviour_logprobs"]),
            policy_versions=list(segment["policy_versions"]), prompt_length=int(segment["prompt_length"]),
            messages=[dict(m) for m in segment.get("messages") or []], steps=int(segment.get("calls", 0)),
            metadata={"segment": index, "segments": count, "split": trajectory.metadata.get("split")}))
    last_steps = trajectory.steps - sum(piece.steps for piece in pieces)
    pieces.append(dataclasses.replace(trajectory, steps=max(0, last_steps),
                                      metadata={**trajectory.metadata, "segment": count - 1, "segments": count}))
    return pieces


def oldest_policy_version(trajectory: Trajectory) -> int:
    """The oldest policy version any token the episode sampled came from: every segment's (`trajectory_segments`),
    not only the trajectory's own sequence, so an agent's earlier segment sampled before a weight update counts
    in the episode's staleness. -1 when it sampled nothing (an infrastructure failure's tokens are masked)."""
    versions = [version for segment in trajectory_segments(trajectory)
                for version, sampled in zip(segment.policy_versions, segment.loss_mask) if sampled]
    return min(versions) if versions else -1


def episode_policy_tokens(trajectory: Trajectory) -> int:
    """The tokens the policy sampled in the whole episode: every segment's (`trajectory_segments`), so a black-box
    agent's earlier segments count in its token cost and its metrics as they do in training."""
    return sum(segment.policy_tokens for segment in trajectory_segments(trajectory))


def _member_sampling(sampling: SamplingParams, index: int) -> SamplingParams:
    if sampling.seed is None or index == 0:
        return sampling
    return dataclasses.replace(sampling, seed=sampling.seed + index)


def _context_limit(max_context_tokens: int | None, tokenizer: Any) -> int | None:
    if max_context_tokens:
        return int(max_context_tokens)
    limit = getattr(tokenizer, "model_max_length", None)
    return int(limit) if isinstance(limit, int) and 0 < limit < 1_000_000 else None
