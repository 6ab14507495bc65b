"""The RL update: trajectories with advantages -> clipped policy-gradient step(s) -> statistics; and the policy
that takes it (`PolicyTrainer`: `LocalPolicy` in this process, an FSDP trainer group in `posttrain.distributed`).

`LocalPolicy.update` is one batch's update: the replay SFT loss the forgetting guard asks for
(`replay_sft_backward`: its gradient is accumulated first, so the RL update's optimizer step takes both), then
`rl_update`. A data-parallel rank of `posttrain.distributed` runs the same `LocalPolicy` over its sharded model.
Also here: the weights the engines get after an update (`engine_state`: the merged weights of a LoRA policy), the
reference policy for the KL term (`make_reference`: the adapter switched off under LoRA, a frozen copy otherwise)
and the optimizer with the learning-rate scale a rollback leaves (`Optimization`).

The trainer scores exactly the token ids the engine sampled (`Trajectory.token_ids`, never re-tokenized):
position t is scored when token t+1 is a policy token (`loss_mask[t+1] == 1`); observation tokens of
agentic episodes are context only. The same forward that computes the loss also measures, for free, the
gap between the engine's behaviour log-probs and the trainer's log-probs of the same tokens.

An advantage is one number per trajectory (group-relative estimators: repeated on each of its policy tokens) or
a sequence with one number per policy token, in order (PPO with a critic: `rl.advantages.gae_advantages`).

What an update does is one typed object, `UpdateSettings` (the loss, precision, padding, temperature, batch
sizes, clipping), built once from the recipe (`UpdateSettings.of(recipe, runtime, pad_id)`).

A batch may be split into `updates_per_batch` optimizer steps (PPO-style mini-batches); sequences of one
mini-batch are further split into micro-batches for memory, with the loss scaled so their gradients sum
to the mini-batch's.

Sequences with an advantage of exactly 0 are left out of the forward and backward
(`algorithm.skip_zero_advantage`, on by default; `zero_advantage_skips` says when): with A = 0 both branches of
the clipped surrogate are 0 whatever the ratio, so such a sequence adds exactly zero to every gradient -- unless a
term that does not go through A touches it (the KL or the entropy term: the skip is off then). The normalizers
stay the whole mini-batch's (`token_mean`'s token count, `seq_mean`'s and `constant`'s sequence count), so the
gradient is the same up to float summation order. A mini-batch whose every sequence is skipped still runs its
shortest one (loss 0, zero gradients), so each parameter gets a zero gradient and the optimizer steps as it
would have (AdamW decays the weights and its moments on a zero gradient, and skips a parameter with none).
The step's `loss`, `pg_loss` and `clip_fraction` are unchanged (a skipped token adds 0 to each); the other
per-token statistics (`entropy`, `ratio_*`, the `gap_*` of engine vs trainer log-probs) are over the tokens that
went through the model. The exception: where the unskipped loss is not finite (a ratio overflowing to inf makes
0 x inf a NaN), the skipped step is finite.

The data-parallel seam is `posttrain.train.DataParallel`, the one SFT uses (`LOCAL` in one process): every rank
sees the whole batch and computes the same normalizers, backpropagates only its share of each mini-batch (the
gradients are summed across ranks), and the statistics are combined over the ranks, so they equal one process's.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Protocol, Sequence

import torch

from posttrain.chat import first_image_message
from posttrain.config import OptimConfig, PolicyLossConfig, RLRecipe
from posttrain.data import Row, SFTSample, collate, tokenize_samples
from posttrain.models import is_lora, load_weights_from_checkpoint, merged_copy, reference_mode
from posttrain.train import (
    DataParallel,
    LOCAL,
    SHARED_PREFIX_MAX_SEQUENCE,
    PeakMemory,
    Runtime,
    SharedPrefixBatch,
    TokenStats,
    aggregate,
    build_optimizer,
    build_scheduler,
    kl_penalty,
    load_optimizer_state,
    logprob_gap_stats,
    optimizer_step,
    per_token_policy_loss,
    prompt_end,
    scored_token_stats,
    sft_loss_sum,
    shared_prefix_batch,
    shared_prefix_token_stats,
    shared_prefix_unsupported,
    truncated_importance_weights,
)
from posttrain.types import Trajectory

log = logging.getLogger(__name__)

# (input_ids, attention_mask, score_mask, layout=None, **image_inputs) -> reference log-probs of the scored tokens, [N]
ReferenceFn = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class UpdateSettings:
    """Everything an RL update needs besides the model, its optimizer and the batch."""

    loss: PolicyLossConfig  # the recipe's `algorithm:` section: ratio, clipping, aggregation, KL, entropy
    runtime: Runtime  # device and autocast
    pad_id: int
    temperature: float  # the sampling temperature the log-probs are scored at (1 for greedy sampling)
    micro_batch_size: int  # sequences per forward/backward
    max_grad_norm: float | None
    normalizer: float | None = None  # the `constant` aggregation's divisor (the recipe: max_new_tokens)
    updates_per_batch: int = 1  # optimizer steps per batch (PPO mini-batches)
    shared_prefix: bool = False  # a group's sequences scored behind one copy of their prompt (train.shared_prefix)

    @classmethod
    def of(cls, recipe: RLRecipe, runtime: Runtime, pad_id: int) -> UpdateSettings:
        sampling = recipe.rollout.sampling
        return cls(loss=recipe.algorithm, runtime=runtime, pad_id=pad_id,
                   temperature=train_temperature(recipe),
                   micro_batch_size=recipe.train.micro_batch_size, max_grad_norm=recipe.optim.max_grad_norm,
                   normalizer=sampling.max_new_tokens, updates_per_batch=recipe.train.updates_per_batch,
                   shared_prefix=recipe.train.shared_prefix)


def train_temperature(recipe: RLRecipe) -> float:
    """The temperature the recipe's log-probs are scored at."""
    return scoring_temperature(recipe.rollout.sampling.temperature)


