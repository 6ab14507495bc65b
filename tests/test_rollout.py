"""HFEngine: logprobs equal a teacher-forced forward pass, greedy equals `generate`, stops, seeds, weights."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from posttrain.models import build_tiny_model, train_tokenizer
from posttrain.rollout import HFEngine, RolloutError, state_for_engine
from posttrain.rollout.stopping import StopRule
from posttrain.types import GenerationRequest, InferenceEngine, SamplingParams

CORPUS = [
    "12+34=46 the quick brown fox jumps over the lazy dog.\n",
    "Answer: 7\n\nThe invoice total is $1,234.50.\n",
    '{"name": "calculator", "arguments": {"expression": "2+3"}}\n',
] * 20 + [f"{i}*{i}={i * i}\n" for i in range(100)]


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(CORPUS, vocab_size=300)


@pytest.fixture(scope="module")
def model(tokenizer):
    return build_tiny_model("tiny-1m", tokenizer, seed=0).eval()


def requests(tokenizer, texts=("12+3=", "the quick brown fox jumps", "Answer:")):
    return [GenerationRequest(tokenizer(t)["input_ids"], request_id=f"r{i}") for i, t in enumerate(texts)]


def teacher_forced(model, prompt, completion, temperature=1.0):
    """log_softmax(logits / T) of each completion token, from one unpadded forward pass."""
    ids = torch.tensor([list(prompt) + list(completion)])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    return logprobs.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


def max_gap(model, reqs, groups, temperature):
    gap = 0.0
    for request, group in zip(reqs, groups):
        for completion in group:
            reference = teacher_forced(model, request.prompt_token_ids, completion.token_ids, temperature)
            gap = max(gap, (reference - torch.tensor(completion.logprobs)).abs().max().item())
    return gap


def test_the_engine_satisfies_the_protocol(model, tokenizer):
    assert isinstance(HFEngine(model, tokenizer), InferenceEngine)


@pytest.mark.parametrize("runner", ["fast", "generic"])
@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 20, 0.9)])
def test_logprobs_equal_a_teacher_forced_forward(model, tokenizer, runner, temperature, top_k, top_p):
    engine = HFEngine(model, tokenizer, runner=runner)
    reqs = requests(tokenizer)  # prompts of 4, 9 and 2 tokens batch together
    sampling = SamplingParams(max_new_tokens=12, temperature=temperature, top_k=top_k, top_p=top_p, n=3, seed=3)
    groups = engine.generate(reqs, sampling)
    assert [len(g) for g in groups] == [3, 3, 3]
    assert all(c.request_id == r.request_id for r, g in zip(reqs, groups) for c in g)
    assert max_gap(model, reqs, groups, temperature) < 1e-4  # logprobs are untruncated, tempered


@pytest.mark.slow
def test_the_compiled_decode_step_samples_what_a_teacher_forced_forward_scores(model, tokenizer):
    engine = HFEngine(model, tokenizer, compile=True)
    reqs = requests(tokenizer)
    sampling = SamplingParams(max_new_tokens=12, temperature=1.0, n=3, seed=3)
    for _ in range(2):  # rows finish at different steps, so the second call runs compacted shapes too
        groups = engine.generate(reqs, sampling)
        assert max_gap(model, reqs, groups, 1.0) < 1e-4
    eager = HFEngine(model, tokenizer).generate(reqs, SamplingParams(max_new_tokens=12, temperature=0))
    compiled = engine.generate(reqs, SamplingParams(max_new_tokens=12, temperature=0))
    assert [c.token_ids for g in compiled for c in g] == [c.token_ids for g in eager for c in g]


@pytest.mark.slow
@pytest.mark.timeout(1800)  # two graphs (one row per prompt, several): a cold compile is minutes on 2 busy cores
def test_the_compiled_decode_step_is_not_recompiled_per_batch_shape(model, tokenizer):
    """Row counts, prompt lengths and finished rows that change from call to call, one row per prompt as RL's
    episodes ask: one graph serves them all (torch's 0/1 specialization of the first columns and its duck sizing
    of equal sizes each cost a recompile, ~10-30 CPU-s on 2 cores, before the engine kept clear of them)."""
    from torch._dynamo.utils import counters

    engine = HFEngine(model, tokenizer, compile=True)
    texts = ("12+3=", "the quick brown fox jumps", "Answer:", "7*8=", "a b c d e f g h", "x")
    engine.generate(requests(tokenizer, texts[:4]), SamplingParams(max_new_tokens=12, temperature=1.0, seed=0))
    # Several rows per prompt, none finishing: every prompt keeps all its rows (a size of 1 is specialized, so
    # n > 1 is a graph of its own)
    engine.generate(requests(tokenizer, texts[:3]), SamplingParams(max_new_tokens=12, n=3, seed=0))
    compiled = counters["stats"]["unique_graphs"]
    for count in (6, 3, 5, 2):
        engine.generate(requests(tokenizer, texts[:count]), SamplingParams(max_new_tokens=12, temperature=1.0,
                                                                           seed=count))
    # rows that finish at different steps: the batch is compacted and the prompts' rows no longer fill their
    # grid (a graph of its own, compiled for minutes on 2 cores, before the compiled step took one layout)
    often, lengths = list(range(0, tokenizer.vocab_size, 8)), []
    for count, n in ((3, 3), (5, 2)):
        groups = engine.generate(requests(tokenizer, texts[:count]),
                                 SamplingParams(max_new_tokens=12, n=n, seed=count, stop_token_ids=often))
        lengths += [len(c.token_ids) for g in groups for c in g]
    assert min(lengths) < max(lengths)
    assert counters["stats"]["unique_graphs"] == compiled


def test_greedy_equals_transformers_generate(model, tokenizer):
    reqs = requests(tokenizer)
    for runner in ("fast", "generic"):
        engine = HFEngine(model, tokenizer, runner=runner)
        groups = engine.generate(reqs, SamplingParams(max_new_tokens=16, temperature=0))
        for request, (completion,) in zip(reqs, groups):
            with torch.no_grad():
                out = model.generate(
                    torch.tensor([request.prompt_token_ids]), do_sample=False, max_new_tokens=16,
                    pad_token_id=tokenizer.pad_token_id,
                )  # fmt: skip
            assert completion.token_ids == out[0, len(request.prompt_token_ids) :].tolist()
        assert max_gap(model, reqs, groups, 1.0) < 1e-4  # greedy reports temperature-1 logprobs


def test_other_architectures_match_teacher_forcing(tokenizer):
    from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

    vocab = len(tokenizer)
    shape = {"vocab_size": vocab, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
    models = {
        "fast": [  # grouped-query attention, qkv biases (Qwen2), per-head q/k norms (Qwen3)
            Qwen2ForCausalLM(Qwen2Config(**shape, num_attention_heads=4, num_key_value_heads=2)),
            Qwen3ForCausalLM(Qwen3Config(**shape, num_attention_heads=4, num_key_value_heads=2, head_dim=16)),
        ],
        "generic": [GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_embd=64, n_layer=2, n_head=4))],
    }
    reqs = requests(tokenizer)
    for runner, candidates in models.items():
        for candidate in candidates:
            engine = HFEngine(candidate.eval(), tokenizer)
            assert engine.runner == runner
            groups = engine.generate(reqs, SamplingParams(max_new_tokens=8, temperature=0.8, n=2, seed=0))
            assert max_gap(candidate, reqs, groups, 0.8) < 1e-4


def test_group_sampling_prefills_each_prompt_once(model, tokenizer, monkeypatch):
    from posttrain.rollout import decoder

    engine = HFEngine(model, tokenizer)
    seen = []
    original = decoder._layers

    def spy(x, *args):
        seen.append(tuple(x.shape[:2]))
        return original(x, *args)

    monkeypatch.setattr(decoder, "_layers", spy)  # the layer stack, run by the prefill and each decode step
    reqs = requests(tokenizer)
    engine.generate(reqs, SamplingParams(max_new_tokens=3, n=4, seed=0))
    width = max(len(r.prompt_token_ids) for r in reqs)
    assert seen[0] == (3, width)  # one prefill row per prompt (left-padded), not one per sample
    assert all(shape[1] == 1 for shape in seen[1:])  # then one token per running sequence


def test_shared_prompts_prefill_a_repeated_prompt_once_and_keep_each_request_s_samples(model, tokenizer,
                                                                                     monkeypatch):
    """An RL group's episodes reach the engine as one-sample requests with their own seeds. With share_prompts the
    engine prefills a repeated prompt once (its rows share its KV) and every request gets the tokens it samples
    alone (its seed stream), in its place, with log-probs a teacher-forced forward gives (fp32: not bit-identical
    to separate prefills, within float noise)."""
    from posttrain.rollout import decoder

    texts = ("12+3=", "the quick brown fox jumps", "12+3=", "Answer:", "12+3=", "the quick brown fox jumps")
    reqs = requests(tokenizer, texts)
    seeds = [40 + i for i in range(len(reqs))]
    sampling = SamplingParams(max_new_tokens=8, n=2, stop_token_ids=[tokenizer("3")["input_ids"][-1]])
    plain = HFEngine(model, tokenizer).generate(reqs, sampling, request_seeds=seeds)
    shared = HFEngine(model, tokenizer, share_prompts=True)
    seen = []
    original = decoder._layers

    def spy(x, *args):
        seen.append(tuple(x.shape[:2]))
        return original(x, *args)

    monkeypatch.setattr(decoder, "_layers", spy)
    groups = shared.generate(reqs, sampling, request_seeds=seeds)
    assert seen[0][0] == 3  # three distinct prompts prefilled, not six
    assert [[c.token_ids for c in g] for g in groups] == [[c.token_ids for c in g] for g in plain]
    assert [[c.request_id for c in g] for g in groups] == [[r.request_id] * 2 for r in reqs]
    for a_group, b_group in zip(groups, plain):
        for a, b in zip(a_group, b_group):
            assert a.finish_reason == b.finish_reason and a.logprobs == pytest.approx(b.logprobs, abs=1e-5)
    assert max_gap(model, reqs, groups, 1.0) < 1e-4
    assert len({tuple(c.token_ids) for g in groups[::2] for c in g}) > 1  # one prompt, other seeds: other samples


def test_rl_s_rollout_engine_knobs_reach_its_engine(model, tokenizer):
    from posttrain.config import RLRecipe
    from posttrain.rl.backend import make_engine

    runtime = type("Runtime", (), {"autocast_dtype": None})()
    assert make_engine(model, tokenizer, runtime, RLRecipe()).share_prompts is True  # on by default
    recipe = RLRecipe.model_validate({"rollout": {"share_prompts": False}})
    assert make_engine(model, tokenizer, runtime, recipe).share_prompts is False
    assert make_engine(model, tokenizer, runtime, RLRecipe())._runner.prepack is True  # prepacked linears: default
    recipe = RLRecipe.model_validate({"rollout": {"prepack_weights": False}})
    assert make_engine(model, tokenizer, runtime, recipe)._runner.prepack is False


def test_stop_rule_cuts_on_token_boundaries(tokenizer):
    ids = tokenizer("ab\n\ncd ef")["input_ids"]
    assert [tokenizer.decode([i]) for i in ids][:5] == ["a", "b", "\n", "\n", "c"]
    logprobs = [-float(i) for i in range(5)]
    rule = StopRule(tokenizer, [], SamplingParams(stop=["\nc"]))
    assert rule.string_hits([ids[:5], ids[:4]]) == [True, False]  # noticed at the token completing it
    assert rule.cut(ids[:5], logprobs, "string") == (ids[:5], logprobs, "ab\n\nc")
    rule = StopRule(tokenizer, [], SamplingParams(stop=["\nc"], include_stop_in_output=False))
    assert rule.cut(ids[:5], logprobs, "string") == (ids[:3], logprobs[:3], "ab\n")
    # A token carrying the end of a stop string and more: kept whole (text runs past the stop), or dropped.
    ids = tokenizer("the quick")["input_ids"]
    assert [tokenizer.decode([i]) for i in ids][:2] == ["t", "he"]
    rule = StopRule(tokenizer, [], SamplingParams(stop=["h"]))
    assert rule.cut(ids[:2], [0.0, 0.0], "string")[2] == "the"
    rule = StopRule(tokenizer, [], SamplingParams(stop=["h"], include_stop_in_output=False))
    assert rule.cut(ids[:2], [0.0, 0.0], "string") == (ids[:1], [0.0], "t")


def _clean_stop(text):
    """A two-character stop string from the middle of `text`, plain ASCII, first occurring there."""
    for start in range(2, len(text) - 2):
        candidate = text[start : start + 2]
        if candidate.isascii() and candidate.isprintable() and text.find(candidate) == start:
            return candidate
    pytest.skip("no clean stop string in this sample")


@pytest.mark.parametrize("include", [True, False])
def test_stop_strings_cut_text_and_tokens_consistently(model, tokenizer, include):
    engine = HFEngine(model, tokenizer)
    reqs = requests(tokenizer)
    free = engine.generate(reqs, SamplingParams(max_new_tokens=24, seed=1))
    for slot, (request, (completion,)) in enumerate(zip(reqs, free)):
        stop = _clean_stop(completion.text)
        sampling = SamplingParams(max_new_tokens=24, seed=1, stop=[stop], include_stop_in_output=include)
        (stopped,) = engine.generate(reqs, sampling)[slot]  # the same random streams as `free`
        assert stopped.finish_reason == "stop"
        assert stopped.text == tokenizer.decode(stopped.token_ids, skip_special_tokens=True)
        assert stopped.token_ids == completion.token_ids[: len(stopped.token_ids)]
        assert stopped.logprobs == pytest.approx(completion.logprobs[: len(stopped.token_ids)], abs=1e-5)
        position = completion.text.find(stop)
        if include:  # the shortest run of tokens whose text contains the stop string
            assert stop in stopped.text and stop not in tokenizer.decode(stopped.token_ids[:-1])
        else:  # every token lying wholly before the stop string
            assert stop not in stopped.text and len(stopped.text) <= position
            longer = tokenizer.decode(completion.token_ids[: len(stopped.token_ids) + 1])
            assert len(longer) > position


def test_finish_reasons_and_stop_tokens(model, tokenizer):
    engine = HFEngine(model, tokenizer)
    (request,) = requests(tokenizer, ["12+3="])
    (free,) = engine.generate([request], SamplingParams(max_new_tokens=5, temperature=0))[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 5
    stop_id = free.token_ids[2]
    sampling = SamplingParams(max_new_tokens=5, temperature=0, stop_token_ids=[stop_id])
    (stopped,) = engine.generate([request], sampling)[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids == free.token_ids[: free.token_ids.index(stop_id) + 1]
    sampling = dataclasses.replace(sampling, include_stop_in_output=False)
    (dropped,) = engine.generate([request], sampling)[0]
    assert dropped.token_ids == stopped.token_ids[:-1] and dropped.logprobs == stopped.logprobs[:-1]
    # The tokenizer's eos always stops and is kept (the trainer must learn to emit it).
    assert tokenizer.eos_token_id in engine.eos_ids


def test_seeds_reproduce_and_do_not_depend_on_batching(model, tokenizer):
    reqs = requests(tokenizer)
    sampling = SamplingParams(max_new_tokens=10, n=4, seed=11)
    big, small = HFEngine(model, tokenizer), HFEngine(model, tokenizer, max_batch_size=4)
    first, again = big.generate(reqs, sampling), big.generate(reqs, sampling)
    chunked = small.generate(reqs, sampling)  # one prompt's group per chunk
    ids = lambda groups: [[c.token_ids for c in g] for g in groups]
    assert ids(first) == ids(again) == ids(chunked)
    assert ids(first) != ids(big.generate(reqs, dataclasses.replace(sampling, seed=12)))
    assert len({tuple(c.token_ids) for c in first[0]}) > 1  # the n samples of a group differ
    # A request seed gives the same tokens alone or batched with others (early finishers dropped mid-way).
    stops = dataclasses.replace(sampling, seed=None, stop_token_ids=[first[0][0].token_ids[3]])
    batched = big.generate(reqs, stops, request_seeds=[5, 6, 7])
    for index, seed in enumerate([5, 6, 7]):
        alone = big.generate([reqs[index]], dataclasses.replace(stops, seed=seed))
        assert ids(alone)[0] == ids(batched)[index]
    torch.manual_seed(0)
    unseeded = big.generate(reqs, dataclasses.replace(sampling, seed=None))
    torch.manual_seed(0)
    assert ids(unseeded) == ids(big.generate(reqs, dataclasses.replace(sampling, seed=None)))


def test_update_weights_in_place_tags_versions_and_rejects_bad_states(model, tokenizer):
    other = build_tiny_model("tiny-1m", tokenizer, seed=1).eval()
    engine = HFEngine(build_tiny_model("tiny-1m", tokenizer, seed=0), tokenizer, policy_version=3)
    reqs, greedy = requests(tokenizer), SamplingParams(max_new_tokens=8, temperature=0)
    before = engine.generate(reqs, greedy)
    assert before[0][0].policy_version == 3
    parameters = {name: p.data_ptr() for name, p in engine.model.named_parameters()}
    seconds = engine.update_weights({f"module.{k}": v for k, v in other.state_dict().items()}, version=4)
    assert seconds > 0 and engine.stats.last_update_s == seconds
    assert parameters == {name: p.data_ptr() for name, p in engine.model.named_parameters()}  # in place
    after = engine.generate(reqs, greedy)
    expected = HFEngine(other, tokenizer).generate(reqs, greedy)
    assert [g[0].token_ids for g in after] == [g[0].token_ids for g in expected]
    assert [g[0].token_ids for g in after] != [g[0].token_ids for g in before]
    assert after[0][0].policy_version == engine.policy_version == 4

    good = other.state_dict()
    wrong_shape = {**good, "lm_head.weight": torch.zeros(3, 3)}
    missing = {k: v for k, v in good.items() if k != "model.norm.weight"}
    unknown = {**good, "model.extra.weight": torch.zeros(1)}
    lora = {**good, "model.layers.0.self_attn.q_proj.lora_A.default.weight": torch.zeros(1)}
    for bad, words in [(wrong_shape, "shape"), (missing, "missing"), (unknown, "does not have"), (lora, "LoRA")]:
        with pytest.raises(RolloutError, match=words):
            engine.update_weights(bad, version=5)
    assert engine.policy_version == 4  # nothing was copied
    assert [g[0].token_ids for g in engine.generate(reqs, greedy)] == [g[0].token_ids for g in after]


def test_lora_weights_reach_the_engine_merged(model, tokenizer):
    import copy

    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    from posttrain.config import LoraConfig
    from posttrain.models import apply_lora, merged_copy

    trainer = apply_lora(copy.deepcopy(model), LoraConfig(enabled=True, r=4))
    with torch.no_grad():
        for name, parameter in trainer.named_parameters():
            if "lora_B" in name:
                parameter.normal_(0, 0.5)
    # A trained head kept whole (`modules_to_save`) comes through as that layer's weight.
    saved_config = PeftLoraConfig(r=2, target_modules=["q_proj"], modules_to_save=["lm_head"])
    saved = get_peft_model(copy.deepcopy(model), saved_config)
    with torch.no_grad():
        saved.base_model.model.lm_head.modules_to_save["default"].weight.add_(1.0)
    state = state_for_engine(saved)
    assert torch.equal(state["lm_head.weight"], model.lm_head.weight + 1.0) and "model.norm.weight" in state
    engine = HFEngine(copy.deepcopy(model), tokenizer)
    engine.update_weights(state_for_engine(trainer), version=1)
    reference = merged_copy(trainer)
    for name, tensor in reference.state_dict().items():
        assert torch.allclose(engine.model.state_dict()[name], tensor, atol=1e-6), name
    with pytest.raises(RolloutError, match="plain model"):
        HFEngine(trainer, tokenizer)


def test_bf16_autocast_logprobs_stay_close(model, tokenizer):
    engine = HFEngine(model, tokenizer, autocast="bfloat16")
    reqs = requests(tokenizer)
    groups = engine.generate(reqs, SamplingParams(max_new_tokens=12, n=2, seed=0))
    gap = max_gap(model, reqs, groups, 1.0)  # engine in bf16 vs trainer in fp32
    assert 0 < gap < 0.2
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast_gap = max_gap(model, reqs, groups, 1.0)  # vs a trainer under the same autocast
    assert autocast_gap < gap


def test_engine_threads_apply_while_generating_only(model, tokenizer):
    from concurrent.futures import ThreadPoolExecutor

    engine = HFEngine(model, tokenizer, num_threads=1)
    seen, run_chunk = [], engine._run_chunk

    def recording(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return run_chunk(*args, **kwargs)

    engine._run_chunk = recording
    before = torch.get_num_threads()
    with ThreadPoolExecutor(1) as worker:
        worker.submit(torch.set_num_threads, 2).result()
        worker.submit(engine.generate, requests(tokenizer), SamplingParams(max_new_tokens=2)).result()
        assert seen and set(seen) == {1}  # sampling ran on the engine's share of the cores
        assert worker.submit(torch.get_num_threads).result() == 2  # and gave the caller its own back
    assert torch.get_num_threads() == before
    engine.generate(requests(tokenizer), SamplingParams(max_new_tokens=2))  # an inline caller (the trainer's thread)
    assert seen[-1] == 1 and torch.get_num_threads() == before


def test_bad_requests_raise_clear_errors(model, tokenizer):
    engine = HFEngine(model, tokenizer)
    with pytest.raises(RolloutError, match="empty prompt"):
        engine.generate([GenerationRequest([])], SamplingParams())
    with pytest.raises(RolloutError, match=r"token ids must be in \[0, "):
        engine.generate([GenerationRequest([10**6])], SamplingParams())
    with pytest.raises(RolloutError, match="top_p"):
        engine.generate(requests(tokenizer), SamplingParams(top_p=0))
    with pytest.raises(RolloutError, match="no room"):
        engine.generate([GenerationRequest([1] * 1024)], SamplingParams())
    with pytest.raises(RolloutError, match="dtype"):
        HFEngine(model, tokenizer, dtype="int8")
