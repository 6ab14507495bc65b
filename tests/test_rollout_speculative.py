"""Speculative decoding in HFEngine: greedy output equals plain decoding, sampled tokens follow the target's exact
distribution (chi-square), logprobs are the target's, stops behave as in plain decoding, clear refusals."""

from __future__ import annotations

import copy

import pytest
import torch

from posttrain.models import build_tiny_model, save_model_dir, train_tokenizer
from posttrain.rollout import HFEngine, RolloutError, Speculation, eos_token_ids, load_speculation
from posttrain.rollout.speculative import lookup_draft
from posttrain.types import GenerationRequest, SamplingParams

CORPUS = [
    "12+34=46 the quick brown fox jumps over the lazy dog.\n",
    "Answer: 7\n\nThe invoice total is $1,234.50.\n",
    '{"name": "calculator", "arguments": {"expression": "2+3"}}\n',
] * 20 + [f"{i}*{i}={i * i}\n" for i in range(100)]
torch.set_num_threads(1)  # the machine is shared; tiny models gain nothing from more threads

TEXTS = ("12+3=", "the quick brown fox jumps over the lazy dog. the quick", "A")


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(CORPUS, vocab_size=300)


def peaky(model: torch.nn.Module, scale: float) -> torch.nn.Module:
    """A random model made confident (its logits scaled), so a few thousand samples resolve its distribution."""
    with torch.no_grad():
        model.lm_head.weight.mul_(scale)
    return model.eval()


@pytest.fixture(scope="module")
def target(tokenizer):
    return peaky(build_tiny_model("tiny-1m", tokenizer, seed=0), 6.0)


@pytest.fixture(scope="module")
def near_draft(target):
    """The target with noise on every weight: agrees often but not always (both accept and reject paths run)."""
    draft = copy.deepcopy(target)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for parameter in draft.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.3 * parameter.std())
    return draft.eval()


@pytest.fixture(scope="module")
def other_draft(tokenizer):
    return build_tiny_model("tiny-1m", tokenizer, seed=1).eval()


def requests(tokenizer, texts=TEXTS):
    return [GenerationRequest(tokenizer(t)["input_ids"], request_id=f"r{i}") for i, t in enumerate(texts)]


def teacher_forced(model, prompt, completion, temperature=1.0):
    ids = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    return torch.log_softmax(logits / temperature, dim=-1).gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


def speculations(target, near_draft, other_draft):
    return {
        "near-draft": Speculation(near_draft, num_tokens=4),
        "other-draft": Speculation(other_draft, num_tokens=3),
        "ngram": Speculation(None, num_tokens=4, ngram=3),
    }


@pytest.mark.parametrize("kind,stop,include", [
    ("near-draft", [], True), ("other-draft", [], True), ("ngram", [], True),
    ("near-draft", ["fox", "="], True), ("near-draft", ["fox", "="], False), ("ngram", ["fox"], False),
])
def test_greedy_output_equals_plain_decoding(tokenizer, target, near_draft, other_draft, kind, stop, include):
    reqs = requests(tokenizer)
    sampling = SamplingParams(max_new_tokens=40, temperature=0.0, n=2, stop=stop, include_stop_in_output=include)
    plain = HFEngine(target, tokenizer).generate(reqs, sampling)
    engine = HFEngine(target, tokenizer, speculative=speculations(target, near_draft, other_draft)[kind])
    fast = engine.generate(reqs, sampling)
    for plain_group, group in zip(plain, fast):
        for reference, completion in zip(plain_group, group):
            assert completion.token_ids == reference.token_ids
            assert completion.text == reference.text
            assert completion.finish_reason == reference.finish_reason
            assert completion.logprobs == pytest.approx(reference.logprobs, abs=1e-4)
    assert 0 < engine.stats.speculative_rounds < engine.stats.completion_tokens


