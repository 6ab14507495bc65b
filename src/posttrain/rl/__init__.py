"""Reinforcement learning with verifiable rewards: returns and advantages, the RL update, the rollout pipeline,
the forgetting guard and the recipe that runs them (`posttrain rl`; docs/rl.md; the loop: `rl.trainer`).

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
from posttrain.rl.learned import Critic, LearnedReward, make_critic
from posttrain.rl.guarding import RunGuard
from posttrain.rl.pipeline import BatchProducer, RolloutBatch, RolloutPipeline, episode_record
from posttrain.rl.update import LocalPolicy, UpdateSettings, engine_state, make_reference, rl_update
from posttrain.rl.trainer import RLResult, run_rl, run_rl_on
from posttrain.rl.pipeline import engine_rollout
from posttrain.rl.starting_model import starting_tokenizer

__all__ = [
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
