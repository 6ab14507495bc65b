"""The RL recipe: tasks -> rollouts (engine + environments) -> verifier rewards -> advantages -> policy update.

    posttrain rl recipe.yaml [--resume]
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from posttrain.config.common import (
    ClusterConfig,
    ModelConfig,
    OptimConfig,
    RuntimeConfig,
    Section,
    SpeculativeConfig,
    TrackingConfig,
)
from posttrain.config.eval import RegressionSuite
from posttrain.config.load import recipe


# A function term's default bound on one call; the judge's own default, posttrain.verify.rewards.FUNCTION_TIMEOUT_S,
# is the same (config imports nothing of ours; a test holds them equal)
FUNCTION_TIMEOUT_S = 120.0


class RewardTerm(Section):
    """One term of the RL reward (TRL's reward functions): a function of your own or a registered verifier.

    ``function: "my_rewards:brevity"`` (or ``"./file.py:name"``) is called as ``fn(completion, task)`` (sync or
    async) and returns a float; ``verifier: math`` runs that verifier with ``args`` (default: the task's own
    verifier arguments); ``verifier: task`` is the task's own verifier, whatever it is. The episode's score is
    ``sum(weight * term)`` (posttrain.verify.rewards); each term is logged as ``reward/<name>``.
    """

    function: str | None = None
    verifier: str | None = None
    args: dict[str, Any] | None = None  # verifier terms: its arguments (unset = the task's verifier_args)
    weight: float = 1.0
    name: str | None = None  # the logged name; default the function's or the verifier's name
    binary: bool = False  # verifier terms: 1 when the verifier passes, else 0 (no partial credit, e.g. the share of
    #                       code cases passed); the verifier's own score stays in the episode's details
    # function terms: seconds one call may take (null: no bound); past it the episode is an infrastructure
    # failure, retried and masked, not scored
    timeout_s: float | None = Field(FUNCTION_TIMEOUT_S, gt=0)

    @model_validator(mode="after")
    def _one_kind(self):
        if (self.function is None) == (self.verifier is None):
            raise ValueError("a reward term takes exactly one of function: 'module:function' or verifier: NAME")
        if self.function is not None and ":" not in self.function:
            raise ValueError(f"function: expected 'module:function' or 'file.py:function', got {self.function!r}")
        if self.function is not None and self.args is not None:
            raise ValueError("args: only a verifier term takes args (a function gets the completion and the task)")
        if self.function is not None and self.binary:
            raise ValueError("binary: only a verifier term has a verdict to score by (a function returns its score)")
        if self.verifier is not None and self.timeout_s != FUNCTION_TIMEOUT_S:
            raise ValueError("timeout_s: only a function term takes one (a verifier has its own time limits)")
        return self

    @property
    def label(self) -> str:
        return self.name or (self.function.rpartition(":")[2] if self.function else str(self.verifier))


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
    speculative: SpeculativeConfig = SpeculativeConfig()  # hf engine only; the draft is not trained along
    # hf engine: prefill a prompt once for all the episodes of a step that send it (a group's), as one request
    # with n samples; each keeps its seed stream. 2.5-3x faster sampling on the demo's code prompts; not
    # bit-identical to separate prefills (fp32 logprobs differ in the last bits): false gives those (docs/rollout.md)
    share_prompts: bool = True
    # hf engine on CPU: the fast decoder's linears through weights prepacked for oneDNN (fp32 ~2x where MKL runs
    # below the core's peak, bf16 faster and bit-identical; one more copy of the linear weights; docs/rollout.md)
    prepack_weights: bool = True


class PolicyLossConfig(Section):
    # group-relative estimators (one advantage per sequence), or "gae": PPO with a learned critic (the `critic:`
    # section), token-level GAE over the policy tokens (posttrain.rl.advantages)
    advantage: Literal["grpo", "dr_grpo", "rloo", "batch_norm", "gae"] = "grpo"
    scale_advantages: bool = True  # divide by the std (grpo, batch_norm)
    gamma: float = Field(1.0, ge=0, le=1)  # gae: discount per policy token
    lam: float = Field(0.95, ge=0, le=1)  # gae: GAE's lambda (1 = Monte Carlo returns, 0 = one-step TD)
    whiten_advantages: bool = True  # gae: (A - mean) / std over the batch's policy tokens
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
    # Leave the sequences whose advantage is exactly 0 (every token's, for GAE) out of the update's forward and
    # backward: with the KL and entropy terms off they carry exactly no gradient, so the step is the same with
    # fewer FLOPs (the denominators stay the whole batch's; off by itself when a term needs them: rl.update)
    skip_zero_advantage: bool = True

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


class RewardModelConfig(Section):
    """A learned reward component: a reward model (any `AutoModelForSequenceClassification` with one label, e.g.
    one `posttrain rm` trained) scores every trained trajectory's token ids (prompt + completion, exactly as
    sampled); `weight` x its score is added to the verifier's outcome."""

    path: str  # a `posttrain rm` run directory or its final/, or any one-label sequence-classification model dir
    weight: float = 1.0
    normalize: bool = True  # (r - mean) / std with the model's reward_stats.json (none there: mean 0, std 1)
    batch_size: int = Field(32, gt=0)  # sequences per scoring forward