def test_eos_and_max_tokens_stop_as_in_plain_decoding(tokenizer, target, near_draft):
    """A stop token drafted mid-round ends the completion there; max_new_tokens is never overrun."""
    reqs = requests(tokenizer)
    probe = HFEngine(target, tokenizer).generate(reqs, SamplingParams(max_new_tokens=12, temperature=0.0))
    stop_id = probe[1][0].token_ids[5]  # a token greedy decoding reaches mid-sequence
    for max_new in (1, 2, 5, 12):
        sampling = SamplingParams(max_new_tokens=max_new, temperature=0.0, stop_token_ids=[stop_id])
        plain = HFEngine(target, tokenizer).generate(reqs, sampling)
        fast = HFEngine(target, tokenizer, speculative=Speculation(near_draft, num_tokens=4)).generate(reqs, sampling)
        assert [c[0].token_ids for c in fast] == [c[0].token_ids for c in plain]
        assert [c[0].finish_reason for c in fast] == [c[0].finish_reason for c in plain]
        assert all(len(c[0].token_ids) <= max_new for c in fast)


def test_acceptance_rate_is_one_when_the_draft_is_the_target(tokenizer, target):
    reqs = requests(tokenizer)
    engine = HFEngine(target, tokenizer, speculative=Speculation(copy.deepcopy(target), num_tokens=4))
    engine.generate(reqs, SamplingParams(max_new_tokens=30, temperature=0.0, n=2))
    assert engine.stats.draft_tokens > 0
    assert engine.stats.acceptance_rate == 1.0
    # Sampling: p / q = 1 up to rounding between a one-token and a block pass, so (almost) every draft is taken.
    engine.generate(reqs, SamplingParams(max_new_tokens=30, temperature=1.0, n=4, seed=3))
    assert engine.stats.acceptance_rate > 0.99
    assert engine.stats.tokens_per_s > 0


def test_an_unrelated_draft_is_mostly_rejected(tokenizer, target, other_draft):
    engine = HFEngine(target, tokenizer, speculative=Speculation(other_draft, num_tokens=4))
    engine.generate(requests(tokenizer), SamplingParams(max_new_tokens=30, temperature=0.0, n=2))
    assert engine.stats.acceptance_rate < 0.5  # the figure is real: not everything is accepted


@pytest.mark.parametrize("kind", ["near-draft", "ngram"])
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.8, 12, 0.9)])
def test_sampled_logprobs_are_the_targets(tokenizer, target, near_draft, other_draft, kind, temperature, top_k,
                                          top_p):
    reqs = requests(tokenizer)
    sampling = SamplingParams(max_new_tokens=24, temperature=temperature, top_k=top_k, top_p=top_p, n=3, seed=5)
    engine = HFEngine(target, tokenizer, speculative=speculations(target, near_draft, other_draft)[kind])
    groups = engine.generate(reqs, sampling)
    for request, group in zip(reqs, groups):
        for completion in group:
            reference = teacher_forced(target, request.prompt_token_ids, completion.token_ids, temperature)
            assert (reference - torch.tensor(completion.logprobs)).abs().max().item() < 1e-4
    assert engine.stats.accepted_tokens > 0
    again = HFEngine(target, tokenizer, speculative=speculations(target, near_draft, other_draft)[kind])
    assert [[c.token_ids for c in g] for g in again.generate(reqs, sampling)] == [[c.token_ids for c in g]
                                                                                   for g in groups]


# ---- the distribution: chi-square against the target's exact next-token probabilities -------------------------


def exact_first_two(model, tokenizer, prompt, temperature, top_k, top_p):
    """The exact sampling distributions of the first emitted token and of the second (given the first was not
    an eos) under `model`."""

    def cut(logits):
        probs = torch.softmax(logits / temperature, dim=-1)
        if top_k:
            kth = probs.topk(top_k, dim=-1).values[..., -1:]
            probs = torch.where(probs >= kth, probs, 0.0)
        if top_p < 1:
            ordered, order = probs.sort(dim=-1, descending=True)
            before = ordered.cumsum(-1) - ordered
            ordered = torch.where(before < top_p * ordered.sum(-1, keepdim=True), ordered, 0.0)
            probs = torch.zeros_like(probs).scatter(-1, order, ordered)
        return probs / probs.sum(-1, keepdim=True)

    with torch.no_grad():
        first = cut(model(torch.tensor([prompt])).logits[0, -1].float())
        vocab = first.shape[0]
        ids = torch.tensor([list(prompt) + [t] for t in range(vocab)])
        second = cut(model(ids).logits[:, -1].float())
    going_on = first.clone()
    going_on[sorted(eos_token_ids(tokenizer, model))] = 0.0  # a completion ends at its eos
    return first, (going_on / going_on.sum()) @ second


