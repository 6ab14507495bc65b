"""PPO's learned critic (`algorithm.advantage: gae`): a value model, its own optimizer, its checkpoint.

The critic is a causal LM trunk with a scalar head read at every position (`ScalarRewardModel.token_values`):
the value of the state before policy token t+1 is read at position t, where the policy's logits for that token
are read too. Observation tokens of agentic episodes are context only: no value is read before them and they
carry no value target (`rl.advantages` defines the chain GAE runs over). It starts as a copy of the policy with
a value head at 0 (every value 0: the first advantages are the plain returns), or from a reward model saved by
`posttrain rm` or any `AutoModelForSequenceClassification` with one label (`critic.path`: its trunk and head, the
head then read at every token).

One batch: `values` (no gradient) before any update -> GAE -> the policy update and `update` here, which regresses
the values on the GAE targets with the clipped value loss (`train.policy_loss.clipped_value_loss`) in the
same mini-batches and micro-batches as the policy (`train.updates_per_batch`, `train.micro_batch_size`); the
loss is the token mean over each mini-batch, times `critic.value_coef`.

Checkpoints: the critic's weights go into ``critic/`` inside the policy's checkpoint directory (the reward-model
format: an `AutoModelForSequenceClassification` directory, loadable by `load_reward_model`), its optimizer and LR
schedule into the training state under ``"critic"``; the finished critic into ``<output_dir>/critic``. The
critic trains in the process that runs the RL loop (under `posttrain.distributed`: the driver), unsharded.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Sequence

import torch

from posttrain.config import RLRecipe
from posttrain.models import (
    ModelError,
    ScalarRewardModel,
    disable_dropout,
    is_lora,
    merged_copy,
    save_reward_model,
)
from posttrain.rl.learned_reward import load_scorer
from posttrain.rl.update import collate_trajectories, mini_batches, set_lr_scale
from posttrain.train import (
    Runtime,
    build_optimizer,
    build_scheduler,
    clipped_value_loss,
    load_optimizer_state,
    optimizer_step,
)
from posttrain.types import Trajectory

CRITIC_DIR = "critic"


class Critic:
    def __init__(self, model: ScalarRewardModel, tokenizer, runtime: Runtime, recipe: RLRecipe):
        self.model, self.tokenizer, self.runtime, self.recipe = model, tokenizer, runtime, recipe
        self.config = recipe.critic
        self.optimizer = build_optimizer(model, self.config.optim)
        self.scheduler = build_scheduler(self.optimizer, self.config.optim,
                                         recipe.train.max_steps * recipe.train.updates_per_batch)
        self.base_lrs = list(self.scheduler.base_lrs)

    def set_lr_scale(self, scale: float) -> None:
        """The guard's rollbacks lower the critic's learning rate with the policy's."""
        set_lr_scale(self.optimizer, self.scheduler, self.base_lrs, scale)

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
            stats["grad_norm"] = optimizer_step(self.model, self.optimizer, self.scheduler,
                                                self.config.optim.max_grad_norm)
            for key, value in stats.items():
                totals[key] = totals.get(key, 0.0) + value / len(minis)
        metrics = {f"critic/{key}": value for key, value in totals.items()}
        metrics.update(_value_statistics(torch.cat(list(old_values)), torch.cat(list(targets))))
        metrics["critic/lr"] = self.scheduler.get_last_lr()[0]
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
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

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
        load_optimizer_state(self.optimizer, state["critic"]["optimizer"])
        self.scheduler.load_state_dict(state["critic"]["scheduler"])


def make_critic(recipe: RLRecipe, policy: torch.nn.Module, tokenizer, runtime: Runtime) -> Critic:
    """The critic a recipe asks for: from `critic.path` (a reward model), or a copy of the starting policy."""
    if recipe.critic.path is not None:
        model = load_scorer(recipe.critic.path, tokenizer, runtime.device, key="critic.path").model
    else:
        trunk = merged_copy(policy) if is_lora(policy) else copy.deepcopy(policy)
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