def scoring_temperature(sampling_temperature: float) -> float:
    """Log-probs are scored at the temperature the tokens were sampled at; greedy sampling (0) scores at 1."""
    return sampling_temperature if sampling_temperature > 0 else 1.0


class PolicyTrainer(Protocol):
    """Where the policy's weights are trained: `LocalPolicy` here, an FSDP trainer group in `posttrain.distributed`."""

    def update(self, trajectories: list[Trajectory], advantages: list[float] | list[list[float]], replay: list | None
               ) -> dict[str, float]:
        """One batch's optimizer step(s); metrics named as the run logs them (``train/*``, ``guard/replay_*``).
        An advantage per trajectory, or one per policy token of it (PPO with a critic; see `rl_update`)."""
        ...

    def weights(self, copy: bool = False) -> Any:
        """The weights the engines get for the current version (a state dict, or a handle their owner takes)."""
        ...

    def full_model(self) -> torch.nn.Module:
        """The whole policy in this process, up to date: checkpoints, evaluation and the self-test read it."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """``{"optimizer": ..., "scheduler": ...}`` in one process's format, for the checkpoint."""
        ...

    def load_checkpoint(self, checkpoint: Path, state: dict[str, Any]) -> None: ...

    def set_lr_scale(self, scale: float) -> None: ...

    def close(self) -> None: ...