class ProcessRewardModelConfig(Section):
    """A process reward model: a reward model (trained with `posttrain rm` on step-labelled pairs: the same prefix
    continued by a good and by a bad step) that scores every policy turn of a trained trajectory -- the token ids
    up to the end of that turn, exactly as sampled. The mean over the turns replaces the environment's step
    rewards as the reward's ``process`` component, which the return weighs by ``returns.process_weight``."""

    path: str  # a `posttrain rm` run directory or its final/, or any one-label sequence-classification model dir
    normalize: bool = True  # (r - mean) / std with the model's reward_stats.json
    batch_size: int = Field(32, gt=0)


class CriticConfig(Section):
    """The value model of `algorithm.advantage: gae`: a causal LM trunk with a scalar value head on every token."""

    path: str | None = None  # unset: a copy of the policy (value head at 0); or a reward model (as reward_model.path)
    value_coef: float = Field(1.0, gt=0)  # weight of the value loss (the critic has its own optimizer)
    value_clip: float | None = Field(0.2, gt=0)  # |V - V_old| clipped to this in the value loss; null = off
    optim: OptimConfig = OptimConfig(lr=1e-4, schedule="constant", max_grad_norm=1.0)


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
    # score a group's sequences in one row behind one copy of their prompt (posttrain.train.shared_prefix):
    # the same log-probs up to float rounding, ~1/group_size of the prompt tokens; checked families only
    shared_prefix: bool = False
    log_every: int = Field(1, gt=0)
    eval_every: int | None = None
    save_every: int | None = None
    keep_checkpoints: int = Field(2, gt=0)


# ---- the task schedule (posttrain.schedule; every knob is documented in docs/schedule.md) -----------------


class MixStage(Section):
    """Domain weights for the batches before `until_step` (the last stage may leave it unset: to the end)."""

    until_step: int | None = Field(None, gt=0)
    weights: dict[str, float]  # domain name -> weight; domains left out get 0 in this stage

    @model_validator(mode="after")
    def _some_weight(self):
        if any(weight < 0 for weight in self.weights.values()) or sum(self.weights.values()) <= 0:
            raise ValueError(f"a stage's weights must be >= 0 and not all 0, got {self.weights}")
        return self


