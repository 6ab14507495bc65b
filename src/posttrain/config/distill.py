"""The distillation recipe (`posttrain distill`): a teacher and a smaller student that share a tokenizer.

Three modes (docs/tiers.md):

    logit       the student matches the teacher's next-token distributions on completion tokens: of SFT data
                (`data.train`), or of the teacher's own answers to task prompts (`tasks.domains`)
    on_policy   GKD: the student samples answers to task prompts, the teacher scores every sampled token, and
                the loss is on the student's own samples (a `data_fraction` of each batch from `data.train`)
    sequence    the teacher's verified answers to task prompts (the task's verifier passes) become SFT data,
                and the student is fine-tuned on them with cross-entropy
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from posttrain.config.common import ModelConfig, OptimConfig, RuntimeConfig, Section, TrackingConfig
from posttrain.config.load import ConfigError, recipe
from posttrain.config.rl import DomainConfig
from posttrain.config.sft import SFTDataConfig, SFTTrainConfig


class DistillLossConfig(Section):
    """The divergence (formulas in `posttrain.train.distill_losses`), per completion token.

    forward_kl  KL(teacher ‖ student)      reverse_kl  KL(student ‖ teacher)
    jsd         GKD's generalized JSD(β):  β → 0 behaves like forward KL, β → 1 like reverse KL
    """

    loss: Literal["forward_kl", "reverse_kl", "jsd"] = "forward_kl"
    beta: float = Field(0.5, ge=0, le=1)  # jsd only
    temperature: float = Field(1.0, gt=0)  # both distributions are softmax(logits / temperature); loss x T^2
    # on_policy: the share of each batch's sequences taken from data.train instead of student samples
    # (GKD's lambda, the student-data fraction, is 1 - data_fraction)
    data_fraction: float = Field(0.0, ge=0, lt=1)


class DistillTasksConfig(Section):
    """Task prompts (posttrain.tasks domains), answered by the teacher (logit, sequence) or the student (on_policy)."""

    domains: list[DomainConfig] = []
    prompts: int = Field(256, gt=0)  # logit / sequence: tasks the teacher answers once, before training
    samples_per_prompt: int = Field(1, gt=0)  # sequence: teacher samples per task; the verified ones are kept
    max_new_tokens: int = Field(64, gt=0)
    temperature: float = Field(1.0, ge=0)  # 0 = greedy
    engine_batch_size: int = Field(64, gt=0)  # sequences per engine forward


@recipe("distill")
class DistillRecipe(Section):
    stage: Literal["distill"] = "distill"
    imports: list[str] = []  # your modules / .py files, imported first in every process (posttrain.usercode)
    output_dir: str = "runs/distill"
    mode: Literal["logit", "on_policy", "sequence"] = "logit"
    teacher: ModelConfig = ModelConfig()  # `path` required: the trained model to distil
    # The student. Without model.path a fresh built-in model of `model.preset` is built on the teacher's tokenizer.
    model: ModelConfig = ModelConfig(preset="tiny-1m")
    distill: DistillLossConfig = DistillLossConfig()
    data: SFTDataConfig = SFTDataConfig()
    tasks: DistillTasksConfig = DistillTasksConfig()
    optim: OptimConfig = OptimConfig()
    train: SFTTrainConfig = SFTTrainConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    tracking: TrackingConfig = TrackingConfig()

    @model_validator(mode="after")
    def _settings_fit_the_mode(self):
        if self.teacher.lora.enabled:
            raise ValueError("teacher.lora: the teacher is frozen; merge its adapter first (posttrain export)")
        if self.mode == "on_policy" and self.train.max_steps is None:
            raise ValueError("mode on_policy: set train.max_steps (every step samples fresh prompts; no epochs)")
        if self.mode != "on_policy" and self.distill.data_fraction > 0:
            raise ValueError(f"distill.data_fraction applies to mode on_policy, not {self.mode}")
        if self.mode == "sequence" and self.distill.loss != "forward_kl":
            raise ValueError("mode sequence trains with cross-entropy on the teacher's verified answers; "
                             "distill.loss does not apply (leave it at forward_kl)")
        if self.train.early_stopping_patience is not None:
            raise ValueError("train.early_stopping_patience: not supported by distill (eval/kl is logged every "
                             "train.eval_every steps; set train.max_steps)")
        if self.data.streaming:
            raise ValueError("data.streaming: not supported by distill (the teacher scores rows in memory)")
        return self

    def check_sources(self) -> None:
        """What a run needs beyond the schema (the demo fills these in, so a default recipe may lack them):
        a teacher, and the data or task prompts its mode reads. Raises `ConfigError` naming the key."""
        if self.teacher.path is None:
            raise ConfigError("teacher.path: distillation needs a trained teacher (a Hugging Face model directory)")
        has_data, has_tasks = bool(self.data.train), bool(self.tasks.domains)
        if self.mode == "logit" and has_data == has_tasks:
            raise ConfigError("mode logit: give exactly one of data.train (SFT data) or tasks.domains (task "
                              "prompts the teacher answers)")
        if self.mode in ("on_policy", "sequence") and not has_tasks:
            raise ConfigError(f"mode {self.mode}: tasks.domains names the task prompts (e.g. [{{name: arithmetic}}])")
        if self.mode == "on_policy" and self.distill.data_fraction > 0 and not has_data:
            raise ConfigError("distill.data_fraction > 0 mixes in data.train, which is empty")
