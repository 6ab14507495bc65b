"""The reward-model recipe (Bradley–Terry) and the loader the RL stage uses to score with it.

    posttrain rm recipe.yaml [--resume]

Model: the causal LM's decoder plus a scalar head, r(x, y) = w . h_last + b, where h_last is the final
hidden state at the last token of the rendered conversation (prompt + response, which ends with the
template's end-of-turn token). Loss: Bradley–Terry, -log sigmoid(r_chosen - r_rejected), plus an optional
centring term `rm.center_coef * (r_chosen + r_rejected)^2` (Eisenstein et al., 2023) that pins the reward's
free offset near zero. Held-out pairwise accuracy is P(r_chosen > r_rejected) on held-out pairs.

Saved format (the run's `final/` directory; docs/dpo.md):

    config.json, model.safetensors, tokenizer files   a plain HF causal LM (the fine-tuned trunk; its LM head is
                                                      untouched and unused)
    reward_head.safetensors                           {"weight": [1, hidden], "bias": [1]} in fp32
    reward_head.json                                  {"format": "posttrain-reward-head/1", "hidden_size",
                                                       "score_position": "last_token", "mean", "std", ...}

`load_reward_model(path)` returns a `RewardModel`: call it with a conversation (list of messages), a list of
token ids, or a batch of either, and get float scores back (normalised by the saved mean/std on request).
The RL stage wraps it as a learned reward component beside the verifiers (`rl.learned_reward`), and PPO's critic
(`rl.critic`) is the same model read at every token (`ScalarRewardModel.token_values`), saved in the same format.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from safetensors.torch import load_file, save_file

from posttrain.config import RMRecipe
from posttrain.data.preference import TokenizedPair, collate_pairs
from posttrain.models import ModelError, count_parameters, load_model, save_checkpoint, save_model_dir
from posttrain.tracking import Tracker, say
from posttrain.train.dpo import (
    PairCursor,
    attention_kernel,
    disable_dropout,
    mean_stats,
    resume_from_checkpoint,
    start_run,
    sum_stats,
    train_on_pairs,
)
from posttrain.train.forward import check_forward_parity, split_head
from posttrain.train.optim import build_optimizer, build_scheduler
from posttrain.train.preference_losses import bradley_terry_loss
from posttrain.train.step import Runtime, prepare_model

HEAD_FILE = "reward_head.safetensors"
HEAD_META = "reward_head.json"
HEAD_FORMAT = "posttrain-reward-head/1"


class ScalarRewardModel(torch.nn.Module):
    """A causal LM's decoder with a scalar head on the last token's final hidden state."""

    def __init__(self, causal_lm: torch.nn.Module, head: torch.nn.Linear | None = None):
        super().__init__()
        parts = split_head(causal_lm)
        if parts is None:
            raise ModelError("a reward model needs a causal LM whose decoder and output head can be separated")
        self.causal_lm = causal_lm
        self._decoder = [parts[0]]  # a list, so the decoder is not registered twice as a submodule
        hidden = causal_lm.config.hidden_size
        if head is None:
            head = torch.nn.Linear(hidden, 1)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                torch.nn.init.normal_(head.weight, std=1.0 / math.sqrt(hidden + 1))
            torch.nn.init.zeros_(head.bias)
        self.head = head.float()

    def forward(self, input_ids: torch.Tensor, last_index: torch.Tensor) -> torch.Tensor:
        """[rows] fp32 rewards; rows are right-padded and `last_index[r]` is row r's last real token."""
        hidden = self._hidden(input_ids)
        return self._score(hidden[torch.arange(hidden.shape[0], device=hidden.device), last_index])

    def token_values(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[N] fp32 scores of the hidden states at `positions` ([rows, T-1] bool, row-major), the way a critic
        reads them: position t is the state before token t+1 (as `train.forward.selected_logits` selects)."""
        return self._score(self._hidden(input_ids)[:, :-1][positions])

    def _hidden(self, input_ids: torch.Tensor) -> torch.Tensor:
        with attention_kernel(self.causal_lm, input_ids):
            return self._decoder[0](input_ids=input_ids, use_cache=False).last_hidden_state

    def _score(self, hidden: torch.Tensor) -> torch.Tensor:
        # The head in fp32: a reward is one number per sequence, so its precision is cheap and bf16's 8 bits
        # of mantissa would blur close pairs.
        with torch.autocast(hidden.device.type, enabled=False):
            return self.head(hidden.float()).squeeze(-1)


@dataclass
class RMResult:
    output_dir: Path
    final_dir: Path
    steps: int
    seconds: float
    pairs_per_s: float
    train_loss: float
    heldout_start: dict[str, float] = field(default_factory=dict)
    heldout: dict[str, float] = field(default_factory=dict)
    data_report: dict[str, Any] = field(default_factory=dict)


def run_rm(
    recipe: RMRecipe, *, resume: bool = False, on_step: Callable[[int, dict[str, float]], None] | None = None
) -> RMResult:
    output_dir, runtime, tokenizer, pairs = start_run(recipe)
    causal_lm = prepare_model(load_model(recipe.model, tokenizer, runtime.device), recipe.model, recipe.runtime)
    disable_dropout(causal_lm)
    check_forward_parity(causal_lm, pairs.train, runtime.autocast_dtype, layout="padded", what="rm")
    model = ScalarRewardModel(causal_lm).to(runtime.device)

    micro = recipe.train.micro_batch_size or recipe.train.batch_size
    steps_per_epoch = max(1, math.ceil(len(pairs.train) / recipe.train.batch_size))
    total_steps = recipe.train.max_steps or math.ceil(recipe.train.epochs * steps_per_epoch)
    optimizer = build_optimizer(model, recipe.optim)
    scheduler = build_scheduler(optimizer, recipe.optim, total_steps)

    # The checkpoint's HF directory holds the trunk; the head travels in the training state.
    state = resume_from_checkpoint("rm", output_dir, causal_lm, optimizer, scheduler) if resume else None
    if state:
        model.head.load_state_dict(state["reward_head"])
    cursor = PairCursor(**state["cursor"]) if state else PairCursor()
    heldout_start = state.get("heldout_start", {}) if state else {}

    pad_id = tokenizer.pad_token_id

    def evaluate() -> dict[str, float]:
        return evaluate_reward_model(model, pairs.heldout, pad_id, runtime, micro)

    tracker = Tracker(output_dir, recipe.tracking, recipe=recipe.model_dump(mode="json"), stage="rm")
    if cursor.step == 0 and pairs.heldout:
        heldout_start = evaluate()
        tracker.log({f"heldout/{k}": v for k, v in heldout_start.items()}, step=0)
    say(f"[rm] {count_parameters(model, trainable_only=True):,} trainable parameters, "
                  f"{len(pairs.train)} pairs, {total_steps} steps, {runtime.precision} on {runtime.device}")
    train_loss = train_on_pairs(
        "rm", recipe, model, pairs.train, pad_id, runtime.device, optimizer, scheduler, cursor, total_steps, tracker,
        batch_loss=lambda batch, _: reward_losses(model, batch, runtime, recipe.rm.center_coef),
        evaluate=evaluate if pairs.heldout else None,
        save=lambda: _save(recipe, output_dir, model, tokenizer, optimizer, scheduler, cursor, heldout_start),
        on_step=on_step,
    )
    heldout = {}
    if pairs.heldout:
        heldout = evaluate()
        tracker.log({f"heldout/{k}": v for k, v in heldout.items()}, step=cursor.step)
    _save(recipe, output_dir, model, tokenizer, optimizer, scheduler, cursor, heldout_start)
    stats_pairs = (pairs.train + pairs.heldout)[: recipe.rm.stats_pairs]
    mean, std = reward_statistics(model, stats_pairs, pad_id, runtime, micro)
    final_dir = save_reward_model(output_dir / "final", model, tokenizer, mean=mean, std=std,
                                  merge_lora=recipe.model.lora.merge_on_save)
    tracker.close()
    return RMResult(output_dir=output_dir, final_dir=final_dir, steps=cursor.step, seconds=cursor.train_seconds,
                    pairs_per_s=cursor.pairs / max(cursor.train_seconds, 1e-9), train_loss=train_loss,
                    heldout_start=heldout_start, heldout=heldout, data_report=pairs.report)


def batch_rewards(model: ScalarRewardModel, batch: dict[str, Any]) -> torch.Tensor:
    """[2B] rewards of a `collate_pairs` batch, in row order (one forward per length group)."""
    outputs = [model(group["input_ids"], group["last_index"]) for group in batch["groups"]]
    rows = torch.cat([group["rows"] for group in batch["groups"]])
    return torch.cat(outputs)[torch.argsort(rows)]


def reward_losses(model: ScalarRewardModel, batch: dict[str, Any], runtime: Runtime, center_coef: float):
    """Per-pair Bradley–Terry loss (+ centring) of a `collate_pairs` batch, and summed statistics."""
    with runtime.autocast():
        rewards = batch_rewards(model, batch)
    pairs = batch["num_pairs"]
    chosen, rejected = rewards[:pairs], rewards[pairs:]
    losses = bradley_terry_loss(chosen, rejected)
    if center_coef:
        losses = losses + center_coef * (chosen + rejected) ** 2
    stats = sum_stats(loss=losses, accuracy=chosen > rejected, reward_chosen=chosen, reward_rejected=rejected,
                  reward_margin=chosen - rejected)
    return losses, stats


def evaluate_reward_model(model, pairs: list[TokenizedPair], pad_id: int, runtime: Runtime,
                          batch_size: int) -> dict[str, float]:
    """Held-out loss and pairwise accuracy (ties count as wrong: a constant reward scores 0)."""
    return mean_stats(model, pairs, batch_size, pad_id, runtime.device,
                      lambda batch, _: reward_losses(model, batch, runtime, 0.0)[1])


@torch.no_grad()
def reward_statistics(model, pairs: list[TokenizedPair], pad_id: int, runtime: Runtime,
                      batch_size: int) -> tuple[float, float]:
    """Mean and standard deviation of the rewards of both responses of `pairs` (saved for normalising)."""
    model.eval()
    rewards = []
    for start in range(0, len(pairs), batch_size):
        batch = collate_pairs(pairs[start : start + batch_size], pad_id, runtime.device)
        with runtime.autocast():
            rewards.append(batch_rewards(model, batch).float().cpu())
    if not rewards:
        return 0.0, 1.0
    values = torch.cat(rewards)
    return float(values.mean()), float(values.std()) if values.numel() > 1 else 1.0


def _save(recipe, output_dir, model: ScalarRewardModel, tokenizer, optimizer, scheduler, cursor, heldout_start):
    state = {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "cursor": vars(cursor).copy(),
             "heldout_start": heldout_start, "reward_head": model.head.state_dict()}
    save_checkpoint(output_dir, cursor.step, model.causal_lm, tokenizer, state, keep=recipe.train.keep_checkpoints)


# ----------------------------------------------------------------------------------------------------
# The saved format and its loader
# ----------------------------------------------------------------------------------------------------


def save_reward_model(directory: Path, model: ScalarRewardModel, tokenizer, *, mean: float = 0.0, std: float = 1.0,
                      merge_lora: bool = True) -> Path:
    """Write the HF directory plus the head files, atomically: a crash leaves the old directory or none."""
    directory = Path(directory)
    staging = directory.with_name(f".rm-{directory.name}-{os.getpid()}")
    save_model_dir(staging, model.causal_lm, tokenizer, merge_lora=merge_lora)
    head = model.head
    save_file({"weight": head.weight.detach().float().cpu().contiguous(),
               "bias": head.bias.detach().float().cpu().contiguous()}, str(staging / HEAD_FILE))
    meta = {"format": HEAD_FORMAT, "hidden_size": head.in_features, "score_position": "last_token",
            "mean": mean, "std": std if std > 0 else 1.0}
    (staging / HEAD_META).write_text(json.dumps(meta, indent=2) + "\n")
    old = directory.with_name(f".old-{directory.name}-{os.getpid()}")
    if directory.exists():
        os.replace(directory, old)
    os.replace(staging, directory)
    shutil.rmtree(old, ignore_errors=True)
    return directory


class RewardModel:
    """A saved reward model as a scoring function: `rm(messages) -> float`, `rm([ids, ids]) -> [float, float]`.

    A conversation is rendered with the model's chat template (no generation prompt) and scored at its last
    token, so it should end with the assistant turn being judged. Token ids are scored as given: pass the ids
    of prompt + response exactly as the policy produced them, ending with the end-of-turn token.
    """

    def __init__(self, model: ScalarRewardModel, tokenizer, meta: dict[str, Any], device: torch.device,
                 normalize: bool, batch_size: int):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.meta = meta
        self.device = device
        self.normalize = normalize
        self.batch_size = batch_size

    def __call__(self, items: Sequence[Any]) -> float | list[float]:
        single = _is_single(items)
        batch = [items] if single else list(items)
        scores = self.score_ids([self._ids(item) for item in batch])
        return scores[0] if single else scores

    @torch.no_grad()
    def score_ids(self, sequences: list[list[int]]) -> list[float]:
        scores: list[float] = []
        pad_id = self.tokenizer.pad_token_id
        for start in range(0, len(sequences), self.batch_size):
            chunk = sequences[start : start + self.batch_size]
            length = max(len(ids) for ids in chunk)
            input_ids = torch.full((len(chunk), length), pad_id, dtype=torch.long)
            for row, ids in enumerate(chunk):
                input_ids[row, : len(ids)] = torch.tensor(ids)
            last = torch.tensor([len(ids) - 1 for ids in chunk])
            rewards = self.model(input_ids.to(self.device), last.to(self.device)).float().cpu()
            if self.normalize:
                rewards = (rewards - self.meta["mean"]) / self.meta["std"]
            scores += rewards.tolist()
        return scores

    def _ids(self, item: Any) -> list[int]:
        if item and isinstance(item[0], dict):
            text = self.tokenizer.apply_chat_template(list(item), tokenize=False)
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        ids = [int(token) for token in item]
        if not ids:
            raise ValueError("cannot score an empty sequence")
        return ids


def load_reward_model(path: str | Path, *, device: str | torch.device = "cpu", normalize: bool = False,
                      batch_size: int = 32) -> RewardModel:
    """Load a reward model saved by `posttrain rm` (its `final/` directory, or a run directory)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if (path / "final" / HEAD_META).is_file():
        path = path / "final"
    if not (path / HEAD_META).is_file():
        raise ModelError(f"{path}: not a posttrain reward model (no {HEAD_META}; train one with `posttrain rm`)")
    meta = json.loads((path / HEAD_META).read_text())
    if meta.get("format") != HEAD_FORMAT:
        raise ModelError(f"{path / HEAD_META}: unknown reward head format {meta.get('format')!r} "
                         f"(this version reads {HEAD_FORMAT})")
    tokenizer = AutoTokenizer.from_pretrained(path)
    causal_lm = AutoModelForCausalLM.from_pretrained(path).to(device)
    weights = load_file(str(path / HEAD_FILE))
    head = torch.nn.Linear(meta["hidden_size"], 1)
    head.load_state_dict(weights)
    model = ScalarRewardModel(causal_lm, head).to(device)
    return RewardModel(model, tokenizer, meta, torch.device(device), normalize, batch_size)


def _is_single(items: Any) -> bool:
    """A conversation (list of message dicts) or one id list, rather than a batch of them."""
    if not isinstance(items, Sequence) or isinstance(items, (str, bytes)) or not items:
        raise ValueError("expected a conversation, a list of token ids, or a batch of either")
    first = items[0]
    return isinstance(first, dict) or isinstance(first, int) or (hasattr(first, "ndim") and first.ndim == 0)