class LocalPolicy:
    """The policy, its optimizer and schedule (and the reference, when the KL term is on) in this process.

    A data-parallel rank (`posttrain.distributed`) runs the same with its sharded model and its `DataParallel`."""

    def __init__(self, model: torch.nn.Module, tokenizer, runtime: Runtime, recipe: RLRecipe, *,
                 parallel: DataParallel = LOCAL, replay_scale: float = 1.0, reference=None):
        self.model, self.tokenizer, self.runtime, self.recipe = model, tokenizer, runtime, recipe
        self.parallel, self.replay_scale = parallel, replay_scale
        if reference is None and recipe.algorithm.kl_coef > 0:
            reference = make_reference(model, recipe, runtime)
        self.reference = reference
        self.optimization = Optimization(model, recipe.optim, recipe.train.max_steps * recipe.train.updates_per_batch)
        self.settings = UpdateSettings.of(recipe, runtime, tokenizer.pad_token_id)
        reason = shared_prefix_unsupported(model) if self.settings.shared_prefix else None
        if reason:
            log.warning("train.shared_prefix: off for this model, %s; scoring the padded layout", reason)
            self.settings = dataclasses.replace(self.settings, shared_prefix=False)

    def update(self, trajectories: list[Trajectory], advantages: list[float] | list[list[float]], replay: list | None
               ) -> dict[str, float]:
        recipe, model = self.recipe, self.model
        metrics: dict[str, float] = {}
        if replay:
            guard = recipe.schedule.guard
            # Accumulated first: the RL update's optimizer step then applies both losses' gradients together.
            # Data-parallel ranks each take the whole replay batch; `replay_scale` (1 / ranks) keeps the sum.
            metrics.update(replay_sft_backward(model, replay, self.tokenizer, self.runtime,
                                               coef=guard.replay_coef * self.replay_scale,
                                               max_length=guard.replay_max_length, reasoning=guard.replay_reasoning,
                                               micro_batch_size=recipe.train.micro_batch_size))
        optimization = self.optimization
        stats = rl_update(model, optimization.optimizer, optimization.scheduler, trajectories, advantages,
                          self.settings, reference=self.reference, parallel=self.parallel) if trajectories else {}
        if not trajectories and "guard/replay_loss" in metrics:
            self.parallel.reduce_gradients(model)
            stats["grad_norm"] = optimization.step(model)
        metrics.update({f"train/{k}": v for k, v in stats.items()})
        metrics["train/lr"] = optimization.lr
        return metrics

    def weights(self, copy: bool = False) -> dict[str, torch.Tensor]:
        return engine_state(self.model, copy=copy)

    def full_model(self) -> torch.nn.Module:
        return self.model

    def state_dict(self) -> dict[str, Any]:
        return self.optimization.state_dict()

    def load_checkpoint(self, checkpoint: Path, state: dict[str, Any]) -> None:
        load_weights_from_checkpoint(self.model, checkpoint)
        self.optimization.load_state_dict(state)

    def set_lr_scale(self, scale: float) -> None:
        self.optimization.set_lr_scale(scale)

    def close(self) -> None:
        pass


# ---- one update: mini-batches -> micro-batches -> the loss, its gradients and statistics ----------------


def rl_update(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler,
    trajectories: Sequence[Trajectory],
    advantages: Sequence[float | Sequence[float]],
    settings: UpdateSettings,
    *,
    reference: ReferenceFn | None = None,
    parallel: DataParallel = LOCAL,
) -> dict[str, float]:
    """Train on one batch; returns averaged statistics (loss parts, ratios, gap, entropy, grad norm).
    With a data-parallel `parallel`, this rank trains on its share of the batch (see the module docstring)."""
    if not trajectories:
        return {}
    model.train()
    memory = PeakMemory(settings.runtime.device)
    memory.start()
    largest_micro = 0
    minis = mini_batches(trajectories, settings.updates_per_batch)
    skipped = zero_advantage_skips(trajectories, advantages, settings.loss, model)
    trained = [_trained_part(mini, skipped) for mini in minis]
    totals: dict[str, float] = {}
    counts: dict[str, int] = {}
    proximal = None
    if settings.loss.old_policy == "proximal" and settings.updates_per_batch > 1:
        # With one update per batch the trainer's log-probs before the update are those of the loss forward.
        scored = {i for part in trained for i in part}
        proximal = _proximal_logprobs(model, trajectories, advantages,
                                      [i for i in longest_first(trajectories) if i in scored], settings)
    for mini, part in zip(minis, trained):
        if not mini:
            continue
        if settings.shared_prefix:  # a group's sequences in one micro-batch, so that they share their prompt's row
            part = prompts_together(trajectories, part)
        stats = _accumulate_gradients(model, trajectories, advantages, mini, part, settings, reference=reference,
                                      proximal=proximal, parallel=parallel)
        largest_micro = max(largest_micro, int(stats.pop("micro_batch_tokens")))
        stats["grad_norm"] = optimizer_step(model, optimizer, scheduler, settings.max_grad_norm)
        for key, value in stats.items():
            totals[key] = totals.get(key, 0.0) + value
            counts[key] = counts.get(key, 0) + 1
    out = {key: totals[key] / counts[key] for key in totals}
    left_out = [i for mini, part in zip(minis, trained) for i in mini if i not in part]
    out["skipped_zero_adv_sequences"] = float(len(left_out))
    out["skipped_zero_adv_tokens"] = float(sum(len(trajectories[i].token_ids) for i in left_out))
    out.update(memory.figures(largest_micro))  # the step's peak memory, and above its start per token
    return out


