"""The shared-prefix layout (`train.shared_prefix`): a group's completions scored behind one copy of their prompt
give the padded layout's log-probs, entropies and gradients, on every family it is claimed for."""

from __future__ import annotations

import pytest
import torch

from posttrain.models import VARLEN, set_attention
from posttrain.rl.update import collate_trajectories
from posttrain.train import scored_token_stats
from posttrain.train.shared_prefix import shared_prefix_batch, shared_prefix_token_stats, shared_prefix_unsupported
from posttrain.types import Reward, Trajectory

import transformers
from test_conformance import _SHAPE, FAMILIES, build

WINDOWED = ("qwen2", "mistral", "phi3")  # claimed without their window; the conformance builds give them one

# two prompts, three and two continuations of different lengths; the last has a tool observation (unscored)
# between two scored turns, and one continuation of the first prompt is a single token
PROMPTS = [[1, 5, 6, 7, 8], [1, 9, 10]]
ROWS = [
    (0, [11, 12, 13, 2], [1, 1, 1, 1]),
    (0, [14], [1]),
    (1, [15, 16, 2], [1, 1, 1]),
    (0, [17, 18], [1, 1]),
    (1, [19, 20, 21, 22, 23, 24], [1, 1, 0, 0, 1, 1]),
]


def trajectories() -> list[Trajectory]:
    out = []
    for index, (prompt, tail, mask) in enumerate(ROWS):
        ids = PROMPTS[prompt] + tail
        out.append(Trajectory(task_id=f"t{index}", domain="toy", token_ids=ids,
                              loss_mask=[0] * len(PROMPTS[prompt]) + mask, behaviour_logprobs=[0.0] * len(ids),
                              policy_versions=[0] * len(ids), prompt_length=len(PROMPTS[prompt]),
                              reward=Reward(score=0.0, passed=False), group_id=str(prompt)))
    return out


def both_layouts(model):
    batch = trajectories()
    micro = collate_trajectories(batch, [0.0] * len(batch), 0, torch.device("cpu"))
    padded = scored_token_stats(model, micro.input_ids, micro.score_mask, micro.targets, entropy=True,
                                attention_mask=micro.attention_mask)
    layout = shared_prefix_batch([t.token_ids for t in batch], [t.loss_mask for t in batch], 0, "cpu")
    shared = shared_prefix_token_stats(model, layout, micro.targets, entropy=True)
    return padded, shared, layout


def gradients(model, stats) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    (stats.logprobs.sum() + 0.1 * stats.entropy.sum()).backward()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def windowless(family: str) -> torch.nn.Module:
    config_name, model_name, overrides, _ = FAMILIES[family]
    overrides = {k: v for k, v in overrides.items() if k not in ("sliding_window", "use_sliding_window",
                                                                 "max_window_layers")}
    overrides["sliding_window"] = None  # Mistral's config defaults to a window of 4,096
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(getattr(transformers, config_name)(**_SHAPE, **overrides)).eval()
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)  # logits large enough for differences to show
    return model


def use_attention(model, attention: str) -> None:
    set_attention(model, attention, torch.device("cpu"))  # registers posttrain's kernel for VARLEN


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("attention", ["eager", "sdpa", VARLEN])
def test_shared_prefix_scores_what_the_padded_layout_scores(family, attention):
    model = build(family)
    if family in WINDOWED:
        use_attention(model, attention)
        assert "sliding" in shared_prefix_unsupported(model)  # with its window: refused, never laid out silently
        model = windowless(family)
    if family in ("gemma2", "gemma3"):  # soft-capped attention, alternating windows
        assert "not one checked" in shared_prefix_unsupported(model)
        return
    use_attention(model, attention)
    reason = shared_prefix_unsupported(model)
    assert reason is None, reason
    padded, shared, layout = both_layouts(model)
    assert layout.input_ids.shape[0] == 2  # one row per prompt
    assert torch.allclose(shared.logprobs, padded.logprobs, atol=1e-5), (shared.logprobs - padded.logprobs).abs().max()
    assert torch.allclose(shared.entropy, padded.entropy, atol=1e-5)
    for a, b in zip(gradients(model, shared), gradients(model, padded)):  # float rounding of sums of ~1e3
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-5 * float(b.abs().max()))


