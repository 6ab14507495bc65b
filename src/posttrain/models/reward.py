"""Reward models: a causal LM's decoder with a scalar head, saved as a plain `AutoModelForSequenceClassification`.

    r(x, y) = w . h_last        h_last: the decoder's final hidden state at the last token of prompt + response

This is exactly what transformers' `*ForSequenceClassification` with one label computes (a bias-free `score`
head read at the rightmost non-padding token), so a reward model trained here is a plain HF directory any tool
loads, and any such model from elsewhere scores through `load_reward_model`:

    config.json, model.safetensors, tokenizer files   `AutoModelForSequenceClassification.from_pretrained` loads it
                                                      (num_labels 1; the trunk under `base_model_prefix`, `score`)
    reward_stats.json (optional)                      {"format": "posttrain-reward-stats/1", "mean", "std"}: the
                                                      statistics `normalize=True` divides by (absent: 0 and 1)

PPO's critic is the same model read at every position (`ScalarRewardModel.token_values`), saved the same way.
"""

from __future__ import annotations

import copy
import json
import math
import os
import shutil
from pathlib import Path
from typing import Any, Sequence

import torch

from posttrain.chat import chat_ids
from posttrain.models.load import ModelError
from posttrain.models.lora import is_lora, merged_copy
from posttrain.models.parts import attention_kernel, split_head

STATS_FILE = "reward_stats.json"
STATS_FORMAT = "posttrain-reward-stats/1"