def _accumulate_gradients(model, trajectories, advantages, mini: list[int], trained: list[int],
                          settings: UpdateSettings, *, reference: ReferenceFn | None,
                          proximal: dict[int, torch.Tensor] | None, parallel: DataParallel) -> dict[str, float]:
    """Forward/backward every micro-batch of the `trained` part of one mini-batch (all of it, or less the
    sequences `zero_advantage_skips` leaves out), normalized by the whole mini-batch; the caller takes the
    optimizer step."""
    config, runtime = settings.loss, settings.runtime
    total_tokens = sum(trajectories[i].policy_tokens for i in mini)
    sums = _MiniBatchSums()
    size = settings.micro_batch_size
    for chunk in parallel.micro_batches(trained, size):
        if not chunk:
            parallel.idle_backward(model)
            continue
        micro = collate_trajectories([trajectories[i] for i in chunk], [advantages[i] for i in chunk],
                                     settings.pad_id, runtime.device)
        num_seqs = len(chunk)
        layout = _shared_layout(trajectories, chunk, micro, settings)
        sums.largest_micro = max(sums.largest_micro, layout.tokens if layout else int(micro.input_ids.numel()))
        logprobs, entropy = _score(model, micro, layout, settings, entropy=True)
        weights = None
        if config.old_policy == "behaviour":
            old = micro.behaviour
        else:
            old = torch.cat([proximal[i] for i in chunk]) if proximal is not None else logprobs.detach()
            if config.tis_cap:
                weights = truncated_importance_weights(old, micro.behaviour, config.tis_cap)

        def reduce(per_token: torch.Tensor) -> torch.Tensor:
            return aggregate(per_token, micro.seq_index, num_seqs, config.aggregation, settings.normalizer,
                             total_tokens=total_tokens, total_seqs=len(mini))

        per_token, stats = per_token_policy_loss(
            logprobs, old, micro.advantages, micro.seq_index, num_seqs, clip_low=config.clip_low,
            clip_high=config.clip_high, ratio_level=config.ratio_level, dual_clip=config.dual_clip,
            importance_weights=weights,
        )
        loss = reduce(per_token)
        stats["pg_loss"] = float(loss.detach())
        if settings.shared_prefix:  # the share of scored tokens that went through the shared layout
            stats["shared_prefix"] = float(layout is not None)
        entropy = entropy if config.entropy_coef else entropy.detach()
        if config.entropy_coef:
            loss = loss - config.entropy_coef * reduce(entropy)
        stats["entropy"] = float(entropy.detach().mean())
        if config.kl_coef and reference is not None:
            with torch.no_grad(), runtime.autocast():
                shared = {"layout": layout} if layout is not None else {}  # a reference of the older signature
                ref_logprobs = reference(micro.input_ids, micro.attention_mask, micro.score_mask, **shared,
                                         **micro.images_for(model)).float()
            kl = kl_penalty(logprobs, ref_logprobs, config.kl_estimator)
            loss = loss + config.kl_coef * reduce(kl)
            stats["kl"] = float(kl.detach().mean())
        loss.backward()
        sums.add(float(loss.detach()), stats, int(micro.targets.numel()), logprobs.detach(), micro.behaviour)
    parallel.reduce_gradients(model)
    if parallel.world_size > 1:
        sums = sums.over_ranks(parallel)
    return sums.statistics(total_tokens)


