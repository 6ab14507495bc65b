"""AsyncBatcher: concurrent callers share engine calls, each gets its own result, the loop stays responsive."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from posttrain.models import build_tiny_model, train_tokenizer
from posttrain.rollout import AsyncBatcher, HFEngine, RolloutError
from posttrain.types import GenerationRequest, SamplingParams

CORPUS = ["12+34=46 the quick brown fox jumps over the lazy dog.\n"] * 20 + [f"{i}*{i}={i * i}\n" for i in range(50)]


@pytest.fixture(scope="module")
def engine():
    tokenizer = train_tokenizer(CORPUS, vocab_size=300)
    return HFEngine(build_tiny_model("tiny-1m", tokenizer, seed=0), tokenizer, max_batch_size=64)


def prompts(engine, count):
    return [GenerationRequest(engine.tokenizer(f"{i}*{i}=")["input_ids"], request_id=f"e{i}") for i in range(count)]


def test_concurrent_callers_are_batched_and_get_their_own_results(engine):
    reqs = prompts(engine, 12)
    sampling = SamplingParams(max_new_tokens=6, n=2)

    async def episodes():
        async with AsyncBatcher(engine, max_wait_s=0.05) as batcher:
            seeded = [dataclasses.replace(sampling, seed=100 + i) for i in range(len(reqs))]
            results = await asyncio.gather(*(batcher.generate(r, s) for r, s in zip(reqs, seeded)))
            return results, batcher.stats

    calls_before = engine.stats.generate_calls
    results, stats = asyncio.run(episodes())
    assert stats.engine_calls == engine.stats.generate_calls - calls_before == 1
    assert stats.requests == 12 and stats.sequences == 24
    for index, (request, completions) in enumerate(zip(reqs, results)):
        assert [c.request_id for c in completions] == [request.request_id] * 2
        alone = engine.generate([request], dataclasses.replace(sampling, seed=100 + index))[0]
        assert [c.token_ids for c in completions] == [c.token_ids for c in alone]  # its own seeded stream


@pytest.mark.parametrize("inline", [False, True])
def test_the_engine_runs_on_the_loop_thread_only_when_inline(engine, inline):
    import functools
    import threading

    reqs = prompts(engine, 6)
    sampling = SamplingParams(max_new_tokens=5, n=2)
    threads, generate = [], engine.generate

    @functools.wraps(generate)  # keeps the signature: the batcher looks for request_seeds
    def recording(*args, **kwargs):
        threads.append(threading.get_ident())
        return generate(*args, **kwargs)

    async def episodes():
        async with AsyncBatcher(engine, max_wait_s=0.05, inline=inline) as batcher:
            seeded = [dataclasses.replace(sampling, seed=7 + i) for i in range(len(reqs))]
            return await asyncio.gather(*(batcher.generate(r, s) for r, s in zip(reqs, seeded))), batcher.stats

    engine.generate = recording
    try:
        results, stats = asyncio.run(episodes())
    finally:
        del engine.generate  # back to the class's method
    assert stats.engine_calls == 1 and (threads == [threading.get_ident()]) == inline
    for index, (request, completions) in enumerate(zip(reqs, results)):  # the same samples either way
        alone = engine.generate([request], dataclasses.replace(sampling, seed=7 + index))[0]
        assert [c.token_ids for c in completions] == [c.token_ids for c in alone]


def test_incompatible_sampling_goes_in_separate_batches(engine):
    reqs = prompts(engine, 8)
    cold, hot = SamplingParams(max_new_tokens=4, temperature=0.5), SamplingParams(max_new_tokens=4, temperature=1.0)

    async def episodes():
        async with AsyncBatcher(engine, max_wait_s=0.05) as batcher:
            results = await asyncio.gather(*(batcher.generate(r, cold if i % 2 else hot) for i, r in enumerate(reqs)))
            return results, batcher.stats

    results, stats = asyncio.run(episodes())
    assert stats.engine_calls == 2 and sorted(stats.batch_sizes) == [4, 4]
    assert all(len(r) == 1 for r in results)


def test_a_full_batch_runs_without_waiting_and_the_loop_stays_responsive(engine):
    reqs = prompts(engine, 16)
    sampling = SamplingParams(max_new_tokens=24, n=4)  # 16 x 4 = 64 sequences: one full batch

    async def episodes():
        ticks = 0

        async def heartbeat():
            nonlocal ticks
            while True:
                await asyncio.sleep(0.001)
                ticks += 1

        beat = asyncio.create_task(heartbeat())
        async with AsyncBatcher(engine, max_wait_s=30.0) as batcher:  # never waits the window out
            results = await asyncio.wait_for(asyncio.gather(*(batcher.generate(r, sampling) for r in reqs)), 20)
        beat.cancel()
        return results, ticks

    results, ticks = asyncio.run(episodes())
    assert len(results) == 16 and ticks > 5  # the event loop ran while the engine worked


def test_a_bad_request_fails_alone(engine):
    good = prompts(engine, 3)
    bad = GenerationRequest([], request_id="empty")

    async def episodes():
        async with AsyncBatcher(engine, max_wait_s=0.05) as batcher:
            sampling = SamplingParams(max_new_tokens=3)
            return await asyncio.gather(*(batcher.generate(r, sampling) for r in [*good, bad]), return_exceptions=True)

    *fine, failed = asyncio.run(episodes())
    assert isinstance(failed, RolloutError) and "empty prompt" in str(failed)
    assert all(len(r) == 1 and r[0].token_ids for r in fine)


@pytest.mark.parametrize("inline", [False, True])
def test_an_engine_that_drops_a_request_fails_that_request_not_wedges_it(engine, inline):
    """An engine answering fewer requests than it was given: each request is retried alone, and the one it
    drops gets an error at once instead of waiting on a future nobody resolves."""
    import functools

    reqs = prompts(engine, 4)
    generate = engine.generate

    @functools.wraps(generate)
    def dropping(requests, sampling, **kwargs):
        answers = generate(requests, sampling, **kwargs)
        return [a for r, a in zip(requests, answers) if r.request_id != "e2"]

    async def episodes():
        async with AsyncBatcher(engine, max_wait_s=0.05, inline=inline) as batcher:
            return await asyncio.wait_for(asyncio.gather(
                *(batcher.generate(r, SamplingParams(max_new_tokens=3)) for r in reqs), return_exceptions=True), 60)

    engine.generate = dropping
    try:
        results = asyncio.run(episodes())
    finally:
        del engine.generate
    assert isinstance(results[2], RuntimeError) and "answered 0 of 1" in str(results[2])
    assert all(len(r) == 1 and r[0].request_id == f"e{i}" for i, r in enumerate(results) if i != 2)


def test_a_batch_runs_without_the_window_once_every_announced_caller_waits(engine):
    import time

    reqs = prompts(engine, 3)
    sampling = SamplingParams(max_new_tokens=3)

    async def announced(batcher, request, started):
        with batcher.client():
            await batcher.generate(request, sampling)
            return time.monotonic() - started

    async def busy_elsewhere(batcher, seconds):
        with batcher.client():  # announced, but waiting on something else (a tool call, a sandbox)
            await asyncio.sleep(seconds)

    async def run(window, busy_s=None):
        async with AsyncBatcher(engine, max_wait_s=window) as batcher:
            started = time.monotonic()
            callers = [announced(batcher, r, started) for r in reqs]
            if busy_s is not None:
                callers.append(busy_elsewhere(batcher, busy_s))
            done = await asyncio.gather(*callers)
            return max(d for d in done if d is not None), batcher.stats

    done, stats = asyncio.run(run(5.0))
    assert done < 2.0 and stats.batch_sizes == [3]  # no one left to add a request: the 5 s window is skipped
    done, stats = asyncio.run(run(0.5, busy_s=4.0))
    # One announced caller is busy elsewhere: the window applies (not at once, and not until it is done).
    assert stats.batch_sizes == [3] and 0.5 <= done < 3.5


def test_a_caller_leaving_wakes_the_batch_of_the_callers_left(engine):
    import time

    reqs = prompts(engine, 2)
    sampling = SamplingParams(max_new_tokens=3)

    async def announced(batcher, request):
        with batcher.client():
            return await batcher.generate(request, sampling), time.monotonic()

    async def leaves_soon(batcher):
        with batcher.client():
            await asyncio.sleep(0.2)

    async def run():
        async with AsyncBatcher(engine, max_wait_s=5.0) as batcher:
            started = time.monotonic()
            results = await asyncio.gather(*(announced(batcher, r) for r in reqs), leaves_soon(batcher))
            return [done - started for _, done in results[:2]], batcher.stats

    finished, stats = asyncio.run(run())
    assert stats.batch_sizes == [2] and max(finished) < 2.0  # ran when the third caller left, not after 5 s
