"""The RL recipe: tasks -> rollouts (engine + environments) -> verifier rewards -> advantages -> policy update.

    posttrain rl recipe.yaml [--resume]
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from posttrain.config.common import ModelConfig, OptimConfig, RuntimeConfig, Section, TrackingConfig
from posttrain.config.load import recipe


class DomainConfig(Section):
    """One task domain in the RL mix."""

    name: str  # a registered domain (posttrain.tasks), e.g. arithmetic, extraction, calculator
    weight: float = Field(1.0, ge=0)
    levels: list[int] = [1]  # difficulty levels to draw from (the curriculum may move within them)
    args: dict[str, Any] = {}  # keyword arguments of the domain's generator
    heldout: int = Field(100, ge=0)  # held-out items evaluated during and after the run


class SamplingConfig(Section):
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    max_new_tokens: int = Field(64, gt=0)
    group_size: int = Field(8, gt=0)  # completions per prompt (GRPO's G)


class RolloutConfig(Section):
    engine: Literal["hf", "vllm"] = "hf"
    prompts_per_step: int = Field(16, gt=0)
    sampling: SamplingConfig = SamplingConfig()
    max_concurrent_episodes: int = Field(256, gt=0)
    infra_retries: int = Field(2, ge=0)  # re-run an episode that failed for infrastructure reasons
    engine_batch_size: int = Field(256, gt=0)  # sequences per engine forward
    engine_threads: int | None = None  # torch threads of the rollout side when overlapping with training


class PolicyLossConfig(Section):
    advantage: Literal["grpo", "dr_grpo", "rloo", "batch_norm"] = "grpo"
    scale_advantages: bool = True  # divide by the std (grpo, batch_norm)
    normalize_per_domain: bool = False
    clip_low: float = Field(0.2, ge=0)
    clip_high: float = Field(0.2, ge=0)  # > clip_low: DAPO's clip-higher
    dual_clip: float | None = Field(None, gt=1)
    ratio_level: Literal["token", "sequence"] = "token"  # sequence = GSPO
    aggregation: Literal["token_mean", "seq_mean", "constant"] = "token_mean"
    # old policy of the ratio: the engine's behaviour log-probs, or the trainer's own log-probs before the
    # update ("proximal") with truncated importance weights proximal/behaviour capped at `tis_cap`.
    old_policy: Literal["behaviour", "proximal"] = "behaviour"
    tis_cap: float | None = Field(None, gt=0)
    kl_coef: float = Field(0.0, ge=0)  # > 0 loads a reference model (LoRA: the adapter switched off)
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    entropy_coef: float = 0.0

    @model_validator(mode="after")
    def _tis_needs_proximal(self):
        if self.tis_cap is not None and self.old_policy != "proximal":
            raise ValueError("algorithm.tis_cap weights proximal/behaviour: set algorithm.old_policy=proximal")
        return self


class ReturnConfig(Section):
    """How an episode's return is built from its parts (each part is logged separately)."""

    step_cost: float = Field(0.0, ge=0)  # subtracted per environment step beyond the first
    token_cost: float = Field(0.0, ge=0)  # subtracted per policy token
    process_weight: float = 0.0  # weight of process rewards the environment reports
    overlong: Literal["none", "mask", "penalty"] = "none"
    overlong_buffer: int = Field(16, ge=0)  # soft penalty ramps over the last N tokens before the limit
    overlong_penalty: float = Field(1.0, ge=0)


class PipelineConfig(Section):
    max_staleness: int = Field(0, ge=0)  # policy versions a trajectory may lag; 0 = synchronous on-policy
    overlap: bool = True  # produce rollouts on a thread of their own (with max_staleness > 0: while training)
    stale: Literal["drop", "reweight"] = "drop"  # beyond max_staleness (multi-turn episodes spanning updates)
    self_test: bool = True
    self_test_tolerance: float | None = None  # max |engine - trainer| logprob; default by precision


class RLTrainConfig(Section):
    max_steps: int = Field(100, gt=0)
    max_minutes: float | None = None
    micro_batch_size: int = Field(64, gt=0)  # sequences per forward/backward
    updates_per_batch: int = Field(1, gt=0)  # optimizer steps per rollout batch (PPO mini-batches)
    log_every: int = Field(1, gt=0)
    eval_every: int | None = None
    save_every: int | None = None
    keep_checkpoints: int = Field(2, gt=0)


@recipe("rl")
class RLRecipe(Section):
    stage: Literal["rl"] = "rl"
    output_dir: str = "runs/rl"
    model: ModelConfig = ModelConfig()
    domains: list[DomainConfig] = [DomainConfig(name="arithmetic", levels=[2])]
    rollout: RolloutConfig = RolloutConfig()
    algorithm: PolicyLossConfig = PolicyLossConfig()
    returns: ReturnConfig = ReturnConfig()
    pipeline: PipelineConfig = PipelineConfig()
    optim: OptimConfig = OptimConfig(lr=1e-4, schedule="constant", max_grad_norm=1.0)
    train: RLTrainConfig = RLTrainConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    tracking: TrackingConfig = TrackingConfig()