@dataclass
class _MiniBatchSums:
    """What one mini-batch's micro-batches add up: the loss, token-weighted statistics (`pg_loss` is summed as
    is: each micro-batch's share is already scaled to the mini-batch) and the tokens they weigh, the ratio's
    bounds, and the trainer's and engine's log-probs of every scored token for the gap."""

    loss: float = 0.0
    weighted: dict[str, float] = field(default_factory=dict)
    tokens: int = 0  # the scored tokens that went through the model
    ratio_max: float = float("-inf")
    ratio_min: float = float("inf")
    trainer: list[torch.Tensor] = field(default_factory=list)
    behaviour: list[torch.Tensor] = field(default_factory=list)
    largest_micro: int = 0

    def add(self, loss: float, stats: dict[str, float], tokens: int, trainer: torch.Tensor,
            behaviour: torch.Tensor) -> None:
        self.loss += loss
        self.tokens += tokens
        self.ratio_max = max(self.ratio_max, stats.pop("ratio_max"))
        self.ratio_min = min(self.ratio_min, stats.pop("ratio_min"))
        for key, value in stats.items():
            self.weighted[key] = self.weighted.get(key, 0.0) + value * (1 if key == "pg_loss" else tokens)
        self.trainer.append(trainer)
        self.behaviour.append(behaviour)

    def over_ranks(self, parallel: DataParallel) -> _MiniBatchSums:
        """Every rank's sums combined: what one process computes on the whole mini-batch."""
        device = self.trainer[0].device if self.trainer else torch.device("cpu")
        mine = (self.loss, self.weighted, self.ratio_max, self.ratio_min,
                _joined(self.trainer).cpu(), _joined(self.behaviour).cpu(), self.tokens)
        parts = parallel.all_gather(mine)
        weighted: dict[str, float] = {}
        for part in parts:
            for key, value in part[1].items():
                weighted[key] = weighted.get(key, 0.0) + value
        return _MiniBatchSums(
            loss=sum(part[0] for part in parts), weighted=weighted, ratio_max=max(part[2] for part in parts),
            ratio_min=min(part[3] for part in parts), trainer=[part[4].to(device) for part in parts],
            behaviour=[part[5].to(device) for part in parts], tokens=sum(part[6] for part in parts),
            largest_micro=self.largest_micro)

    def statistics(self, total_tokens: int) -> dict[str, float]:
        """Per-token means over the tokens that went through the model; `clip_fraction` over all the mini-batch's
        (a token left out by the zero-advantage skip has A = 0, which never counts as clipped: exact either way)."""
        def mean(key: str, value: float) -> float:
            if key == "pg_loss":
                return value
            return value / max(total_tokens if key == "clip_fraction" else self.tokens, 1)

        out = {key: mean(key, value) for key, value in self.weighted.items()}
        out.update(loss=self.loss, ratio_max=self.ratio_max, ratio_min=self.ratio_min, tokens=float(total_tokens),
                   micro_batch_tokens=float(self.largest_micro))
        out.update(logprob_gap_stats(_joined(self.trainer), _joined(self.behaviour)))
        return out


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts) if parts else torch.zeros(0)


@torch.no_grad()
def _proximal_logprobs(model, trajectories, advantages, order: list[int], settings: UpdateSettings
                       ) -> dict[int, torch.Tensor]:
    """The trainer's log-probs of each trajectory's scored tokens before any update, by trajectory index."""
    model.eval()
    cache: dict[int, torch.Tensor] = {}
    runtime, size = settings.runtime, settings.micro_batch_size
    if settings.shared_prefix:  # whole groups per micro-batch, so that they share their prompt's row
        order = prompts_together(trajectories, order)
    for start in range(0, len(order), size):
        chunk = order[start : start + size]
        micro = collate_trajectories([trajectories[i] for i in chunk], [advantages[i] for i in chunk],
                                     settings.pad_id, runtime.device)
        logprobs = _score(model, micro, _shared_layout(trajectories, chunk, micro, settings), settings).logprobs
        for row, index in enumerate(chunk):
            cache[index] = logprobs[micro.seq_index == row]
    model.train()
    return cache


def _shared_layout(trajectories, chunk: list[int], micro: _MicroBatch, settings: UpdateSettings
                   ) -> SharedPrefixBatch | None:
    """The `train.shared_prefix` layout of a micro-batch, or None where it keeps the padded one (the knob off,
    images, a sequence over the layout's length limit, no prompt shared)."""
    if not settings.shared_prefix or micro.image_inputs or micro.input_ids.shape[1] > SHARED_PREFIX_MAX_SEQUENCE:
        return None
    return shared_prefix_batch([trajectories[i].token_ids for i in chunk], [trajectories[i].loss_mask for i in chunk],
                               settings.pad_id, settings.runtime.device)