def test_a_full_row_continues_behind_another_copy_of_the_prompt(monkeypatch):
    import posttrain.train.shared_prefix as shared_prefix

    monkeypatch.setattr(shared_prefix, "ROW_FACTOR", 1)  # a row no longer than the longest sequence
    padded, shared, layout = both_layouts(build("llama"))
    assert layout.input_ids.shape[0] == 4 and layout.input_ids.shape[1] <= max(len(t.token_ids) for t in trajectories())
    assert torch.allclose(shared.logprobs, padded.logprobs, atol=1e-5)


def test_a_wrong_mask_would_be_seen():
    """The comparison above can fail: a continuation that also sees its group's other continuations scores
    other log-probs."""
    model = build("llama")
    padded, _, layout = both_layouts(model)
    leaky = layout.__class__(**{**layout.__dict__, "mask": layout.mask | torch.ones_like(layout.mask).tril()})
    targets = collate_trajectories(trajectories(), [0.0] * 5, 0, torch.device("cpu")).targets
    wrong = shared_prefix_token_stats(model, leaky, targets)
    assert (wrong.logprobs - padded.logprobs).abs().max() > 1e-3


def _update(tokenizer, shared: bool, micro: int, kl_coef: float = 0.0, proximal: bool = False):
    from posttrain.config import RLRecipe
    from posttrain.config.rl import PolicyLossConfig
    from posttrain.models import build_tiny_model
    from posttrain.rl.update import UpdateSettings, make_reference, rl_update
    from posttrain.train import Runtime

    torch.manual_seed(0)
    model = build_tiny_model("tiny-1m", tokenizer, seed=0)
    runtime = Runtime(torch.device("cpu"), None)
    reference = None
    if kl_coef:  # a frozen copy of the starting weights, as a run has
        reference = make_reference(model, RLRecipe.model_validate({"algorithm": {"kl_coef": kl_coef}}), runtime)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)  # the step is the gradient (Adam's first is its sign)
    loss = PolicyLossConfig(entropy_coef=0.01, kl_coef=kl_coef, old_policy="proximal" if proximal else "behaviour")
    settings = UpdateSettings(loss=loss, runtime=runtime, pad_id=0, temperature=1.0, micro_batch_size=micro,
                              max_grad_norm=None, shared_prefix=shared, updates_per_batch=2 if proximal else 1)
    batch = trajectories()
    with torch.no_grad():  # behaviour log-probs: the model's own, nudged, so the ratios are not all 1
        micro_batch = collate_trajectories(batch, [0.0] * 5, 0, torch.device("cpu"))
        own = scored_token_stats(model, micro_batch.input_ids, micro_batch.score_mask, micro_batch.targets,
                                 attention_mask=micro_batch.attention_mask).logprobs.tolist()
    for trajectory in batch:
        scored = [t for t, m in enumerate(trajectory.loss_mask) if m]
        for t in scored:
            trajectory.behaviour_logprobs[t] = own.pop(0) + 0.05
    if reference is not None:  # the reference moves away from the policy: a KL that is not 0
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.add_(0.01 * torch.randn_like(parameter))
    stats = rl_update(model, optimizer, None, batch, [1.0, -0.5, 0.7, 0.3, -1.1], settings, reference=reference)
    return model, stats


def spy_on_the_layout(monkeypatch) -> list:
    """(model, tokens scored) of each `shared_prefix_token_stats` call, in call order."""
    import posttrain.rl.update as update

    calls = []
    real = update.shared_prefix_token_stats

    def spy(model, layout, targets, **kwargs):
        calls.append((model, int(targets.numel())))
        return real(model, layout, targets, **kwargs)

    monkeypatch.setattr(update, "shared_prefix_token_stats", spy)
    return calls