def chi_square_p(counts: torch.Tensor, probs: torch.Tensor, min_expected: float = 5.0) -> float:
    """Pearson's chi-square p-value; cells expected under `min_expected` are pooled into one."""
    total = counts.sum()
    expected = probs.double() * total
    big = expected >= min_expected
    observed = torch.cat([counts[big].double(), counts[~big].double().sum()[None]])
    expected = torch.cat([expected[big], expected[~big].sum()[None]])
    if expected[-1] < min_expected:  # fold a small pool into the smallest kept cell
        observed, expected = observed[:-1], expected[:-1]
        observed[-1] += counts[~big].sum()
        expected[-1] += probs.double()[~big].sum() * total
    statistic = ((observed - expected) ** 2 / expected).sum()
    dof = len(observed) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), statistic / 2))


SLOW = pytest.mark.slow


@pytest.mark.parametrize("kind,temperature,top_k,top_p", [
    ("near-draft", 1.0, 0, 1.0), ("ngram", 1.0, 0, 1.0), ("other-draft", 0.8, 12, 0.9),
    pytest.param("near-draft", 0.8, 12, 0.9, marks=SLOW), pytest.param("ngram", 0.8, 12, 0.9, marks=SLOW),
    pytest.param("other-draft", 1.0, 0, 1.0, marks=SLOW),
])
def test_sampled_tokens_follow_the_targets_distribution(tokenizer, target, near_draft, other_draft, kind,
                                                        temperature, top_k, top_p):
    # A prompt that repeats itself, so prompt lookup finds n-grams to draft from its first token on.
    prompt = tokenizer("7*7=49\n7*7=49\n7*7=")["input_ids"]
    samples = 2000
    sampling = SamplingParams(max_new_tokens=2, temperature=temperature, top_k=top_k, top_p=top_p, n=samples, seed=11)
    engine = HFEngine(target, tokenizer, max_batch_size=samples,
                      speculative=speculations(target, near_draft, other_draft)[kind])
    completions = engine.generate([GenerationRequest(prompt)], sampling)[0]
    first, second = exact_first_two(target, tokenizer, prompt, temperature, top_k, top_p)
    vocab = first.shape[0]
    assert 0 < engine.stats.draft_tokens and engine.stats.accepted_tokens < engine.stats.draft_tokens
    if kind != "ngram":  # (a looked-up token can be outside top-k: never accepted, rightly)
        assert engine.stats.accepted_tokens > 0
    firsts = torch.tensor([c.token_ids[0] for c in completions])
    # The second token exists when the first was not an eos: its marginal given that.
    seconds = torch.tensor([c.token_ids[1] for c in completions if len(c.token_ids) == 2])
    for position, tokens, probs in ((1, firsts, first), (2, seconds, second)):
        counts = torch.bincount(tokens, minlength=vocab)
        assert counts[probs == 0].sum() == 0  # nothing outside top-k / top-p
        assert chi_square_p(counts, probs) > 1e-3, f"token {position}"
    if kind == "other-draft":  # the test has power: the same samples are far from the draft's own distribution
        draft_first, _ = exact_first_two(other_draft, tokenizer, prompt, temperature, top_k, top_p)
        mixed = 0.5 * draft_first + 0.5 * first
        assert chi_square_p(torch.bincount(firsts, minlength=vocab), mixed) < 1e-6


# ---- parts and refusals ------------------------------------------------------------------------------------------


def test_prompt_lookup_takes_the_latest_longest_match():
    sequence = [1, 2, 3, 9, 1, 2, 3, 8, 7, 5, 2, 3]
    assert lookup_draft(sequence, ngram=2, count=3) == [8, 7, 5]  # "2 3" last seen before "8 7 5"
    assert lookup_draft(sequence, ngram=3, count=2) == [8, 7]  # no earlier "5 2 3": falls back to "2 3"
    assert lookup_draft([1, 2, 3], ngram=3, count=4) == []
    assert lookup_draft([4, 4], ngram=1, count=4) == [4]
    assert lookup_draft(sequence, ngram=2, count=0) == []