def _score(model, micro: _MicroBatch, layout: SharedPrefixBatch | None, settings: UpdateSettings,
           entropy: bool = False) -> TokenStats:
    """The log-probs (and entropies) of a micro-batch's scored tokens, in `layout` or the padded rows; the head
    and softmax in chunks of tokens (no [tokens, vocab] logits kept)."""
    with settings.runtime.autocast():
        if layout is not None:
            return shared_prefix_token_stats(model, layout, micro.targets, temperature=settings.temperature,
                                             entropy=entropy)
        return scored_token_stats(model, micro.input_ids, micro.score_mask, micro.targets,
                                  temperature=settings.temperature, entropy=entropy,
                                  attention_mask=micro.attention_mask, **micro.images_for(model))


@dataclass
class _MicroBatch:
    input_ids: torch.Tensor  # [B, T]
    attention_mask: torch.Tensor  # [B, T]
    score_mask: torch.Tensor  # [B, T-1]: predict token t+1 from position t
    targets: torch.Tensor  # [N] the sampled token ids, row-major over score_mask
    behaviour: torch.Tensor  # [N]
    advantages: torch.Tensor  # [N]
    seq_index: torch.Tensor  # [N] index of the sequence within the mini-batch
    # the image prompts' tensors (``pixel_values`` ...), the rows' joined in row order; empty for text rows
    image_inputs: dict[str, torch.Tensor] = field(default_factory=dict)

    def images_for(self, model: torch.nn.Module) -> dict[str, torch.Tensor]:
        """The image tensors as the model's forward takes them: floating ones in its parameters' dtype (a bf16
        vision tower), the rest as they are."""
        dtype = next(model.parameters()).dtype
        return {key: value.to(dtype) if value.is_floating_point() else value
                for key, value in self.image_inputs.items()}


def collate_trajectories(
    trajectories: Sequence[Trajectory],
    advantages: Sequence[float | Sequence[float]],
    pad_id: int,
    device: torch.device,
) -> _MicroBatch:
    width = max(len(t.token_ids) for t in trajectories)
    batch = len(trajectories)
    input_ids = torch.full((batch, width), pad_id, dtype=torch.long)
    attention = torch.zeros((batch, width), dtype=torch.long)
    score = torch.zeros((batch, width - 1), dtype=torch.bool)
    behaviour, targets, adv, seq = [], [], [], []
    for row, (trajectory, advantage) in enumerate(zip(trajectories, advantages)):
        length = len(trajectory.token_ids)
        ids = torch.tensor(trajectory.token_ids, dtype=torch.long)
        mask = torch.tensor(trajectory.loss_mask[1:], dtype=torch.bool)
        input_ids[row, :length] = ids
        attention[row, :length] = 1
        score[row, : length - 1] = mask
        behaviour.append(torch.tensor(trajectory.behaviour_logprobs[1:], dtype=torch.float32)[mask])
        targets.append(ids[1:][mask])
        count = int(mask.sum())
        adv.append(_token_advantages(advantage, count, trajectory.task_id))
        seq.append(torch.full((count,), row, dtype=torch.long))
    return _MicroBatch(
        image_inputs=join_image_inputs(trajectories, device),
        input_ids=input_ids.to(device),
        attention_mask=attention.to(device),
        score_mask=score.to(device),
        targets=torch.cat(targets).to(device),
        behaviour=torch.cat(behaviour).to(device),
        advantages=torch.cat(adv).to(device),
        seq_index=torch.cat(seq).to(device),
    )


def join_image_inputs(trajectories: Sequence[Trajectory], device: torch.device) -> dict[str, torch.Tensor]:
    """The rows' image tensors joined along their first axis in row order, as `models.collate_vision` batches
    them (a VLM's forward matches the images to the image tokens in order, row by row); text rows add nothing.
    A row whose prompt holds an image but whose tensors are missing is an error: scored without its image, the
    sampled tokens would get other log-probs than the engine's."""
    joined: dict[str, list[torch.Tensor]] = {}
    for trajectory in trajectories:
        images = trajectory.image_inputs
        if not images:
            if first_image_message(trajectory.messages) is not None:
                raise ValueError(f"trajectory of {trajectory.task_id}: its prompt holds an image but it carries no "
                                 "image tensors (a restored batch: `rl.vision.ProcessorRenderer.attach` them)")
            continue
        if joined and set(images) != set(joined):
            raise ValueError(f"trajectory of {trajectory.task_id}: image tensors {sorted(images)} differ from the "
                             f"batch's {sorted(joined)}")
        for key, value in images.items():
            joined.setdefault(key, []).append(torch.as_tensor(value))
    return {key: torch.cat(values).to(device) for key, values in joined.items()}