class MixingConfig(Section):
    """Which share of the trained groups each domain gets."""

    mode: Literal["static", "staged", "adaptive"] = "static"
    stages: list[MixStage] = []  # staged: weights by step ranges
    # adaptive: weights = prior weight * exp(adapt_rate * (score - mean score)), with score per domain the
    # share of its groups that carry a learning signal ("learning_signal") or its failure rate ("worst_domain").
    objective: Literal["learning_signal", "worst_domain"] = "learning_signal"
    adapt_rate: float = Field(4.0, ge=0)
    signal_ema: float = Field(0.8, ge=0, lt=1)  # weight of the old value in the per-domain signal averages
    min_share: float = Field(0.05, ge=0, lt=1)  # adaptive: every domain keeps at least this share
    # Sample a domain whose groups get filtered (dynamic sampling, infrastructure failures) more, so the
    # shares that reach the trainer stay on target.
    compensate_filtering: bool = True
    min_keep_rate: float = Field(0.1, gt=0, le=1)  # compensation never samples more than 1/min_keep_rate times

    @model_validator(mode="after")
    def _stages_in_order(self):
        if self.mode == "staged" and not self.stages:
            raise ValueError("schedule.mixing.stages: staged mixing needs at least one stage")
        ends = [stage.until_step for stage in self.stages]
        if any(end is None for end in ends[:-1]):
            raise ValueError("schedule.mixing.stages: only the last stage may leave until_step unset")
        bounded = [end for end in ends if end is not None]
        if bounded != sorted(set(bounded)):
            raise ValueError(f"schedule.mixing.stages: until_step must increase, got {bounded}")
        return self


class CurriculumConfig(Section):
    """Per-domain difficulty levels (within the domain's `levels`) driven by the measured pass rate."""

    enabled: bool = True  # off: every fresh task's level is drawn uniformly from the domain's levels
    upper: float = Field(0.8, gt=0, le=1)  # pass rate at the current level at or above which it moves up
    lower: float = Field(0.2, ge=0, lt=1)  # ... at or below which it moves down
    min_episodes: int = Field(32, gt=0)  # episodes at the current level since the last move before another
    window: int = Field(128, gt=0)  # the pass rate is over the last `window` episodes at the current level
    start: dict[str, int] = {}  # domain -> starting level (default: the domain's lowest level)
    # share of fresh draws made at a level below the current one (uniformly among them): review, so that
    # training at the top level does not forget the levels it climbed through
    review: float = Field(0.0, ge=0, lt=1)

    @model_validator(mode="after")
    def _bands(self):
        if self.lower >= self.upper:
            raise ValueError(f"schedule.curriculum: lower ({self.lower}) must be below upper ({self.upper})")
        if self.window < self.min_episodes:
            raise ValueError("schedule.curriculum: window must be at least min_episodes")
        return self


class PriorityConfig(Section):
    """Which task of a domain's candidate pool is drawn next, by its measured pass rate s."""

    weighting: Literal["uniform", "variance", "failure"] = "variance"  # 4s(1-s) / 1-s / 1
    floor: float = Field(0.05, gt=0, le=1)  # the least weight a task gets
    pool_size: int = Field(32, gt=0)  # candidate tasks per domain (fresh ones top it up)
    max_visits: int = Field(4, gt=0)  # groups a task gets before it leaves the pool
    prior: float = Field(0.5, ge=0, le=1)  # pass rate assumed for a task never seen (before its level has data)
    retire_pass_rate: float = Field(0.95, gt=0, le=1)  # a task passing this reliably is retired ...
    retire_min_episodes: int = Field(8, gt=0)  # ... once it has this many episodes
    reprobe_prob: float = Field(0.02, ge=0, le=1)  # chance a draw re-probes a retired task instead
    max_retired: int = Field(1024, ge=0)  # retired tasks kept for re-probing (oldest forgotten first)


class DynamicSamplingConfig(Section):
    """Groups whose rewards are all equal carry no signal (zero advantage)."""

    # drop them and refill the batch (DAPO) / keep them with zero advantage (the default: a batch is then never
    # short, and a run behaves as without a scheduler; "drop" pays off once pass rates are near 0 or 1)
    mode: Literal["drop", "keep"] = "keep"
    max_extra_groups: float = Field(1.0, ge=0)  # cap on refill generation, a fraction of prompts_per_step
    max_rounds: int = Field(4, gt=0)  # generation rounds per batch, the first included


