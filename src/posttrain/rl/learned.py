"""The models learned beside the verifiers: a reward model and a process reward model, parts of the RL return, and
PPO's critic, the values GAE needs. All three are scalar-head models of the reward-model format (`posttrain rm`,
or any one-label `AutoModelForSequenceClassification`), loaded by `load_scorer`, which checks that their token ids
mean what the policy's mean.

**The reward model** (the recipe's `reward_model:`, `LearnedReward`), beside the verifiers:

    return = outcome (the verifier's score) + weight * r_RM(token ids) + the other parts of `rl.advantages`

The reward model scores exactly the token ids the policy saw and produced — `Trajectory.token_ids`, the prompt,
the completion and (agentic episodes) the observations between turns, never re-tokenized text — at the last
token. Only trajectories that reach the trainer are scored: infrastructure failures stay masked (never scored),
and groups the producer dropped are not trained on. Scoring runs on the trainer's side, a batched forward
without gradients, so the reward model takes no part in rollouts.

The verifier's score stays the episode's score (pass rates, the curriculum and the guard read it); the learned
part is reported beside it: ``reward/verifier`` and ``reward/learned`` (mean raw, normalised score over the scored
trajectories), ``return/learned`` (weighted), and ``learned_reward`` in each scored episode's record.

**The process reward model** (the recipe's `process_reward_model:`, `ProcessRewardModel`) is the same kind of model
used per step: it scores each policy turn of a trajectory -- the token ids from the start up to the last token of
that turn -- and the mean over the turns becomes the reward's ``process`` component (the per-turn scores in
``details["step_scores"]``), in place of the environment's step rewards; ``returns.process_weight`` weighs it into
the return (`rl.advantages`).

**PPO's critic** (`algorithm.advantage: gae`, `Critic`): a value model, its own optimizer, its checkpoint. It is a
causal LM trunk with a scalar head read at every position (`ScalarRewardModel.token_values`): the value of the
state before policy token t+1 is read at position t, where the policy's logits for that token are read too.
Observation tokens of agentic episodes are context only: no value is read before them and they carry no value
target (`rl.advantages` defines the chain GAE runs over). It starts as a copy of the policy with a value head at 0
(every value 0: the first advantages are the plain returns), or from a reward model (`critic.path`: its trunk and
head, the head then read at every token).

One batch: `values` (no gradient) before any update -> GAE -> the policy update and `Critic.update`, which
regresses the values on the GAE targets with the clipped value loss (`train.policy_loss.clipped_value_loss`) in
the same mini-batches and micro-batches as the policy (`train.updates_per_batch`, `train.micro_batch_size`); the
loss is the token mean over each mini-batch, times `critic.value_coef`.

Checkpoints: the critic's weights go into ``critic/`` inside the policy's checkpoint directory (the reward-model
format, loadable by `load_reward_model`), its optimizer and LR schedule into the training state under
``"critic"``; the finished critic into ``<output_dir>/critic``. The critic trains in the process that runs the RL
loop (under `posttrain.distributed`: the driver), unsharded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

import torch

from posttrain.config import ConfigError, ProcessRewardModelConfig, RewardModelConfig, RLRecipe
from posttrain.models import (
    ModelError,
    RewardModel,
    ScalarRewardModel,
    disable_dropout,
    load_reward_model,
    save_reward_model,
)
from posttrain.rl.update import Optimization, collate_trajectories, mini_batches, plain_copy
from posttrain.train import Runtime, clipped_value_loss
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


# ---- PPO's critic -------------------------------------------------------------------------------------------------

CRITIC_DIR = "critic"


class Critic:
    def __init__(self, model: ScalarRewardModel, tokenizer, runtime: Runtime, recipe: RLRecipe):
        self.model, self.tokenizer, self.runtime, self.recipe = model, tokenizer, runtime, recipe
        self.config = recipe.critic
        self.optimization = Optimization(model, self.config.optim,
                                         recipe.train.max_steps * recipe.train.updates_per_batch)

    def set_lr_scale(self, scale: float) -> None:
        """The guard's rollbacks lower the critic's learning rate with the policy's."""
        self.optimization.set_lr_scale(scale)

    @torch.no_grad()
    def values(self, trajectories: Sequence[Trajectory]) -> list[torch.Tensor]:
        """Each trajectory's values before its policy tokens, in order (fp32, on the CPU)."""
        values: list[torch.Tensor] = []
        size = self.recipe.train.micro_batch_size
        for start in range(0, len(trajectories), size):
            chunk = trajectories[start : start + size]
            micro = collate_trajectories(chunk, [0.0] * len(chunk), self.tokenizer.pad_token_id, self.runtime.device)
            with self.runtime.autocast():
                flat = self.model.token_values(micro.input_ids, micro.score_mask).float().cpu()
            rows = micro.seq_index.cpu()
            values += [flat[rows == row] for row in range(len(chunk))]
        return values

    def update(self, trajectories: Sequence[Trajectory], old_values: Sequence[torch.Tensor],
               targets: Sequence[torch.Tensor]) -> dict[str, float]:
        """Regress the values on `targets` (one optimizer step per mini-batch); ``critic/*`` metrics."""
        if not trajectories:
            return {}
        self.model.train()
        totals: dict[str, float] = {}
        minis = [mini for mini in mini_batches(trajectories, self.recipe.train.updates_per_batch) if mini]
        for mini in minis:
            stats = self._accumulate(trajectories, old_values, targets, mini)
            stats["grad_norm"] = self.optimization.step(self.model)
            for key, value in stats.items():
                totals[key] = totals.get(key, 0.0) + value / len(minis)
        metrics = {f"critic/{key}": value for key, value in totals.items()}
        metrics.update(_value_statistics(torch.cat(list(old_values)), torch.cat(list(targets))))
        metrics["critic/lr"] = self.optimization.lr
        return metrics

    def _accumulate(self, trajectories, old_values, targets, mini: list[int]) -> dict[str, float]:
        """Forward/backward the micro-batches of one mini-batch; the caller takes the optimizer step."""
        total_tokens = max(sum(trajectories[i].policy_tokens for i in mini), 1)
        size = self.recipe.train.micro_batch_size
        loss_total, clipped_tokens = 0.0, 0.0
        for start in range(0, len(mini), size):
            chunk = mini[start : start + size]
            micro = collate_trajectories([trajectories[i] for i in chunk], [0.0] * len(chunk),
                                         self.tokenizer.pad_token_id, self.runtime.device)
            with self.runtime.autocast():
                predicted = self.model.token_values(micro.input_ids, micro.score_mask)
            old = torch.cat([old_values[i] for i in chunk]).to(predicted.device)
            target = torch.cat([targets[i] for i in chunk]).to(predicted.device)
            per_token, stats = clipped_value_loss(predicted, old, target, self.config.value_clip)
            loss = self.config.value_coef * per_token.sum() / total_tokens
            loss.backward()
            loss_total += float(loss.detach())
            clipped_tokens += stats["value_clip_fraction"] * per_token.numel()
        return {"value_loss": loss_total, "value_clip_fraction": clipped_tokens / total_tokens}

    # ---- checkpoints ----------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        return self.optimization.state_dict()

    def save(self, directory: Path) -> Path:
        """The critic's weights as a reward-model directory (`load_reward_model` reads it)."""
        return save_reward_model(Path(directory), self.model, self.tokenizer)

    def save_into_checkpoint(self, checkpoint: Path) -> None:
        self.save(Path(checkpoint) / CRITIC_DIR)

    def load_checkpoint(self, checkpoint: Path, state: dict[str, Any]) -> None:
        """The weights (copied in place: the optimizer's references stay valid), the optimizer and schedule."""
        directory = Path(checkpoint) / CRITIC_DIR
        if "critic" not in state or not directory.is_dir():
            raise ModelError(f"{checkpoint}: no critic in this checkpoint (was the run started without "
                             "algorithm.advantage: gae?): resume it with the recipe it was started with")
        saved = load_scorer(directory, self.tokenizer, torch.device("cpu"), key="critic")
        target = self.model.state_dict()
        with torch.no_grad():
            for name, tensor in saved.model.state_dict().items():
                target[name].copy_(tensor)
        self.optimization.load_state_dict(state["critic"])


