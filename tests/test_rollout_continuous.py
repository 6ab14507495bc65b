"""`ContinuousBatcher`: requests joining a running batch sample exactly what the engine samples for each alone."""

from __future__ import annotations

import pytest
import torch
from posttrain.models import build_tiny_model
from posttrain.rollout import HFEngine
from posttrain.rollout.continuous import ContinuousBatcher, StreamRequest
from posttrain.rollout.errors import RolloutError
from posttrain.types import GenerationRequest, SamplingParams


@pytest.fixture(autouse=True)
def one_thread():
    # Decoding a tiny model on a shared CPU: 2 OpenMP threads spinning against other processes made these
    # tests minutes long; 1 thread keeps them at seconds.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def prompts(tiny_tokenizer):
    texts = [f"What is {i} + {3 * i}? " * (1 + i % 3) for i in range(10)]
    return [tiny_tokenizer(t)["input_ids"] for t in texts]


def _requests(prompts):
    requests = []
    for i, prompt in enumerate(prompts):
        sampling = SamplingParams(max_new_tokens=6 + 3 * i, temperature=0 if i % 2 else 0.9,
                                  top_p=0.8 if i % 3 == 0 else 1.0, n=2 if i % 4 == 0 else 1, seed=100 + i)
        requests.append(StreamRequest(prompt, sampling, top_logprobs=2 if i == 3 else 0))
    return requests


def _alone(engine, request):
    return engine.generate([GenerationRequest(request.prompt_token_ids)], request.sampling,
                           request_seeds=[request.sampling.seed])[0]


@pytest.mark.parametrize("runner", ["fast", "generic"])
def test_staggered_arrivals_sample_what_each_request_samples_alone(tiny_tokenizer, prompts, runner):
    engine = HFEngine(build_tiny_model("tiny-1m", tiny_tokenizer, seed=0), tiny_tokenizer, runner=runner)
    batcher = ContinuousBatcher(engine)
    requests = _requests(prompts)
    pending, step, peak = requests[:], 0, 0
    while pending or batcher.running or batcher.waiting:
        if pending and step % 2 == 0:  # one arrival every other step, while the others decode
            batcher.submit(pending.pop(0))
        batcher.step()
        peak = max(peak, batcher.running)
        step += 1
    if runner == "fast":
        assert peak >= 6, "arrivals did not join the running batch"
    for request in requests:
        for got, want in zip(request.completions, _alone(engine, request), strict=True):
            assert got.token_ids == want.token_ids
            assert got.text == want.text and got.finish_reason == want.finish_reason
            assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)
    events = requests[3].drain()
    assert events[-1].completion is requests[3].completions[0]
    assert all(len(e.top_logprobs) == 2 for e in events)


def test_a_cancelled_request_leaves_at_the_next_step_and_a_waiting_one_takes_its_slot(tiny_tokenizer, prompts):
    engine = HFEngine(build_tiny_model("tiny-1m", tiny_tokenizer, seed=0), tiny_tokenizer)
    batcher = ContinuousBatcher(engine, max_batch_size=2)
    long = [batcher.submit(StreamRequest(prompts[i], SamplingParams(max_new_tokens=500, temperature=1.0),
                                         ignore_eos=True)) for i in range(2)]
    third = batcher.submit(StreamRequest(prompts[2], SamplingParams(max_new_tokens=4, temperature=0)))
    for _ in range(3):
        batcher.step()
    assert batcher.running == 2 and batcher.waiting == 1  # full: the third waits
    batcher.cancel(long[0])
    batcher.step()
    assert batcher.waiting == 0 and third.first_token_s is not None  # it took the freed slot at once
    while not third.done:
        batcher.step()
    assert third.completions[0].token_ids == _alone(engine, third)[0].token_ids
    assert len(long[1].drain()) > 3 and not long[1].done  # the other long one kept decoding
    batcher.cancel(long[1])
    batcher.step()
    assert batcher.running == 0


def test_a_sampled_image_placeholder_ends_the_served_reply_before_it_as_in_generate(tiny_tokenizer, prompts):
    """A vision-language model served text-only (one that loads as a causal LM: Gemma 3, Llama 4 ...) may sample its
    image token; fed back, its forward would take it for an image slot with no image. The batcher ends the row just
    before it, as `HFEngine.generate` does (`rollout.stopping`)."""
    engine = HFEngine(build_tiny_model("tiny-1m", tiny_tokenizer, seed=0), tiny_tokenizer)
    greedy = SamplingParams(max_new_tokens=6, temperature=0)
    batcher = ContinuousBatcher(engine)
    full = batcher.submit(StreamRequest(prompts[1], greedy))
    while not full.done:
        batcher.step()
    (whole,) = full.completions
    assert whole.finish_reason == "length" and len(whole.token_ids) == 6
    placeholder = next(t for t in whole.token_ids if t != whole.token_ids[0])  # a cut inside the reply
    engine.placeholder_ids = frozenset({placeholder})  # as if that greedy token were the image token
    batcher = ContinuousBatcher(engine)
    cut = batcher.submit(StreamRequest(prompts[1], greedy))
    while not cut.done:
        batcher.step()
    (reply,) = cut.completions
    at = whole.token_ids.index(placeholder)
    assert 0 < at < 6
    assert reply.token_ids == whole.token_ids[:at] and reply.finish_reason == "stop"
    assert reply.logprobs == pytest.approx(whole.logprobs[:at], abs=1e-5)
    assert reply.token_ids == _alone(engine, cut)[0].token_ids  # the offline engine cuts it the same way
    assert batcher.running == 0