class GuardConfig(Section):
    """Forgetting guard: regression suites evaluated every `every` steps against their best."""

    enabled: bool = True
    every: int | None = Field(None, gt=0)  # steps between regression evaluations (default train.eval_every)
    baseline: bool = True  # evaluate once before the first step, so the starting model sets the bar
    threshold: float = Field(0.05, gt=0, le=1)  # a suite this far (absolute) below its best has regressed
    recover: float = Field(0.02, ge=0, le=1)  # ... and has recovered when back within this of its best
    action: Literal["weight", "replay", "both", "log"] = "both"
    boost: float = Field(2.0, ge=1)  # a regressed domain's share is multiplied by this ...
    boost_min_share: float = Field(0.1, ge=0, lt=1)  # ... and is at least this (an earlier domain now at 0)
    replay_coef: float = Field(0.1, ge=0)  # weight of the replay SFT loss added to the RL loss
    replay_samples: int = Field(8, gt=0)  # demonstrations per step, shared by the regressed domains
    replay_max_length: int = Field(512, gt=8)
    replay_reasoning: Literal["include", "drop"] = "include"  # as the SFT stage rendered reasoning traces
    suites: list[RegressionSuite] = []  # general suites, beside every domain's held-out items

    @model_validator(mode="after")
    def _recover_inside_threshold(self):
        if self.recover >= self.threshold:
            raise ValueError("schedule.guard: recover must be below threshold (hysteresis)")
        names = [suite.name for suite in self.suites]
        if len(names) != len(set(names)):
            raise ValueError(f"schedule.guard.suites: names must be unique, got {names}")
        return self


class AlarmConfig(Section):
    """Collapse alarms on the training signals, and what the run does when one fires."""

    enabled: bool = True
    action: Literal["log", "rollback"] = "log"  # rollback: to the last good checkpoint, lr * lr_decay
    warmup_steps: int = Field(10, ge=0)  # no alarm before this many steps (statistics settle)
    ema: float = Field(0.9, ge=0, lt=1)  # weight of the old value in the monitored averages
    spread_min_ratio: float = Field(0.25, ge=0, le=1)  # signal share below this x its peak: "spread_collapse"
    entropy_min_ratio: float = Field(0.25, ge=0, le=1)  # entropy below this x its peak: "entropy_collapse"
    spike_z: float = Field(8.0, ge=0)  # grad norm / loss beyond mean + z std: "grad_norm_spike" / "loss_spike"
    hacking_reward_rise: float = Field(0.05, ge=0)  # train reward up this much since the last evaluation ...
    hacking_heldout_drop: float = Field(0.05, ge=0)  # ... while held-out fell this much: "reward_hacking"
    lr_decay: float = Field(0.5, gt=0, le=1)
    max_rollbacks: int = Field(2, ge=0)


class ScheduleConfig(Section):
    mixing: MixingConfig = MixingConfig()
    curriculum: CurriculumConfig = CurriculumConfig()
    priority: PriorityConfig = PriorityConfig()
    dynamic_sampling: DynamicSamplingConfig = DynamicSamplingConfig()
    dedup_window: int = Field(4, ge=0)  # steps within which a task is not drawn again (0 = off)
    infra_requeues: int = Field(2, ge=0)  # times a task whose group was lost to infrastructure is re-queued
    stats_ema: float = Field(0.5, ge=0, lt=1)  # weight of the old value in a task's pass-rate average
    max_tracked_tasks: int = Field(100_000, gt=0)  # per-task statistics kept (least recently seen dropped)
    guard: GuardConfig = GuardConfig()
    alarms: AlarmConfig = AlarmConfig()


class RLRuntimeConfig(RuntimeConfig):
    """`RuntimeConfig` with RL's default: compile long runs (bench/rl_step.py: a compiled synchronous step is
    ~1.6x an eager one on 2 CPU cores), stay eager for short ones (docs/benchmarks.md)."""

    compile: bool | Literal["auto"] = "auto"