class ScalarRewardModel(torch.nn.Module):
    """A decoder (`trunk`, returning `last_hidden_state`) with a bias-free scalar head on its hidden states."""

    def __init__(self, trunk: torch.nn.Module, head: torch.nn.Linear, *, causal_lm: torch.nn.Module | None = None):
        super().__init__()
        if head.out_features != 1 or head.bias is not None:
            raise ModelError("a reward head is one bias-free output (as transformers' `score` with num_labels=1)")
        self.trunk = trunk
        self.head = head.float()
        # The causal LM the trunk lives in, when built from one (a list: not registered as a second submodule).
        # Saving merges its LoRA adapter, if any, before the trunk's weights are written out.
        self._causal_lm = [causal_lm] if causal_lm is not None else []

    @classmethod
    def from_causal_lm(cls, causal_lm: torch.nn.Module, head: torch.nn.Linear | None = None) -> ScalarRewardModel:
        """The causal LM's decoder (LoRA-wrapped or not) with `head`, or a fresh one (seeded: the same every
        time, and drawing from no caller's RNG stream)."""
        parts = split_head(causal_lm)
        if parts is None:
            raise ModelError("a reward model needs a causal LM whose decoder and output head can be separated")
        if head is None:
            hidden = causal_lm.config.hidden_size
            head = torch.nn.Linear(hidden, 1, bias=False)
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(0)
                torch.nn.init.normal_(head.weight, std=1.0 / math.sqrt(hidden + 1))
        return cls(parts[0], head.to(next(causal_lm.parameters()).device), causal_lm=causal_lm)

    @classmethod
    def from_sequence_classifier(cls, model: torch.nn.Module) -> ScalarRewardModel:
        """A loaded `*ForSequenceClassification` with one label: its trunk and `score` head."""
        trunk = getattr(model, getattr(model, "base_model_prefix", ""), None)
        head = getattr(model, "score", None)
        if not isinstance(trunk, torch.nn.Module) or not isinstance(head, torch.nn.Linear):
            raise ModelError(f"{type(model).__name__}: expected a decoder under `{model.base_model_prefix}` and "
                             "a linear `score` head (a transformers *ForSequenceClassification)")
        if head.out_features != 1 or head.bias is not None:
            raise ModelError(f"{type(model).__name__}: expected a bias-free `score` head with one output "
                             f"(num_labels 1), got {head}")
        return cls(trunk, head)

    @property
    def config(self):
        return self.trunk.config

    def forward(self, input_ids: torch.Tensor, last_index: torch.Tensor) -> torch.Tensor:
        """[rows] fp32 rewards; rows are right-padded and `last_index[r]` is row r's last real token."""
        hidden = self._hidden(input_ids)
        return self._score(hidden[torch.arange(hidden.shape[0], device=hidden.device), last_index])

    def token_values(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """[N] fp32 scores of the hidden states at `positions` ([rows, T-1] bool, row-major), the way a critic
        reads them: position t is the state before token t+1 (as `train.forward.selected_logits` selects)."""
        return self._score(self._hidden(input_ids)[:, :-1][positions])

    def _hidden(self, input_ids: torch.Tensor) -> torch.Tensor:
        with attention_kernel(self.trunk, input_ids):
            return self.trunk(input_ids=input_ids, use_cache=False).last_hidden_state

    def _score(self, hidden: torch.Tensor) -> torch.Tensor:
        # The head in fp32: a reward is one number per sequence, so its precision is cheap and bf16's 8 bits
        # of mantissa would blur close pairs.
        with torch.autocast(hidden.device.type, enabled=False):
            return self.head(hidden.float()).squeeze(-1)

    def to_sequence_classifier(self, pad_token_id: int | None) -> torch.nn.Module:
        """A transformers `AutoModelForSequenceClassification` (one label) holding these weights (a LoRA
        adapter merged in), built without a second allocation of the trunk."""
        from transformers import AutoModelForSequenceClassification

        trunk = self.trunk
        if self._causal_lm and is_lora(self._causal_lm[0]):
            trunk = split_head(merged_copy(self._causal_lm[0]))[0]
        config = copy.deepcopy(trunk.config)
        config.num_labels = 1
        config.pad_token_id = pad_token_id  # where transformers finds each row's last token
        config.architectures = None
        with torch.device("meta"):
            classifier = AutoModelForSequenceClassification.from_config(config)
        prefix = classifier.base_model_prefix
        state = {f"{prefix}.{name}": tensor for name, tensor in trunk.state_dict().items()}
        dtype = next(trunk.parameters()).dtype
        state["score.weight"] = self.head.weight.detach().to(dtype)
        missing, unexpected = classifier.load_state_dict(state, strict=False, assign=True)
        if unexpected or [name for name in missing if not name.endswith("inv_freq")]:
            raise ModelError(f"the reward model's weights do not fit {type(classifier).__name__} "
                             f"(missing {missing[:5]}, unexpected {unexpected[:5]})")
        return classifier


def save_reward_model(directory: Path, model: ScalarRewardModel, tokenizer, *, mean: float = 0.0,
                      std: float = 1.0) -> Path:
    """Write `model` as an `AutoModelForSequenceClassification` directory plus its score statistics, atomically:
    a crash leaves the old directory or none."""
    directory = Path(directory)
    staging = directory.with_name(f".rm-{directory.name}-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    classifier = model.to_sequence_classifier(getattr(tokenizer, "pad_token_id", None))
    classifier.save_pretrained(staging, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(staging)
    stats = {"format": STATS_FORMAT, "score_position": "last_token", "mean": mean, "std": std if std > 0 else 1.0}
    (staging / STATS_FILE).write_text(json.dumps(stats, indent=2) + "\n")
    old = directory.with_name(f".old-{directory.name}-{os.getpid()}")
    if directory.exists():
        os.replace(directory, old)
    os.replace(staging, directory)
    shutil.rmtree(old, ignore_errors=True)
    return directory


class RewardModel:
    """A reward model as a scoring function: `rm(messages) -> float`, `rm([ids, ids]) -> [float, float]`.

    A conversation is rendered with the model's chat template (no generation prompt) and scored at its last
    token, so it should end with the assistant turn being judged. Token ids are scored as given: pass the ids
    of prompt + response exactly as the policy produced them, ending with the end-of-turn token.
    """

    def __init__(self, model: ScalarRewardModel, tokenizer, stats: dict[str, Any], device: torch.device,
                 normalize: bool, batch_size: int):
        self.model = model.eval()
        self.tokenizer = tokenizer
        self.stats = stats
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
        pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        for start in range(0, len(sequences), self.batch_size):
            chunk = sequences[start : start + self.batch_size]
            length = max(len(ids) for ids in chunk)
            input_ids = torch.full((len(chunk), length), pad_id, dtype=torch.long)
            for row, ids in enumerate(chunk):
                input_ids[row, : len(ids)] = torch.tensor(ids)
            last = torch.tensor([len(ids) - 1 for ids in chunk])
            rewards = self.model(input_ids.to(self.device), last.to(self.device)).float().cpu()
            if self.normalize:
                rewards = (rewards - self.stats["mean"]) / self.stats["std"]
            scores += rewards.tolist()
        return scores

    def _ids(self, item: Any) -> list[int]:
        if item and isinstance(item[0], dict):
            return chat_ids(self.tokenizer, item, generation_prompt=False)
        ids = [int(token) for token in item]
        if not ids:
            raise ValueError("cannot score an empty sequence")
        return ids


def load_reward_model(path: str | Path, *, device: str | torch.device = "cpu", normalize: bool = False,
                      batch_size: int = 32) -> RewardModel:
    """Any `AutoModelForSequenceClassification` directory with one label (a `posttrain rm` run's `final/`, the
    run directory itself, or a model from elsewhere) as a `RewardModel`."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    path = Path(path)
    if (path / "final" / "config.json").is_file():
        path = path / "final"
    if not (path / "config.json").is_file():
        raise ModelError(f"{path}: not a reward model (no config.json): expected a transformers "
                         "AutoModelForSequenceClassification directory with one label (train one with `posttrain rm`)")
    config = AutoConfig.from_pretrained(path)
    architectures = list(getattr(config, "architectures", None) or [])
    if not any(name.endswith("ForSequenceClassification") for name in architectures) or config.num_labels != 1:
        raise ModelError(f"{path}: not a reward model: config.json has architectures {architectures} and "
                         f"num_labels {config.num_labels}; expected a *ForSequenceClassification with num_labels 1")
    tokenizer = AutoTokenizer.from_pretrained(path)
    classifier = AutoModelForSequenceClassification.from_pretrained(path).to(device)
    stats = {"mean": 0.0, "std": 1.0}
    if (path / STATS_FILE).is_file():
        saved = json.loads((path / STATS_FILE).read_text())
        if saved.get("format") != STATS_FORMAT:
            raise ModelError(f"{path / STATS_FILE}: unknown format {saved.get('format')!r} (this version reads "
                             f"{STATS_FORMAT})")
        stats = {"mean": float(saved["mean"]), "std": float(saved["std"])}
    model = ScalarRewardModel.from_sequence_classifier(classifier)
    return RewardModel(model, tokenizer, stats, torch.device(device), normalize, batch_size)


def _is_single(items: Any) -> bool:
    """A conversation (list of message dicts) or one id list, rather than a batch of them."""
    if not isinstance(items, Sequence) or isinstance(items, (str, bytes)) or not items:
        raise ValueError("expected a conversation, a list of token ids, or a batch of either")
    first = items[0]
    return isinstance(first, dict) or isinstance(first, int) or (hasattr(first, "ndim") and first.ndim == 0)
