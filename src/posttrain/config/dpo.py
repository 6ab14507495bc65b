"""Preference recipes: DPO and its variants (`posttrain dpo`), and Bradley–Terry reward models (`posttrain rm`).

Both read preference pairs (a prompt, a chosen and a rejected response; see `posttrain.data.preference`).
The loss formulas are in docs/dpo.md; the reward model's saved format in `posttrain.models.reward`.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from posttrain.config.common import ModelConfig, OptimConfig, RuntimeConfig, Section, TrackingConfig
from posttrain.config.load import recipe
from posttrain.config.sft import DataSource, SFTTrainConfig


class PreferenceDataConfig(Section):
    train: list[DataSource] = []
    heldout: list[DataSource] = []
    heldout_fraction: float = Field(0.0, ge=0, lt=1)  # split by a hash of the prompt when no heldout is given
    # prompt + response tokens; a longer response is cut at the end (counted in the data report), a pair
    # whose prompt alone leaves no room for a response is invalid.
    max_length: int = Field(512, gt=8)
    on_invalid: Literal["error", "skip"] = "error"  # skip = count them and write a rejects file


class PreferenceTrainConfig(SFTTrainConfig):
    """The SFT loop's knobs; `batch_size` and `micro_batch_size` count pairs (each pair is two sequences)."""

    # Pairs per forward when computing the reference log-probs once before training (no gradients, so it
    # can be larger than the training micro-batch); unset = 2 x the micro-batch.
    reference_batch_size: int | None = Field(None, gt=0)


class DPOLossConfig(Section):
    """Which preference loss, and its parameters (formulas in docs/dpo.md).

    sigmoid  DPO (Rafailov et al., 2023): -log sigmoid(beta * (chosen log-ratio - rejected log-ratio))
    cdpo     conservative DPO: sigmoid DPO with labels flipped with probability `label_smoothing`
    ipo      IPO (Azar et al., 2023): (log-ratio difference - 1 / (2 beta))^2, beta is the paper's tau
    simpo    SimPO (Meng et al., 2024): reference-free, -log sigmoid(beta * (avg logp chosen - avg logp
             rejected) - gamma)
    """

    loss: Literal["sigmoid", "cdpo", "ipo", "simpo"] = "sigmoid"
    beta: float = Field(0.1, gt=0)
    label_smoothing: float = Field(0.1, ge=0, lt=0.5)  # cdpo only: the assumed label-flip probability
    gamma: float = Field(0.5, ge=0)  # simpo only: the target reward margin
    # Per-token mean instead of summed log-probs. Unset: on for simpo and ipo (the squared IPO loss grows
    # with the response length otherwise), off for sigmoid and cdpo, as in their papers.
    length_normalize: bool | None = None
    # The reference policy. Unset: the initial policy itself (with LoRA: the base with the adapter off).
    # Reference log-probs are computed once before training and cached with the run, so no reference
    # model is kept in memory while training.
    reference_path: str | None = None

    @property
    def normalizes_length(self) -> bool:
        if self.length_normalize is not None:
            return self.length_normalize
        return self.loss in ("simpo", "ipo")

    @property
    def uses_reference(self) -> bool:
        return self.loss != "simpo"


@recipe("dpo")
class DPORecipe(Section):
    stage: Literal["dpo"] = "dpo"
    imports: list[str] = []  # your modules / .py files, imported first in every process (posttrain.usercode)
    output_dir: str = "runs/dpo"
    model: ModelConfig = ModelConfig()
    data: PreferenceDataConfig = PreferenceDataConfig()
    dpo: DPOLossConfig = DPOLossConfig()
    optim: OptimConfig = OptimConfig(lr=1e-4)
    train: PreferenceTrainConfig = PreferenceTrainConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    tracking: TrackingConfig = TrackingConfig()

    @model_validator(mode="after")
    def _reference_needs_a_reference_loss(self):
        if self.dpo.reference_path is not None and not self.dpo.uses_reference:
            raise ValueError("dpo.reference_path is set but dpo.loss 'simpo' uses no reference model")
        return self


class RMLossConfig(Section):
    """The reward model's loss (`rm:`). Not `RewardModelConfig`: that is RL's `reward_model:` section."""

    # Eisenstein et al. (2023)'s centring term, coef * (r_chosen + r_rejected)^2: keeps rewards near zero
    # mean, which the Bradley–Terry loss alone leaves free (it only sees differences).
    center_coef: float = Field(0.0, ge=0)
    # Pairs (train, then held-out) whose rewards give the mean/std saved with the model for normalising.
    stats_pairs: int = Field(1024, ge=0)


@recipe("rm")
class RMRecipe(Section):
    stage: Literal["rm"] = "rm"
    imports: list[str] = []  # your modules / .py files, imported first in every process (posttrain.usercode)
    output_dir: str = "runs/rm"
    model: ModelConfig = ModelConfig()
    data: PreferenceDataConfig = PreferenceDataConfig()
    rm: RMLossConfig = RMLossConfig()
    optim: OptimConfig = OptimConfig(lr=1e-4)
    train: PreferenceTrainConfig = PreferenceTrainConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    tracking: TrackingConfig = TrackingConfig()

    @model_validator(mode="after")
    def _saved_whole(self):
        lora = self.model.lora
        if lora.enabled and not lora.merge_on_save:
            raise ValueError("model.lora.merge_on_save: false is not available for rm: a reward model is saved as "
                             "a whole AutoModelForSequenceClassification (set it true; the checkpoints keep the "
                             "adapter)")
        return self
