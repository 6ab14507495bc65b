"""The update leaves zero-advantage sequences out of its forward and backward, and the step is the same: the
parameters (and AdamW's state) after updates with the skip equal those without it, for every loss aggregation,
PPO mini-batches, micro-batching and the proximal old policy; a batch of only zero advantages still steps the
optimizer (weight decay, momentum); with a term that touches every sequence (KL, entropy) nothing is skipped."""

import pytest
import torch

from posttrain.config import OptimConfig
from posttrain.config.rl import PolicyLossConfig
from posttrain.models import build_tiny_model
from posttrain.rl.update import UpdateSettings, make_reference, rl_update
from posttrain.train import Runtime, build_optimizer, selected_logits, target_logprobs
from posttrain.types import Reward, Trajectory

RUNTIME = Runtime(device=torch.device("cpu"), autocast_dtype=None)
pytestmark = pytest.mark.usefixtures("one_thread")  # tiny matmuls: a second thread only waits (17x slower here)
PROMPTS = ([3, 30, 31], [3, 32, 33, 34])
COMPLETIONS = ([40, 41, 1], [42, 1], [43, 44, 45, 46, 1], [47, 48, 1])


def _trajectory(model, prompt, completion, seed):
    """A sampled completion whose behaviour log-probs are the model's, nudged, so the ratios differ from 1
    (some clipped)."""
    ids = torch.tensor([prompt + completion])
    select = torch.zeros(1, ids.shape[1] - 1, dtype=torch.bool)
    select[0, len(prompt) - 1:] = True
    with torch.no_grad():
        logprobs = target_logprobs(selected_logits(model, ids, select), ids[0, len(prompt):])
    noise = torch.randn(len(completion), generator=torch.Generator().manual_seed(seed)) * 0.3
    return Trajectory(task_id=f"t{seed}", domain="toy", token_ids=prompt + completion,
                      loss_mask=[0] * len(prompt) + [1] * len(completion),
                      behaviour_logprobs=[0.0] * len(prompt) + (logprobs + noise).tolist(),
                      policy_versions=[0] * ids.shape[1], prompt_length=len(prompt),
                      reward=Reward(score=0.0, passed=False), group_id=str(prompt))


def _batch(model):
    return [_trajectory(model, prompt, completion, seed=4 * p + c)
            for p, prompt in enumerate(PROMPTS) for c, completion in enumerate(COMPLETIONS)]


# group 0 all equal (zero advantage), group 1 mixed with one zero among them
MIXED = [0.0, 0.0, 0.0, 0.0, 1.2, -0.4, 0.0, -0.8]


def _train(tokenizer, advantage_batches, skip: bool, *, micro: int = 3, updates: int = 1,
           weight_decay: float = 0.1, **loss):
    """Fresh tiny model, AdamW with weight decay; one `rl_update` per entry of `advantage_batches`."""
    torch.manual_seed(0)
    model = build_tiny_model("tiny-1m", tokenizer, seed=0)
    optimizer = build_optimizer(model, OptimConfig(lr=1e-2, weight_decay=weight_decay, max_grad_norm=1.0, eps=1e-6))
    config = PolicyLossConfig(skip_zero_advantage=skip, **loss)
    reference = make_reference(model, _recipe(config), RUNTIME) if config.kl_coef else None
    settings = UpdateSettings(loss=config, runtime=RUNTIME, pad_id=0, temperature=1.0, micro_batch_size=micro,
                              max_grad_norm=1.0, normalizer=8, updates_per_batch=updates)
    trajectories = _batch(model)
    history = [rl_update(model, optimizer, None, trajectories, advantages, settings, reference=reference)
               for advantages in advantage_batches]
    return model, optimizer, history


def _recipe(config: PolicyLossConfig):
    from posttrain.config import RLRecipe

    return RLRecipe.model_validate({"algorithm": config.model_dump()})


