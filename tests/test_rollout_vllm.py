"""VLLMEngine without vLLM: the clear error, and the pure pieces (request kwargs, output conversion)."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest

from posttrain.models import train_tokenizer
from posttrain.rollout import RolloutError, VLLMEngine
from posttrain.rollout.stopping import StopRule
from posttrain.rollout.vllm_engine import completion_from_vllm, vllm_sampling_kwargs
from posttrain.types import SamplingParams


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(["ab\n\ncd ef the quick brown fox\n"] * 20, vocab_size=300)


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed")
def test_missing_vllm_is_a_clear_error():
    with pytest.raises(RolloutError, match="needs vLLM.*pip install"):
        VLLMEngine("some/model/dir")


def test_sampling_kwargs_ask_for_the_sampled_logprob_and_keep_stop_strings():
    sampling = SamplingParams(max_new_tokens=9, temperature=0.7, n=4, stop=["</answer>"], stop_token_ids=[5])
    kwargs = vllm_sampling_kwargs(sampling, {5, 1}, seed=42)
    assert kwargs["logprobs"] == 0 and kwargs["include_stop_str_in_output"] is True
    assert kwargs["stop_token_ids"] == [1, 5] and kwargs["top_k"] == -1 and kwargs["max_tokens"] == 9
    assert kwargs["n"] == 4 and kwargs["seed"] == 42


def _output(tokenizer, text, finish_reason, stop_reason=None):
    ids = tokenizer(text)["input_ids"]
    steps = [{token: SimpleNamespace(logprob=-0.5 * (i + 1))} for i, token in enumerate(ids)]
    return SimpleNamespace(token_ids=ids, logprobs=steps, finish_reason=finish_reason, stop_reason=stop_reason)


def test_vllm_outputs_are_cut_like_the_hf_engine(tokenizer):
    keep = StopRule(tokenizer, [tokenizer.eos_token_id], SamplingParams(stop=["\nc"]))
    completion = completion_from_vllm(_output(tokenizer, "ab\n\nc", "stop", "\nc"), keep, 7, "r1")
    assert (completion.text, completion.finish_reason, completion.policy_version) == ("ab\n\nc", "stop", 7)
    assert completion.logprobs == [-0.5 * (i + 1) for i in range(len(completion.token_ids))]
    assert completion.request_id == "r1"
    drop = StopRule(tokenizer, [], SamplingParams(stop=["\nc"], include_stop_in_output=False))
    completion = completion_from_vllm(_output(tokenizer, "ab\n\nc", "stop", "\nc"), drop, 7, "r1")
    assert completion.text in ("ab\n", "ab") and completion.text == tokenizer.decode(completion.token_ids)
    assert len(completion.logprobs) == len(completion.token_ids)
    completion = completion_from_vllm(_output(tokenizer, "ab", "length"), drop, 7, "r1")
    assert completion.finish_reason == "length" and completion.text == "ab"