def _token_advantages(advantage: float | Sequence[float], count: int, task_id: str) -> torch.Tensor:
    if isinstance(advantage, (int, float)):
        return torch.full((count,), float(advantage))
    per_token = torch.as_tensor(advantage, dtype=torch.float32).flatten()
    if per_token.numel() != count:
        raise ValueError(f"trajectory of {task_id}: {per_token.numel()} advantages for {count} policy tokens")
    return per_token


def zero_advantage_skips(trajectories: Sequence[Trajectory], advantages: Sequence[float | Sequence[float]],
                         config: PolicyLossConfig, model: torch.nn.Module) -> set[int]:
    """Indices of the sequences the update leaves out: those whose advantage is exactly 0 (every token's), when
    nothing but the advantage-weighted surrogate reaches them. None with `skip_zero_advantage` off, with the KL
    or the entropy term on (each has a gradient on every sequence), for a batch that mixes image and text rows
    (the vision tower's parameters would get no gradient instead of a zero one), and for a mixture-of-experts
    model (an expert routed to only by skipped tokens, likewise). The replay SFT loss is its own backward over
    its own samples and is untouched."""
    if not config.skip_zero_advantage or config.kl_coef > 0 or config.entropy_coef != 0:
        return set()
    if len({bool(t.image_inputs) for t in trajectories}) > 1 or _routes_to_experts(model):
        return set()
    return {i for i, advantage in enumerate(advantages) if _is_zero(advantage)}


def _is_zero(advantage: float | Sequence[float]) -> bool:
    if isinstance(advantage, (int, float)):
        return advantage == 0.0
    return bool((torch.as_tensor(advantage, dtype=torch.float32) == 0).all())


_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")


def _routes_to_experts(model: torch.nn.Module) -> bool:
    config = getattr(model, "config", None)
    configs = [config, getattr(config, "text_config", None)]
    return any(isinstance(getattr(c, name, None), int) and getattr(c, name) > 1
               for c in configs if c is not None for name in _EXPERT_COUNTS)


def _trained_part(mini: list[int], skipped: set[int]) -> list[int]:
    """The sequences of a mini-batch that go through the model. With every one skipped the shortest (mini-batches
    are longest first) still does: its loss is 0 and its gradients zeros, and the optimizer then steps as without
    the skip -- AdamW decays the weights and its moments on a zero gradient but leaves a parameter without one."""
    kept = [i for i in mini if i not in skipped]
    return kept or mini[-1:]


def longest_first(trajectories: Sequence[Trajectory]) -> list[int]:
    """Micro-batches of similar lengths waste less padding. The order is a pure function of the batch, so a
    synchronous and an asynchronous run of the same batch compute the same sums."""
    return sorted(range(len(trajectories)), key=lambda i: -len(trajectories[i].token_ids))


def prompts_together(trajectories: Sequence[Trajectory], order: list[int]) -> list[int]:
    """`order` with the sequences of one prompt (everything before the first scored token) next to each other,
    prompts in the order their first sequence had: micro-batches then hold whole groups. Only the order of the
    sums changes."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for index in order:
        ids = trajectories[index].token_ids
        groups.setdefault(tuple(ids[: prompt_end(ids, trajectories[index].loss_mask)]), []).append(index)
    return [index for members in groups.values() for index in members]


def mini_batches(trajectories: Sequence[Trajectory], updates_per_batch: int) -> list[list[int]]:
    """Indices of each optimizer step's trajectories: longest first, dealt round-robin."""
    order = longest_first(trajectories)
    return [order[k::updates_per_batch] for k in range(updates_per_batch)]


# ---- what the policy serves, its reference, the guard's replay loss and learning-rate scale ---------------