def _assert_same_step(with_skip, without_skip):
    """The same AdamW state (the moments: linear in the gradients, so a wrong normalizer shows here even where
    Adam's scale invariance would hide it in the weights) and the same weights, to float rounding: the
    micro-batches hold other rows, so sums run in another order (gradients differ by ~1e-7 of their ~0.1
    scale), and Adam divides each gradient by its own running scale, which turns that into weight differences of
    up to ~1e-5 where a gradient is near 0 (lr 1e-2, eps 1e-6)."""
    (model_a, optim_a, _), (model_b, optim_b, _) = with_skip, without_skip
    for (name, a), b in zip(model_a.named_parameters(), model_b.parameters()):
        state_a, state_b = optim_a.state[a], optim_b.state[b]
        assert float(state_a["step"]) == float(state_b["step"]), name
        torch.testing.assert_close(state_a["exp_avg"], state_b["exp_avg"], rtol=1e-4, atol=5e-7)
        torch.testing.assert_close(state_a["exp_avg_sq"], state_b["exp_avg_sq"], rtol=1e-4, atol=1e-9)
        torch.testing.assert_close(a, b, rtol=0, atol=3e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("loss", [
    {},  # the defaults: token_mean, token-level ratio
    {"aggregation": "seq_mean"},
    {"aggregation": "constant"},
    {"ratio_level": "sequence", "aggregation": "seq_mean"},  # GSPO
    {"dual_clip": 3.0, "clip_high": 0.28},
], ids=["token_mean", "seq_mean", "constant", "gspo", "dual_clip"])
def test_skipping_zero_advantages_leaves_the_update_unchanged(tiny_tokenizer, loss):
    batches = [MIXED, [-a for a in MIXED], MIXED]  # three steps: AdamW's moments carry the earlier ones
    skipped = _train(tiny_tokenizer, batches, skip=True, **loss)
    full = _train(tiny_tokenizer, batches, skip=False, **loss)
    _assert_same_step(skipped, full)
    start = build_tiny_model("tiny-1m", tiny_tokenizer, seed=0)
    with torch.no_grad():
        moved = max(float((a - b).abs().max()) for a, b in zip(skipped[0].parameters(), start.parameters()))
    assert moved > 1e-3  # the updates did something
    stats, reference = skipped[2][0], full[2][0]
    assert stats["skipped_zero_adv_sequences"] == 5 and reference["skipped_zero_adv_sequences"] == 0
    lengths = [len(p) + len(c) for p in PROMPTS for c in COMPLETIONS]
    assert stats["skipped_zero_adv_tokens"] == sum(n for n, a in zip(lengths, MIXED) if a == 0)
    assert stats["tokens"] == reference["tokens"]  # the normalizer's tokens: the whole batch
    # loss, pg_loss and clip_fraction are exact; a zero-advantage token is never clipped
    for key in ("loss", "pg_loss", "clip_fraction", "grad_norm"):
        assert stats[key] == pytest.approx(reference[key], rel=1e-5, abs=1e-7), key
    if loss.get("ratio_level") != "sequence":  # (GSPO's sequence ratios, a mean of the nudges, stay in the band)
        assert reference["clip_fraction"] > 0


def test_mini_batches_micro_batches_and_the_proximal_policy_keep_their_meaning(tiny_tokenizer):
    """PPO-style: two optimizer steps per batch, micro-batches of 2, the trainer's own log-probs as the old policy
    with truncated importance weights; one mini-batch has only zero advantages."""
    advantages = [0.0, 0.0, 0.0, 0.0, 0.7, -0.7, 0.0, 0.0]  # longest first, round-robin: mini-batch 2 is all zero
    kwargs = dict(micro=2, updates=2, old_policy="proximal", tis_cap=2.0)
    skipped = _train(tiny_tokenizer, [advantages, advantages], skip=True, **kwargs)
    full = _train(tiny_tokenizer, [advantages, advantages], skip=False, **kwargs)
    _assert_same_step(skipped, full)
    assert skipped[2][0]["skipped_zero_adv_sequences"] == 5  # 6 zero, one of them kept for the all-zero mini-batch


def test_an_all_zero_batch_steps_the_optimizer_as_before(tiny_tokenizer):
    """Nothing to learn in the batch, yet AdamW steps: weight decay and the momentum of the step before move the
    weights, and its step count and moments advance -- the same with the skip (which runs one sequence)."""
    zero = [0.0] * 8
    skipped = _train(tiny_tokenizer, [MIXED, zero], skip=True)
    full = _train(tiny_tokenizer, [MIXED, zero], skip=False)
    _assert_same_step(skipped, full)
    model, optimizer, history = skipped
    assert history[1]["skipped_zero_adv_sequences"] == 7 and history[1]["grad_norm"] == 0.0
    assert all(float(optimizer.state[p]["step"]) == 2 for p in model.parameters())
    after_first = _train(tiny_tokenizer, [MIXED], skip=True)[0]
    with torch.no_grad():
        assert max(float((a - b).abs().max()) for a, b in zip(model.parameters(), after_first.parameters())) > 1e-4


@pytest.mark.parametrize("term", [{"kl_coef": 0.5}, {"entropy_coef": 0.01}], ids=["kl", "entropy"])
def test_nothing_is_skipped_when_a_term_touches_every_sequence(tiny_tokenizer, term):
    skipped = _train(tiny_tokenizer, [MIXED, MIXED], skip=True, **term)
    full = _train(tiny_tokenizer, [MIXED, MIXED], skip=False, **term)
    assert [h["skipped_zero_adv_sequences"] for h in skipped[2]] == [0, 0]
    _assert_same_step(skipped, full)
