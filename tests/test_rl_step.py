"""The RL update on hand-built trajectories: it raises the rewarded completion and scores exact tokens."""

import pytest
import torch

from posttrain.config.rl import PolicyLossConfig
from posttrain.config import OptimConfig
from posttrain.rl.advantages import compute_advantages
from posttrain.rl.update import UpdateSettings, collate_trajectories, rl_update
from posttrain.train import Runtime, build_optimizer, selected_logits, target_logprobs
from posttrain.types import Reward, Trajectory

RUNTIME = Runtime(device=torch.device("cpu"), autocast_dtype=None)


def sequence_logprob(model, prompt, completion):
    ids = torch.tensor([prompt + completion])
    select = torch.zeros(1, ids.shape[1] - 1, dtype=torch.bool)
    select[0, len(prompt) - 1 :] = True
    with torch.no_grad():
        logits = selected_logits(model, ids, select)
    return target_logprobs(logits, ids[0, len(prompt) :]).tolist()


def make_trajectory(model, prompt, completion, score, group="g"):
    behaviour = sequence_logprob(model, prompt, completion)
    return Trajectory(
        task_id="t", domain="toy", token_ids=prompt + completion,
        loss_mask=[0] * len(prompt) + [1] * len(completion),
        behaviour_logprobs=[0.0] * len(prompt) + behaviour,
        policy_versions=[0] * (len(prompt) + len(completion)), prompt_length=len(prompt),
        reward=Reward(score=score, passed=score > 0), group_id=group,
    )


def agentic_trajectory(model):
    """An agentic episode: policy tokens, an observation (context only, not trained), more policy tokens."""
    trajectory = make_trajectory(model, [3, 10, 11], [20, 21], 1.0)
    trajectory.token_ids += [7, 8, 22]
    trajectory.loss_mask += [0, 0, 1]
    trajectory.behaviour_logprobs += [0.0, 0.0, -1.5]
    trajectory.policy_versions += [0, 0, 0]
    return trajectory


def test_collate_scores_exactly_the_policy_tokens(tiny_model):
    observation_episode = agentic_trajectory(tiny_model)
    micro = collate_trajectories([observation_episode], [1.0], pad_id=0, device=torch.device("cpu"))
    assert micro.targets.tolist() == [20, 21, 22]
    assert micro.behaviour[-1].item() == pytest.approx(-1.5)
    scored_positions = micro.score_mask[0].nonzero().flatten().tolist()
    assert scored_positions == [2, 3, 6]  # position t predicts token t+1


def test_grpo_step_raises_the_rewarded_completion(tiny_model, tiny_tokenizer):
    prompt = [3, 30, 31, 1, 5]
    good, bad = [40, 41, 1], [42, 43, 1]
    before_good = sum(sequence_logprob(tiny_model, prompt, good))
    before_bad = sum(sequence_logprob(tiny_model, prompt, bad))
    optimizer = build_optimizer(tiny_model, OptimConfig(lr=1e-2, max_grad_norm=None))
    config = PolicyLossConfig()
    for _ in range(5):
        trajectories = [make_trajectory(tiny_model, prompt, c, s) for c, s in [(good, 1.0), (bad, 0.0)] * 2]
        advantages = compute_advantages([t.reward.score for t in trajectories], ["g"] * 4).tolist()
        stats = rl_update(tiny_model, optimizer, None, trajectories, advantages,
                          UpdateSettings(loss=config, runtime=RUNTIME, pad_id=tiny_tokenizer.pad_token_id,
                                         temperature=1.0, micro_batch_size=2, max_grad_norm=None))
    assert sum(sequence_logprob(tiny_model, prompt, good)) > before_good + 1.0
    assert sum(sequence_logprob(tiny_model, prompt, bad)) < before_bad
    # behaviour log-probs were recomputed by the trainer itself: the measured gap is ~0
    assert stats["gap_abs_max"] < 1e-5
    assert stats["tokens"] == 12


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean", "constant"])
def test_micro_batching_does_not_change_the_gradient(tiny_tokenizer, aggregation):
    from posttrain.models import build_tiny_model

    grads = []
    for micro in (1, 4):
        model = build_tiny_model("tiny-1m", tiny_tokenizer, seed=0)
        trajectories = [make_trajectory(model, [3, 30, 31], c, s) for c, s in
                        [([40], 1.0), ([41, 42, 43], 0.0), ([44, 45], 1.0), ([46], 0.0)]]
        advantages = compute_advantages([t.reward.score for t in trajectories], ["g"] * 4).tolist()
        before = model.lm_head.weight.detach().clone()
        optimizer = torch.optim.SGD(model.parameters(), lr=1.0)  # the update is minus the gradient
        rl_update(model, optimizer, None, trajectories, advantages,
                  UpdateSettings(loss=PolicyLossConfig(aggregation=aggregation), runtime=RUNTIME, pad_id=0,
                                 temperature=1.0, micro_batch_size=micro, max_grad_norm=None, normalizer=4))
        grads.append(before - model.lm_head.weight.detach())
    assert grads[0].abs().max() > 1e-4
    torch.testing.assert_close(grads[0], grads[1])


@pytest.mark.parametrize("lora", [False, True])
def test_the_kl_term_measures_and_restrains_the_drift_from_the_reference(tiny_tokenizer, lora):
    """The reference is the starting policy (a frozen copy; under LoRA the adapter switched off): the KL is 0
    before any update, grows as the policy moves, and with the term on the policy moves less from where it
    started than with it off."""
    from posttrain.config import LoraConfig, RLRecipe
    from posttrain.models import apply_lora, build_tiny_model
    from posttrain.rl.update import make_reference

    prompt, good, bad = [3, 30, 31, 1, 5], [40, 41, 1], [42, 43, 1]
    drift = {}
    for kl_coef in (0.0, 1.0):
        torch.manual_seed(0)
        model = build_tiny_model("tiny-1m", tiny_tokenizer, seed=0)
        if lora:
            model = apply_lora(model, LoraConfig(enabled=True, r=4))
        recipe = RLRecipe.model_validate({"algorithm": {"kl_coef": kl_coef, "kl_estimator": "k2"}})
        reference = make_reference(model, recipe, RUNTIME)
        start = torch.tensor(sequence_logprob(model, prompt, good) + sequence_logprob(model, prompt, bad))
        optimizer = build_optimizer(model, OptimConfig(lr=1e-2, max_grad_norm=None))
        config = PolicyLossConfig(kl_coef=kl_coef, kl_estimator="k2")
        kls = []
        for _ in range(8):
            trajectories = [make_trajectory(model, prompt, c, s) for c, s in [(good, 1.0), (bad, 0.0)] * 2]
            advantages = compute_advantages([t.reward.score for t in trajectories], ["g"] * 4).tolist()
            stats = rl_update(model, optimizer, None, trajectories, advantages,
                              UpdateSettings(loss=config, runtime=RUNTIME, pad_id=tiny_tokenizer.pad_token_id,
                                             temperature=1.0, micro_batch_size=4, max_grad_norm=None),
                              reference=reference)
            kls.append(stats.get("kl"))
        now = torch.tensor(sequence_logprob(model, prompt, good) + sequence_logprob(model, prompt, bad))
        drift[kl_coef] = float((now - start).pow(2).mean())
        if kl_coef:
            assert kls[0] == pytest.approx(0.0, abs=1e-6)  # the policy is the reference before its first step
            assert kls[-1] > 1e-4
        else:
            assert kls == [None] * 8  # no reference scored without the term
    assert drift[0.0] > 0.1
    assert drift[1.0] < 0.5 * drift[0.0]