def plain_copy(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of the policy's whole function as a plain model: LoRA's adapter merged in, else a deep copy."""
    return merged_copy(model) if is_lora(model) else copy.deepcopy(model)


def engine_state(model: torch.nn.Module, copy: bool = False) -> dict[str, torch.Tensor]:
    """The weights an engine serves: the merged model for LoRA; detached (cloned when the trainer will keep
    updating them while the engine still needs this version)."""
    from posttrain.rollout import state_for_engine

    state = state_for_engine(model)
    return {k: v.detach().clone() for k, v in state.items()} if copy else state


def make_reference(model, recipe: RLRecipe, runtime: Runtime):
    """log-probs of the scored tokens under the reference policy: the base with the adapter off (LoRA), or a
    frozen copy of the starting weights."""
    temperature = train_temperature(recipe)
    if is_lora(model):
        scorer, switched = model, lambda: reference_mode(model)
    else:
        scorer, switched = copy.deepcopy(model).eval(), contextlib.nullcontext
        for parameter in scorer.parameters():
            parameter.requires_grad_(False)

    def reference(input_ids, attention_mask, score_mask, layout: SharedPrefixBatch | None = None, **image_inputs):
        """The reference's log-probs of the scored tokens of the padded batch; with `layout` (the policy's
        `train.shared_prefix` layout of the same batch, which `LocalPolicy` only builds for a model that takes it:
        the scorer is that model's copy) scored in that layout, the same tokens in the same order."""
        targets = input_ids[:, 1:][score_mask]
        with switched():
            if layout is not None:
                return shared_prefix_token_stats(scorer, layout, targets, temperature=temperature).logprobs
            return scored_token_stats(scorer, input_ids, score_mask, targets, temperature=temperature,
                                      attention_mask=attention_mask, **image_inputs).logprobs

    return reference


def replay_sft_backward(model: torch.nn.Module, samples: list[SFTSample], tokenizer, runtime: Runtime, *,
                        coef: float, max_length: int, reasoning: str, micro_batch_size: int) -> dict[str, float]:
    """Accumulate ``coef * mean token cross-entropy`` over the replay demonstrations into the gradients (the
    caller's optimizer step applies it together with the RL loss)."""
    tokenized = tokenize_samples(samples, tokenizer, max_length, reasoning).samples
    if not tokenized:
        return {}
    rows = [Row(s.input_ids, s.loss_mask, list(range(len(s))), [0] * len(s)) for s in tokenized]
    batches = [collate(rows[i : i + micro_batch_size], tokenizer.pad_token_id, device=runtime.device)
               for i in range(0, len(rows), micro_batch_size)]
    trained = sum(int((batch["labels"] != -100).sum()) for batch in batches)
    if trained == 0:
        return {}
    model.train()
    total = 0.0
    for batch in batches:
        with runtime.autocast():
            summed, _ = sft_loss_sum(model, batch)
        (coef * summed / trained).backward()
        total += float(summed.detach())
    return {"guard/replay_loss": total / trained, "guard/replay_tokens": float(trained),
            "guard/replay_samples": float(len(rows))}


class Optimization:
    """An optimizer and its schedule over `total_steps` steps, whose learning rate a rollback may scale from
    then on (the schedule's shape kept): the policy's and the critic's."""

    def __init__(self, model: torch.nn.Module, optim: OptimConfig, total_steps: int):
        self.optimizer = build_optimizer(model, optim)
        self.scheduler = build_scheduler(self.optimizer, optim, total_steps)
        self.max_grad_norm = optim.max_grad_norm
        self._base_lrs = list(self.scheduler.base_lrs)

    @property
    def lr(self) -> float:
        return self.scheduler.get_last_lr()[0]

    def step(self, model: torch.nn.Module) -> float:
        """Clip, step and advance the schedule; returns the gradient norm."""
        return optimizer_step(model, self.optimizer, self.scheduler, self.max_grad_norm)

    def set_lr_scale(self, scale: float) -> None:
        scheduler, optimizer = self.scheduler, self.optimizer
        scheduler.base_lrs = [lr * scale for lr in self._base_lrs]
        for group, base, factor in zip(optimizer.param_groups, scheduler.base_lrs, scheduler.lr_lambdas):
            group["initial_lr"] = base
            group["lr"] = base * factor(scheduler.last_epoch)
        scheduler._last_lr = [group["lr"] for group in optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_optimizer_state(self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
