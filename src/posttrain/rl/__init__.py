"""Reinforcement learning with verifiable rewards: advantages, returns, the RL update, the rollout pipeline
and the recipe that runs them (`posttrain rl`; docs/rl.md).

    from posttrain.rl import run_rl
    result = run_rl(load_recipe("rl.yaml", schema=RLRecipe))
"""

from posttrain.rl.advantages import compute_advantages, gae_advantages, normalize_per_domain
from posttrain.rl.backend import LocalPolicy, RLBackend, engine_state, local_backend
from posttrain.rl.critic import Critic, make_critic
from posttrain.rl.learned_reward import LearnedReward
from posttrain.rl.pipeline import RolloutBatch, RolloutPipeline
from posttrain.rl.records import episode_record
from posttrain.rl.returns import episode_return
from posttrain.rl.selftest import SelfTestError, engine_trainer_self_test
from posttrain.rl.step import rl_update
from posttrain.rl.trainer import RLResult, run_rl, run_rl_on

__all__ = [
    "Critic",
    "LearnedReward",
    "LocalPolicy",
    "RLBackend",
    "RLResult",
    "RolloutBatch",
    "RolloutPipeline",
    "SelfTestError",
    "compute_advantages",
    "engine_state",
    "engine_trainer_self_test",
    "episode_record",
    "episode_return",
    "gae_advantages",
    "local_backend",
    "make_critic",
    "normalize_per_domain",
    "rl_update",
    "run_rl",
    "run_rl_on",
]