def make_critic(recipe: RLRecipe, policy: torch.nn.Module, tokenizer, runtime: Runtime) -> Critic:
    """The critic a recipe asks for: from `critic.path` (a reward model), or a copy of the starting policy."""
    if recipe.critic.path is not None:
        model = load_scorer(recipe.critic.path, tokenizer, runtime.device, key="critic.path").model
    else:
        trunk = plain_copy(policy)
        head = torch.nn.Linear(trunk.config.hidden_size, 1, bias=False)
        torch.nn.init.zeros_(head.weight)
        model = ScalarRewardModel.from_causal_lm(trunk.to(runtime.device), head)
    disable_dropout(model)
    for parameter in model.parameters():
        parameter.requires_grad_(True)
    return Critic(model.train(), tokenizer, runtime, recipe)


def _value_statistics(values: torch.Tensor, targets: torch.Tensor) -> dict[str, float]:
    """How well the values the advantages used predicted their targets (1 = perfectly, 0 = no better than
    their mean)."""
    variance = float(targets.var(unbiased=False)) if targets.numel() > 1 else 0.0
    explained = 1.0 - float((targets - values).var(unbiased=False)) / variance if variance > 0 else 0.0
    return {"critic/value_mean": float(values.mean()), "critic/target_mean": float(targets.mean()),
            "critic/explained_variance": explained}