def test_a_draft_with_another_tokenizer_is_refused(tmp_path, tokenizer, target):
    other_tokenizer = train_tokenizer([t.upper() for t in CORPUS], vocab_size=280)
    save_model_dir(tmp_path / "other", build_tiny_model("tiny-1m", other_tokenizer, seed=0), other_tokenizer)
    with pytest.raises(RolloutError, match="tokenizer differs from the target's"):
        load_speculation(str(tmp_path / "other"), tokenizer)
    save_model_dir(tmp_path / "same", build_tiny_model("tiny-1m", tokenizer, seed=3), tokenizer)
    spec = load_speculation(str(tmp_path / "same"), tokenizer, num_tokens=2)
    engine = HFEngine(target, tokenizer, speculative=spec)
    reqs = requests(tokenizer)
    sampling = SamplingParams(max_new_tokens=10, temperature=0.0)
    assert [c[0].token_ids for c in engine.generate(reqs, sampling)] == [
        c[0].token_ids for c in HFEngine(target, tokenizer).generate(reqs, sampling)]
    with pytest.raises(RolloutError, match="not 'ngram', a tiny preset"):
        load_speculation(str(tmp_path / "nowhere"), tokenizer)
    assert load_speculation("ngram", tokenizer, ngram=2).draft is None


def test_unusable_drafts_and_settings_are_refused(tokenizer, target):
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=1, n_head=2, n_positions=64))
    with pytest.raises(RolloutError, match="draft model cannot take the fast decoder"):
        HFEngine(target, tokenizer, speculative=Speculation(gpt2))
    wider = build_tiny_model("tiny-1m", tokenizer, seed=0)
    wider.resize_token_embeddings(len(tokenizer) + 8)
    with pytest.raises(RolloutError, match="must share the target's vocabulary"):
        HFEngine(target, tokenizer, speculative=Speculation(wider))
    with pytest.raises(RolloutError, match="num_tokens must be >= 1"):
        Speculation(None, num_tokens=0)


# ---- where it is switched on: the recipes' config, eval's policy, serve ---------------------------------------


def test_the_config_switches_it_on_for_rl_eval_and_serve(tmp_path, tokenizer, target):
    from pydantic import ValidationError

    from posttrain.config import EvalRuntime, RLRecipe
    from posttrain.evaluate import load_policy
    from posttrain.rl.backend import make_engine
    from posttrain.rl.trainer import _engine_figures
    from posttrain.serve import load_engine, make_backend
    from posttrain.serve.backends import VLLMBackend

    with pytest.raises(ValidationError, match="speculative decoding is the built-in engine's"):
        RLRecipe.model_validate({"model": {"path": "x"},
                                 "rollout": {"engine": "vllm", "speculative": {"draft": "ngram"}}})
    recipe = RLRecipe.model_validate({"rollout": {"speculative": {"draft": "ngram", "num_tokens": 3}}})
    runtime = type("Runtime", (), {"autocast_dtype": None})()
    rl_engine = make_engine(target, tokenizer, runtime, recipe)
    assert rl_engine._speculator is not None and rl_engine._speculator.k == 3
    assert _engine_figures(rl_engine) == {}  # nothing drafted yet
    rl_engine.generate(requests(tokenizer), SamplingParams(max_new_tokens=16, temperature=1.0, n=2, seed=0))
    figures = _engine_figures(rl_engine)  # what the RL step logs
    assert figures["rollout/spec_acceptance"] == rl_engine.stats.acceptance_rate
    assert figures["rollout/engine_tokens_per_s"] > 0

    save_model_dir(tmp_path / "policy", target, tokenizer)
    policy = load_policy(tmp_path / "policy", EvalRuntime(device="cpu", speculative={"draft": "ngram"}))
    assert policy.engine._speculator is not None
    served = load_engine(tmp_path / "policy", device="cpu", draft="ngram", num_draft_tokens=2)
    reqs = requests(tokenizer)
    sampling = SamplingParams(max_new_tokens=16, temperature=0.0)
    expected = [c[0].token_ids for c in HFEngine(target, tokenizer).generate(reqs, sampling)]
    assert [c[0].token_ids for c in served.generate(reqs, sampling)] == expected
    assert served.stats.draft_tokens > 0
    # Serving with a draft batches requests per engine call (the speculative rounds run inside generate).
    assert isinstance(make_backend(tmp_path / "policy", "hf", device="cpu", draft="ngram"), VLLMBackend)
