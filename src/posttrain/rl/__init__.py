"""Reinforcement learning with verifiable rewards: the recipe (`posttrain rl`; docs/rl.md) in seven modules that
read in the order of one step (`rl.trainer._iteration`: batch -> returns -> advantages -> update -> weights -> guard):

    trainer      the recipe, top to bottom: tokenizer and policy -> backend -> self-test -> iterations -> checkpoint
    pipeline     batch: rollouts ahead of training by a bounded staleness, dynamic sampling, what is recorded
    advantages   returns (outcome, costs, shaping, reward terms) and the advantage estimators (group-relative, GAE)
    learned      the learned models: a reward model and a process reward model in the return, PPO's critic
    update       the update (`UpdateSettings`, `rl_update`) and the policy that takes it (`LocalPolicy`)
    backend      where the policy trains and rollouts run (`RLBackend`), its engine, the start-up self-test
    guarding     the forgetting guard and collapse alarms; its suites evaluated through `posttrain.evaluate`

    from posttrain.rl import run_rl
    result = run_rl(load_recipe("rl.yaml", schema=RLRecipe))
"""

from posttrain.rl.advantages import (
    compute_advantages,
    episode_return,
    gae_advantages,
    normalize_per_domain,
    reward_metrics,
    reward_terms,
    with_rewards,
)
from posttrain.rl.backend import (
    EngineAnswerSampler,
    RLBackend,
    SelfTestError,
    engine_trainer_self_test,
    local_backend,
)
from posttrain.rl.guarding import RunGuard
from posttrain.rl.learned import Critic, LearnedReward, make_critic
from posttrain.rl.pipeline import BatchProducer, RolloutBatch, RolloutPipeline, engine_rollout, episode_record
from posttrain.rl.trainer import RLResult, run_rl, run_rl_on, starting_tokenizer
from posttrain.rl.vision import (
    ProcessorRenderer,
    VisionGRPOResult,
    image_engine,
    load_vision_policy,
    policy_processor,
    run_vision_grpo,
    vision_grpo_update,
    wants_vision,
)
from posttrain.rl.update import LocalPolicy, UpdateSettings, engine_state, make_reference, rl_update

__all__ = [
    "VisionGRPOResult",
    "ProcessorRenderer",
    "image_engine",
    "load_vision_policy",
    "policy_processor",
    "wants_vision",
    "vision_grpo_update",
    "run_vision_grpo",
    "BatchProducer",
    "Critic",
    "EngineAnswerSampler",
    "LearnedReward",
    "LocalPolicy",
    "RLBackend",
    "RLResult",
    "RolloutBatch",
    "RolloutPipeline",
    "RunGuard",
    "SelfTestError",
    "UpdateSettings",
    "compute_advantages",
    "engine_rollout",
    "engine_state",
    "engine_trainer_self_test",
    "episode_record",
    "episode_return",
    "gae_advantages",
    "local_backend",
    "make_critic",
    "make_reference",
    "normalize_per_domain",
    "reward_metrics",
    "reward_terms",
    "rl_update",
    "run_rl",
    "run_rl_on",
    "starting_tokenizer",
    "with_rewards",
]