@recipe("rl")
class RLRecipe(Section):
    stage: Literal["rl"] = "rl"
    imports: list[str] = []  # your modules / .py files, imported first in every process (posttrain.usercode)
    output_dir: str = "runs/rl"
    model: ModelConfig = ModelConfig()
    domains: list[DomainConfig] = [DomainConfig(name="arithmetic", levels=[2])]
    rollout: RolloutConfig = RolloutConfig()
    algorithm: PolicyLossConfig = PolicyLossConfig()
    returns: ReturnConfig = ReturnConfig()
    # the reward as terms (functions of your own, verifiers) summed with their weights; empty: each task's own
    # verifier alone
    rewards: list[RewardTerm] = []
    reward_model: RewardModelConfig | None = None  # a learned reward component beside the verifiers
    process_reward_model: ProcessRewardModelConfig | None = None  # per-turn scores as the process component
    critic: CriticConfig = CriticConfig()  # used by algorithm.advantage: gae
    pipeline: PipelineConfig = PipelineConfig()
    optim: OptimConfig = OptimConfig(lr=1e-4, schedule="constant", max_grad_norm=1.0)
    train: RLTrainConfig = RLTrainConfig()
    runtime: RLRuntimeConfig = RLRuntimeConfig()
    tracking: TrackingConfig = TrackingConfig()
    schedule: ScheduleConfig = ScheduleConfig()
    cluster: ClusterConfig = ClusterConfig()  # local, or a Ray cluster (posttrain.distributed)

    @model_validator(mode="after")
    def _schedule_names_domains(self):
        names = [spec.name for spec in self.domains]
        if len(names) != len(set(names)):
            twice = sorted({name for name in names if names.count(name) > 1})
            raise ValueError(f"domains: each domain may appear once, got {names}; to use a file-backed domain "
                             f"twice, label each use: name: {twice[0]}/<label> (e.g. tasks/humaneval)")
        levels = {spec.name: spec.levels for spec in self.domains}
        mixing = self.schedule.mixing
        for index, stage in enumerate(mixing.stages):
            for name in stage.weights:
                if name not in levels:
                    raise ValueError(f"schedule.mixing.stages.{index}.weights: unknown domain '{name}' "
                                     f"(the recipe's domains: {', '.join(names)})")
        if mixing.mode == "adaptive" and mixing.min_share * len(names) >= 1:
            raise ValueError("schedule.mixing.min_share: the floors of all domains must leave room (< 1 in all)")
        for name, level in self.schedule.curriculum.start.items():
            if name not in levels:
                raise ValueError(f"schedule.curriculum.start: unknown domain '{name}'")
            if level not in levels[name]:
                raise ValueError(f"schedule.curriculum.start.{name}: level {level} is not in {levels[name]}")
        if self.cluster.context_parallel != 1:
            raise ValueError("cluster.context_parallel: context parallelism is wired into the sft recipe only; "
                             "an RL recipe takes 1 (the default)")
        # a critic section as the defaults leave it is no request (a saved recipe writes every section out)
        if self.critic != CriticConfig() and self.algorithm.advantage != "gae":
            raise ValueError(f"critic: the critic is used only with algorithm.advantage: gae "
                             f"(it is '{self.algorithm.advantage}'): set it, or drop the critic section")
        labels = [term.label for term in self.rewards]
        if len(labels) != len(set(labels)):
            raise ValueError(f"rewards: each term needs its own name (set name:), got {labels}")
        taken = set(labels) & (set(names) | {"mean", "pass_rate"})  # each is logged as reward/<name>, as these are
        if taken:
            raise ValueError(f"rewards: term names {sorted(taken)} are taken by reward/<domain>, reward/mean or "
                             f"reward/pass_rate; give the term another name (name: ...)")
        if self.rollout.speculative.draft is not None and self.rollout.engine != "hf":
            raise ValueError("rollout.speculative: speculative decoding is the built-in engine's (rollout.engine: hf); "
                             "vLLM has its own speculative settings")
        if self.model.path is None and self.rollout.engine == "vllm":
            raise ValueError("rollout.engine: vllm needs model.path (a model directory or hub id); the fresh built-in "
                             "model an RL run builds without one exists only in this process")
        clash = {suite.name for suite in self.schedule.guard.suites} & set(names)
        if clash:
            raise ValueError(f"schedule.guard.suites: names {sorted(clash)} are domain names (held-out suites)")
        return self