def test_requests_it_cannot_serve_are_refused_when_submitted(tiny_tokenizer):
    engine = HFEngine(build_tiny_model("tiny-1m", tiny_tokenizer, seed=0), tiny_tokenizer)
    batcher = ContinuousBatcher(engine)
    with pytest.raises(RolloutError, match="context"):
        batcher.submit(StreamRequest([5] * 1024, SamplingParams()))
    with pytest.raises(RolloutError, match="token ids"):
        batcher.submit(StreamRequest([10**6], SamplingParams()))
    with pytest.raises(RolloutError, match="top_p"):
        batcher.submit(StreamRequest([5], SamplingParams(top_p=0)))
    assert batcher.waiting == 0


def test_arrivals_join_a_running_batch_together_within_a_few_steps(tiny_tokenizer, prompts):
    """Each join copies the batch's KV: arrivals that trickle in one per step join in a few groups, none waiting
    more than `max_join_wait_steps` steps for its first token; with join_ratio=0 every arrival joins alone."""
    engine = HFEngine(build_tiny_model("tiny-1m", tiny_tokenizer, seed=0), tiny_tokenizer)

    def trickle(**policy):
        batcher = ContinuousBatcher(engine, **policy)
        requests = [StreamRequest(prompts[i % len(prompts)], SamplingParams(max_new_tokens=40, temperature=0.9,
                                                                            seed=i), ignore_eos=True)
                    for i in range(24)]
        waited = {}
        for step, request in enumerate(requests):
            batcher.submit(request)
            batcher.step()
            for r in requests[: step + 1]:
                if r.first_token_s is not None and id(r) not in waited:
                    waited[id(r)] = batcher.steps - 1
        arrived = {id(r): i for i, r in enumerate(requests)}
        while batcher.running or batcher.waiting:
            batcher.step()
            for r in requests:
                if r.first_token_s is not None and id(r) not in waited:
                    waited[id(r)] = batcher.steps - 1
        return batcher.joins, max(waited[k] - arrived[k] for k in waited), requests

    joins, longest_wait, together = trickle(max_join_wait_steps=4)
    assert joins <= 8 and longest_wait <= 4
    alone_joins, alone_wait, apart = trickle(join_ratio=0)
    assert alone_joins == 23 and alone_wait == 0  # the first starts the batch, each other arrival joins alone
    for a, b in zip(together, apart):  # when a request joins does not change what it samples
        assert a.completions[0].token_ids == b.completions[0].token_ids


# Every family the generic runner serves (tests/test_conformance.py builds each tiny, with sliding windows of 5
# tokens, soft-caps, fused projections, partial rotary... switched on).
GENERIC_FAMILIES = ["qwen2", "mistral", "gemma2", "gemma3", "phi3", "olmo2", "gpt_neox"]


@pytest.mark.parametrize("family", GENERIC_FAMILIES)
def test_arrivals_join_a_running_batch_of_every_generic_family(tiny_tokenizer, prompts, family):
    """Requests arriving mid-decode join the running batch (shorter and longer prompts than the running rows'
    columns, past the sliding window and before it) and decode greedily what each decodes alone."""
    from test_conformance import build

    engine = HFEngine(build(family), tiny_tokenizer)
    assert engine.runner == "generic"
    batcher = ContinuousBatcher(engine, join_ratio=0)  # every arrival joins at the next step
    requests = [StreamRequest(prompts[i], SamplingParams(max_new_tokens=4 + 3 * i, temperature=0,
                                                         n=2 if i == 3 else 1))
                for i in (9, 0, 4, 3, 8, 1)]  # long, short, mid...: both caches get left-padded in turn
    pending, peak = requests[:], 0
    while pending or batcher.running or batcher.waiting:
        if pending:
            batcher.submit(pending.pop(0))
        batcher.step()
        peak = max(peak, batcher.running)
    assert batcher.joins >= 3 and peak >= 4, "arrivals did not join the running batch"
    for request in requests:
        for got, want in zip(request.completions, _alone(engine, request), strict=True):
            assert got.token_ids == want.token_ids, family
            assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)


def test_requests_submitted_together_start_together_and_a_bad_one_is_refused_alone(tiny_tokenizer, prompts):
    engine = HFEngine(build_tiny_model("tiny-1m", tiny_tokenizer, seed=0), tiny_tokenizer)
    batcher = ContinuousBatcher(engine)
    requests = [r for r in _requests(prompts) if r.sampling.n == 1][:5]  # one group size: one prefill
    bad = StreamRequest([engine.vocab_size + 1], SamplingParams(max_new_tokens=4))
    refused = batcher.submit_many([*requests[:2], bad, *requests[2:]])
    assert [r for r, _ in refused] == [bad] and "token ids" in str(refused[0][1])
    batcher.step()
    assert batcher.running == len(requests) and batcher.joins == 0
    while batcher.step():
        pass
    for request in requests:
        for got, want in zip(request.completions, _alone(engine, request), strict=True):
            assert got.token_ids == want.token_ids
    with pytest.raises(RolloutError, match="token ids"):
        batcher.submit(bad)
