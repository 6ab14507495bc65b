"""RLHF in the RL stage: GAE and the clipped value loss by hand, PPO with a learned critic on a tiny model, a
reward model as a weighted reward component, and an exact resume of a run with both."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_rl_pipeline import DigitDomain  # noqa: F401 (registers the test_digits domain and its verifier)
from test_rl_step import agentic_trajectory, make_trajectory, sequence_logprob

from posttrain.config import ConfigError, load_recipe
from posttrain.config.rl import ReturnConfig, RewardModelConfig, RLRecipe
from posttrain.models import ScalarRewardModel, build_tiny_model, load_reward_model, save_reward_model
from posttrain.rl.advantages import gae_advantages, whiten
from posttrain.rl.learned import LEARNED_REWARD_KEY, LearnedReward, make_critic
from posttrain.rl.advantages import episode_return
from posttrain.rl.update import UpdateSettings, collate_trajectories, rl_update
from posttrain.rl.trainer import run_rl
from posttrain.train import Runtime, build_optimizer
from posttrain.train.policy_loss import clipped_value_loss

ROOT = Path(__file__).resolve().parents[1]
RUNTIME = Runtime(device=torch.device("cpu"), autocast_dtype=None)


# ---- GAE and the value loss, by hand ------------------------------------------------------------------------


def test_gae_by_hand():
    values = [torch.tensor([0.5, 0.2, 0.1])]
    advantages, targets = gae_advantages([1.0], values, gamma=0.9, lam=0.8)
    # deltas: 0.9*0.2 - 0.5 = -0.32, 0.9*0.1 - 0.2 = -0.11, 1 - 0.1 = 0.9; gamma*lam = 0.72
    expected = [-0.32 + 0.72 * (-0.11 + 0.72 * 0.9), -0.11 + 0.72 * 0.9, 0.9]
    torch.testing.assert_close(advantages[0], torch.tensor(expected))
    torch.testing.assert_close(targets[0], torch.tensor(expected) + values[0])
    assert targets[0][-1].item() == pytest.approx(1.0)  # the return lands on the last policy token


@pytest.mark.parametrize("gamma, lam, expected", [
    (1.0, 1.0, [1.0 - 0.5, 1.0 - 0.2, 1.0 - 0.1]),  # Monte Carlo: A_k = R - V_k
    (1.0, 0.0, [0.2 - 0.5, 0.1 - 0.2, 1.0 - 0.1]),  # one-step TD: A_k = delta_k
    (0.5, 1.0, [0.25 - 0.5, 0.5 - 0.2, 1.0 - 0.1]),  # discounted Monte Carlo: gamma^(K-1-k) R - V_k
])
def test_gae_limits(gamma, lam, expected):
    advantages, _ = gae_advantages([1.0], [torch.tensor([0.5, 0.2, 0.1])], gamma=gamma, lam=lam)
    torch.testing.assert_close(advantages[0], torch.tensor(expected))


def test_gae_episodes_are_independent_and_whitening_spans_the_batch():
    advantages, _ = gae_advantages([2.0, 0.0], [torch.zeros(1), torch.zeros(2)], gamma=1.0, lam=1.0)
    assert [a.tolist() for a in advantages] == [[2.0], [0.0, 0.0]]
    white = whiten(advantages)
    flat = torch.cat(white)
    assert flat.mean().abs() < 1e-6 and flat.std().item() == pytest.approx(1.0, abs=1e-5)
    assert [len(w) for w in white] == [1, 2]


def test_clipped_value_loss_by_hand():
    values = torch.tensor([1.0, 0.0, 0.5], requires_grad=True)
    old = torch.tensor([0.5, 0.5, 0.5])
    targets = torch.tensor([1.0, 1.0, 0.0])
    per_token, stats = clipped_value_loss(values, old, targets, clip=0.2)
    # token 0: unclipped 0, clipped (0.7 - 1)^2 = 0.09 -> the clipped one, whose value cannot move further
    # token 1: unclipped 1, clipped (0.3 - 1)^2 = 0.49 -> the unclipped one
    # token 2: V = V_old, both 0.25
    torch.testing.assert_close(per_token, torch.tensor([0.045, 0.5, 0.125]))
    assert stats["value_clip_fraction"] == pytest.approx(1 / 3)
    per_token.sum().backward()
    torch.testing.assert_close(values.grad, torch.tensor([0.0, -1.0, 0.5]))
    unclipped, stats = clipped_value_loss(values.detach(), old, targets, clip=None)
    torch.testing.assert_close(unclipped, torch.tensor([0.0, 0.5, 0.125]))
    assert stats["value_clip_fraction"] == 0.0


# ---- the critic on exact tokens --------------------------------------------------------------------------


def gae_recipe(**critic) -> RLRecipe:
    return RLRecipe.model_validate({"algorithm": {"advantage": "gae", "lam": 1.0, "whiten_advantages": False},
                                    "critic": critic, "train": {"max_steps": 20, "micro_batch_size": 2}})


def test_per_token_advantages_and_values_fall_on_policy_tokens_only(tiny_model, tiny_tokenizer):
    trajectory = agentic_trajectory(tiny_model)
    micro = collate_trajectories([trajectory], [[0.1, 0.2, 0.3]], pad_id=0, device=torch.device("cpu"))
    assert micro.targets.tolist() == [20, 21, 22]
    torch.testing.assert_close(micro.advantages, torch.tensor([0.1, 0.2, 0.3]))
    with pytest.raises(ValueError, match="2 advantages for 3 policy tokens"):
        collate_trajectories([trajectory], [[0.1, 0.2]], pad_id=0, device=torch.device("cpu"))

    critic = make_critic(gae_recipe(), tiny_model, tiny_tokenizer, RUNTIME)
    assert critic.values([trajectory])[0].tolist() == [0.0, 0.0, 0.0]  # a fresh value head reads 0
    with torch.no_grad():
        critic.model.head.weight.normal_()
        hidden = critic.model._hidden(torch.tensor([trajectory.token_ids]))[0]
    values = critic.values([trajectory])[0]
    # the state before each policy token: positions 2, 3 (first turn) and 6 (after the observation)
    torch.testing.assert_close(values, critic.model.head(hidden[[2, 3, 6]]).squeeze(-1).detach())


def test_the_critic_learns_the_returns_of_fixed_episodes(tiny_model, tiny_tokenizer):
    prompt, good, bad = [3, 30, 31, 1, 5], [40, 41, 1], [42, 43, 1]
    critic = make_critic(gae_recipe(optim={"lr": 1e-3, "schedule": "constant"}), tiny_model, tiny_tokenizer, RUNTIME)
    trajectories = [make_trajectory(tiny_model, prompt, c, s) for c, s in [(good, 1.0), (bad, 0.0)] * 2]
    losses = []
    for _ in range(15):
        values = critic.values(trajectories)
        _, targets = gae_advantages([t.reward.score for t in trajectories], values, 1.0, 1.0)
        losses.append(critic.update(trajectories, values, targets)["critic/value_loss"])
    assert losses[0] == pytest.approx(0.25)  # values 0, targets 1 and 0: 1/2 mean (V - G)^2
    assert losses[-1] < 0.3 * losses[0]  # measured: 0.25 -> 0.045 (the floor: the shared prompt state, 0.042)
    good_values, bad_values = critic.values(trajectories[:2])
    assert good_values[0] == bad_values[0]  # the same state before the first token: one value, near the mean
    assert good_values[-1] > 0.8 and bad_values[-1] < 0.3  # measured: 0.98 and 0.12


def test_ppo_with_a_critic_raises_the_rewarded_completion(tiny_model, tiny_tokenizer):
    prompt, good, bad = [3, 30, 31, 1, 5], [40, 41, 1], [42, 43, 1]
    before_good = sum(sequence_logprob(tiny_model, prompt, good))
    before_bad = sum(sequence_logprob(tiny_model, prompt, bad))
    recipe = gae_recipe(optim={"lr": 1e-3, "schedule": "constant"})
    critic = make_critic(recipe, tiny_model, tiny_tokenizer, RUNTIME)
    optimizer = build_optimizer(tiny_model, recipe.optim.model_copy(update={"lr": 1e-2, "max_grad_norm": None}))
    for _ in range(12):
        trajectories = [make_trajectory(tiny_model, prompt, c, s) for c, s in [(good, 1.0), (bad, 0.0)] * 2]
        values = critic.values(trajectories)
        advantages, targets = gae_advantages([t.reward.score for t in trajectories], values, 1.0, 1.0)
        rl_update(tiny_model, optimizer, None, trajectories, [a.tolist() for a in whiten(advantages)],
                  UpdateSettings(loss=recipe.algorithm, runtime=RUNTIME, pad_id=tiny_tokenizer.pad_token_id,
                                 temperature=1.0, micro_batch_size=2, max_grad_norm=None))
        critic.update(trajectories, values, targets)
    assert sum(sequence_logprob(tiny_model, prompt, good)) > before_good + 1.0
    assert sum(sequence_logprob(tiny_model, prompt, bad)) < before_bad
    good_values, bad_values = critic.values(trajectories[:2])
    assert good_values[-1] > bad_values[-1] + 0.3  # once the completions differ, so do their values


# ---- the reward model as a reward component --------------------------------------------------------------


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory, tiny_tokenizer):
    """A tiny reward model built directly (random trunk and head): a fixed function of the token ids."""
    path = tmp_path_factory.mktemp("rm") / "final"
    model = ScalarRewardModel.from_causal_lm(build_tiny_model("tiny-1m", tiny_tokenizer, seed=3))
    return save_reward_model(path, model, tiny_tokenizer, mean=0.05, std=0.5)


def test_learned_reward_adds_its_weighted_score_to_the_return(reward_model_dir, tiny_model, tiny_tokenizer):
    trajectories = [make_trajectory(tiny_model, [3, 30, 31], c, s) for c, s in [([40, 1], 1.0), ([41, 42, 1], 0.0)]]
    learned = LearnedReward(RewardModelConfig(path=str(reward_model_dir), weight=0.5), tiny_tokenizer, RUNTIME.device)
    metrics = learned.annotate(trajectories)
    raw = load_reward_model(reward_model_dir).score_ids([t.token_ids for t in trajectories])
    expected = [(r - 0.05) / 0.5 for r in raw]  # normalised with the saved statistics
    assert [t.metadata[LEARNED_REWARD_KEY] for t in trajectories] == pytest.approx(expected)
    assert metrics == pytest.approx({"reward/verifier": 0.5, "reward/learned": sum(expected) / 2})
    total, parts = episode_return(trajectories[0], ReturnConfig(), 8, learned.weighted(trajectories[0]))
    assert parts == pytest.approx({"outcome": 1.0, "learned": 0.5 * expected[0]})
    assert total == pytest.approx(1.0 + 0.5 * expected[0])


def test_a_reward_model_with_another_tokenizer_is_refused(reward_model_dir):
    from posttrain.models import train_tokenizer

    other = train_tokenizer(["completely different text 42"], vocab_size=300)
    with pytest.raises(ConfigError, match="reward_model.path: .* another tokenizer"):
        LearnedReward(RewardModelConfig(path=str(reward_model_dir)), other, RUNTIME.device)


# ---- the RL recipe with both ---------------------------------------------------------------------------------


def rlhf_recipe(policy_dir, reward_model_dir, output, flaky=False) -> RLRecipe:
    return RLRecipe.model_validate({
        "output_dir": str(output),
        "model": {"path": str(policy_dir)},
        "domains": [{"name": "test_digits", "heldout": 0, "args": {"flaky": flaky}}],
        "rollout": {"prompts_per_step": 3, "infra_retries": 0, "sampling": {"group_size": 2, "max_new_tokens": 8}},
        "algorithm": {"advantage": "gae", "lam": 0.9},
        "critic": {"value_clip": 0.2},
        "reward_model": {"path": str(reward_model_dir), "weight": 0.5},
        "optim": {"lr": 1e-3},
        "train": {"max_steps": 4, "micro_batch_size": 6, "save_every": 2},
        "pipeline": {"self_test": False, "max_staleness": 1},
        "runtime": {"precision": "fp32"},
        "tracking": {"tensorboard": False, "progress": False},
    })


def figures(result):
    keys = ("train/loss", "reward/mean", "reward/verifier", "reward/learned", "return/learned", "critic/value_loss",
            "critic/explained_variance")
    return [tuple(m[key] for key in keys) for m in result.history]


def assert_same_files(a: Path, b: Path, names):
    for name in names:
        wa, wb = load_file(str(a / name)), load_file(str(b / name))
        assert wa.keys() == wb.keys()
        for key in wa:
            assert torch.equal(wa[key], wb[key]), (name, key)


def test_ppo_with_a_reward_model_resumes_exactly(policy_dir, reward_model_dir, tmp_path):
    full = run_rl(rlhf_recipe(policy_dir, reward_model_dir, tmp_path / "full"))
    last = full.history[-1]
    assert last["return/learned"] == pytest.approx(0.5 * last["reward/learned"])
    assert last["reward/learned"] != 0.0 and "critic/value_loss" in last and "critic/grad_norm" in last

    def crash(step, metrics):
        if step == 3:
            raise KeyboardInterrupt("simulated crash after step 3 (checkpoint at step 2)")

    with pytest.raises(KeyboardInterrupt):
        run_rl(rlhf_recipe(policy_dir, reward_model_dir, tmp_path / "crashed"), on_step=crash)
    checkpoint = tmp_path / "crashed" / "checkpoints" / "step-000002"
    critic_config = json.loads((checkpoint / "critic" / "config.json").read_text())  # the critic beside the policy
    assert critic_config["architectures"] == ["LlamaForSequenceClassification"] and len(critic_config["id2label"]) == 1
    resumed = run_rl(rlhf_recipe(policy_dir, reward_model_dir, tmp_path / "crashed"), resume=True)
    assert [m["policy/version"] for m in resumed.history] == [0.0, 1.0, 2.0, 3.0]  # steps 1-2 from metrics.jsonl
    assert figures(resumed) == figures(full)
    assert_same_files(full.final_dir, resumed.final_dir, ["model.safetensors"])
    assert_same_files(tmp_path / "full" / "critic", tmp_path / "crashed" / "critic",
                      ["model.safetensors"])
    # the finished critic is a reward-model directory: it loads as a scorer (or as the next run's critic)
    assert isinstance(load_reward_model(tmp_path / "full" / "critic").score_ids([[3, 4, 5]])[0], float)


def test_infrastructure_failures_are_never_scored_by_the_reward_model(policy_dir, reward_model_dir, tmp_path):
    config = rlhf_recipe(policy_dir, reward_model_dir, tmp_path / "flaky", flaky=True)
    config.train.max_steps = 2
    result = run_rl(config)
    records = [json.loads(line) for line in (tmp_path / "flaky" / "episodes.jsonl").read_text().splitlines()]
    infra = [r for r in records if r["failure"] == "infra"]
    assert infra and sum(m["rollout/infra_masked"] for m in result.history) == len(infra)
    assert all(LEARNED_REWARD_KEY not in r for r in infra)
    assert all(isinstance(r[LEARNED_REWARD_KEY], float) for r in records if r["failure"] != "infra")


def test_the_critic_section_needs_gae_and_the_packaged_recipe_validates():
    with pytest.raises(ValueError, match="critic: the critic is used only with algorithm.advantage: gae"):
        RLRecipe.model_validate({"critic": {"value_clip": 0.5}})
    recipe = load_recipe(ROOT / "src/posttrain/recipes/rl-ppo-rm.yaml", [], RLRecipe)
    assert recipe.algorithm.advantage == "gae" and recipe.reward_model is not None
