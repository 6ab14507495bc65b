"""A learned reward component of the RL return: a reward model (`posttrain rm`, or any one-label
`AutoModelForSequenceClassification`) beside the verifiers.

    return = outcome (the verifier's score) + weight * r_RM(token ids) + the other parts of `rl.advantages`

The reward model scores exactly the token ids the policy saw and produced — `Trajectory.token_ids`, the prompt,
the completion and (agentic episodes) the observations between turns, never re-tokenized text — at the last
token. Only trajectories that reach the trainer are scored: infrastructure failures stay masked (never scored),
and groups the producer dropped are not trained on. Scoring runs on the trainer's side, a batched forward
without gradients, so the reward model takes no part in rollouts.

The verifier's score stays the episode's score (pass rates, the curriculum and the guard read it); the learned
part is reported beside it: ``reward/verifier`` and ``reward/learned`` (mean raw, normalised score over the scored
trajectories), ``return/learned`` (weighted), and ``learned_reward`` in each scored episode's record.

`ProcessRewardModel` (the recipe's `process_reward_model:`) is the same kind of model used per step: it scores each
policy turn of a trajectory -- the token ids from the start up to the last token of that turn -- and the mean over
the turns becomes the reward's ``process`` component (the per-turn scores in ``details["step_scores"]``), in place
of the environment's step rewards; ``returns.process_weight`` weighs it into the return (`rl.advantages`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

from posttrain.config import ConfigError, ProcessRewardModelConfig, RewardModelConfig
from posttrain.models import RewardModel, load_reward_model
from posttrain.types import Trajectory

LEARNED_REWARD_KEY = "learned_reward"  # in Trajectory.metadata and the episode record: the (normalised) score


def load_scorer(path: str | Path, tokenizer: Any, device: torch.device, *, key: str, normalize: bool = False,
                batch_size: int = 32) -> RewardModel:
    """A saved reward model whose token ids mean what the policy's mean (else the scores are of other text)."""
    model = load_reward_model(path, device=device, normalize=normalize, batch_size=batch_size)
    if model.tokenizer.get_vocab() != tokenizer.get_vocab():
        raise ConfigError(f"{key}: {path} was trained with another tokenizer than the policy's: it would score "
                          "other text than the policy wrote (train the reward model from the policy's tokenizer)")
    return model


class LearnedReward:
    """The recipe's `reward_model:` section, loaded: scores trajectories and notes the score on each."""

    def __init__(self, config: RewardModelConfig, tokenizer: Any, device: torch.device):
        self.config = config
        self.model = load_scorer(config.path, tokenizer, device, key="reward_model.path",
                                 normalize=config.normalize, batch_size=config.batch_size)

    def annotate(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        """Score `trajectories` (the batch's trainable ones), keep each score in its metadata; the metrics."""
        if not trajectories:
            return {}
        scores = self.model.score_ids([list(t.token_ids) for t in trajectories])
        for trajectory, score in zip(trajectories, scores):
            trajectory.metadata[LEARNED_REWARD_KEY] = score
        return {"reward/verifier": sum(t.reward.score for t in trajectories) / len(trajectories),
                "reward/learned": sum(scores) / len(scores)}

    def weighted(self, trajectory: Trajectory) -> float | None:
        """The return's learned part of a scored trajectory (None if it was not scored)."""
        score = trajectory.metadata.get(LEARNED_REWARD_KEY)
        return None if score is None else self.config.weight * float(score)


def turn_ends(loss_mask: Sequence[int]) -> list[int]:
    """The exclusive end of every run of policy tokens (one per policy turn), in order."""
    return [i + 1 for i, flag in enumerate(loss_mask) if flag and (i + 1 == len(loss_mask) or not loss_mask[i + 1])]


class ProcessRewardModel:
    """The recipe's `process_reward_model:` section, loaded: scores each policy turn, sets the process component."""

    def __init__(self, config: ProcessRewardModelConfig, tokenizer: Any, device: torch.device):
        self.config = config
        self.model = load_scorer(config.path, tokenizer, device, key="process_reward_model.path",
                                 normalize=config.normalize, batch_size=config.batch_size)

    def annotate(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        prefixes, owners = [], []
        for index, trajectory in enumerate(trajectories):
            for end in turn_ends(trajectory.loss_mask):
                prefixes.append(list(trajectory.token_ids[:end]))
                owners.append(index)
        if not prefixes:
            return {}
        scores = self.model.score_ids(prefixes)
        per_trajectory: dict[int, list[float]] = {}
        for owner, score in zip(owners, scores):
            per_trajectory.setdefault(owner, []).append(float(score))
        for index, step_scores in per_trajectory.items():
            reward = trajectories[index].reward
            reward.components["process"] = sum(step_scores) / len(step_scores)
            reward.details["step_scores"] = step_scores
        return {"reward/process_model": sum(scores) / len(scores)}