@pytest.mark.parametrize("micro", [5, 2])
def test_an_rl_update_on_the_shared_layout_steps_as_the_padded_one(tiny_tokenizer, micro):
    """The same loss, statistics and weights after the step, to float rounding (micro-batches of 2 split the
    groups: `prompts_together` keeps a prompt's sequences in one micro-batch where it can)."""
    shared, stats_shared = _update(tiny_tokenizer, True, micro)
    padded, stats_padded = _update(tiny_tokenizer, False, micro)
    for key in ("loss", "pg_loss", "entropy", "ratio_mean"):
        assert stats_shared[key] == pytest.approx(stats_padded[key], rel=1e-4, abs=1e-6), key
    for a, b in zip(shared.parameters(), padded.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_the_kl_reference_scores_the_shared_layout_too(tiny_tokenizer, monkeypatch):
    """With a KL term the reference scores the policy's layout (one forward over the shared rows, not the padded
    ones) and gives the padded layout's KL and step."""
    calls = spy_on_the_layout(monkeypatch)
    shared, stats_shared = _update(tiny_tokenizer, True, 5, kl_coef=0.1)
    assert [model is shared for model, _ in calls] == [True, False]  # the policy, then its reference
    padded, stats_padded = _update(tiny_tokenizer, False, 5, kl_coef=0.1)
    assert stats_padded["kl"] > 1e-6
    for key in ("loss", "kl", "pg_loss"):
        assert stats_shared[key] == pytest.approx(stats_padded[key], rel=1e-4, abs=1e-7), key
    for a, b in zip(shared.parameters(), padded.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_the_proximal_forward_scores_the_shared_layout_too(tiny_tokenizer, monkeypatch):
    """`old_policy: proximal` with two updates a batch: the log-probs before the first update come from the shared
    layout (its micro-batches hold whole groups), and both steps equal the padded run's."""
    calls = spy_on_the_layout(monkeypatch)
    shared, stats_shared = _update(tiny_tokenizer, True, 5, proximal=True)
    everything = sum(sum(mask) for _, _, mask in ROWS)  # the proximal pass scores the whole batch in one go
    assert calls[0] == (shared, everything), calls
    calls.clear()
    padded, stats_padded = _update(tiny_tokenizer, False, 5, proximal=True)
    assert not calls
    for key in ("loss", "pg_loss", "ratio_mean"):
        assert stats_shared[key] == pytest.approx(stats_padded[key], rel=1e-4, abs=1e-7), key
    for a, b in zip(shared.parameters(), padded.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


def test_the_recipe_knob_reaches_the_update_and_an_unchecked_family_falls_back(caplog):
    from posttrain.config import RLRecipe
    from posttrain.rl.update import LocalPolicy
    from posttrain.train import Runtime

    recipe = RLRecipe.model_validate({"train": {"shared_prefix": True}})
    tokenizer = type("Tokenizer", (), {"pad_token_id": 0})()
    runtime = Runtime(torch.device("cpu"), None)
    assert LocalPolicy(build("llama"), tokenizer, runtime, recipe).settings.shared_prefix is True
    on_cpu = build("llama")
    use_attention(on_cpu, VARLEN)  # what `attn_implementation: auto` loads on a CPU
    assert LocalPolicy(on_cpu, tokenizer, runtime, recipe).settings.shared_prefix is True
    with caplog.at_level("WARNING"):
        policy = LocalPolicy(build("gemma2"), tokenizer, runtime, recipe)
    assert policy.settings.shared_prefix is False and "shared_prefix: off for this model" in caplog.text


def test_no_shared_prompt_gives_no_layout():
    """Sequences of distinct prompts keep the padded layout: no mask to build for the same rows."""
    assert shared_prefix_batch([[1, 2, 3], [1, 4, 5]], [[0, 0, 1], [0, 1, 1]], 0, "cpu") is None
    assert shared_prefix_batch([[1, 2, 3], [1, 2, 5]], [[0, 0, 1], [0, 0, 1]], 0, "cpu") is not None
