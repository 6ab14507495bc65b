"""Prepacked oneDNN linears (`posttrain.models.kernels`): the same maths as `F.linear`, and the engine runs them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from posttrain.models import build_tiny_model, train_tokenizer
from posttrain.models.kernels import onednn_linear_works, prefer_prepacked, prepack, prepacked_linear
from posttrain.rollout import HFEngine
from posttrain.types import GenerationRequest, SamplingParams

pytestmark = pytest.mark.skipif(not onednn_linear_works(torch.float32), reason="torch built without oneDNN linears")

SHAPES = [((1, 256), 768), ((2, 64), 192), ((7, 100), 37), ((64, 256), 1024), ((3, 5, 48), 40), ((500, 512), 256)]


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("x_shape,out", SHAPES)
def test_a_prepacked_linear_computes_f_linear(x_shape, out, bias):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(*x_shape, generator=generator)
    weight = torch.randn(out, x_shape[-1], generator=generator) / x_shape[-1] ** 0.5
    b = torch.randn(out, generator=generator) if bias else None
    with torch.inference_mode():
        # float32: the same sums in another order (both kernels are strict fp32; no reduced-precision mode)
        reference = F.linear(x.double(), weight.double(), None if b is None else b.double())
        got, want = prepacked_linear(x, weight, b, prepack(weight)), F.linear(x, weight, b)
        assert got.shape == want.shape and got.dtype == torch.float32
        assert (got - reference).abs().max() <= 4 * (want - reference).abs().max() + 1e-6
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        # bfloat16: the very bits of F.linear, and of a float32 linear under autocast
        xb, wb, bb = x.bfloat16(), weight.bfloat16(), None if b is None else b.bfloat16()
        packed = prepacked_linear(xb, wb, bb, prepack(wb))
        assert torch.equal(packed, F.linear(xb, wb, bb))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert torch.equal(packed, F.linear(xb.float(), wb.float(), None if bb is None else bb.float()))


def test_bfloat16_prepacked_gives_the_bits_of_f_linear_over_a_sweep():
    """The sweep docs/benchmarks.md cites: 10 row counts x 6 weight shapes x with and without bias."""
    if not onednn_linear_works(torch.bfloat16):
        pytest.skip("no bfloat16 oneDNN linears in this build")
    generator = torch.Generator().manual_seed(0)
    checked = 0
    for rows in (1, 2, 3, 7, 8, 16, 33, 64, 128, 500):
        for out, inner in ((192, 64), (768, 256), (256, 512), (1152, 896), (40, 48), (37, 100)):
            weight = torch.randn(out, inner, generator=generator).bfloat16()
            x = torch.randn(rows, inner, generator=generator).bfloat16()
            packed = prepack(weight)
            for bias in (None, torch.randn(out, generator=generator).bfloat16()):
                with torch.inference_mode():
                    assert torch.equal(prepacked_linear(x, weight, bias, packed), F.linear(x, weight, bias))
                checked += 1
    assert checked == 120


def test_prepack_declines_what_it_cannot_run():
    assert prepack(torch.randn(8, 4, dtype=torch.float16)) is None  # not a dtype oneDNN packs here
    assert prepack(torch.randn(8)) is None  # not a matrix
    weight = torch.randn(6, 4)
    assert prepacked_linear(torch.randn(2, 4), weight, None, None).shape == (2, 6)  # no packed copy: F.linear


def kernel_calls(run) -> dict[str, int]:
    with torch.profiler.profile() as profiler:
        run()
    counts = {event.key: event.count for event in profiler.key_averages()}
    return {"packed": counts.get("mkldnn::_linear_pointwise", 0),
            "mm": counts.get("aten::mm", 0) + counts.get("aten::addmm", 0)}


def test_small_float32_matmuls_keep_f_linear_and_bfloat16_always_packs():
    def prefers(rows, shape, dtype=torch.float32):
        return prefer_prepacked(rows, torch.empty(*shape, dtype=dtype))

    assert not prefers(8, (192, 64))  # 98k multiply-adds: MKL's call is cheaper
    assert not prefers(1, (1152, 896)) and prefers(1, (2048, 1024))  # a single row: from ~2M
    assert not prefers(2, (512, 256)) and prefers(4, (512, 256))  # more rows: from ~0.5M
    assert prefers(1, (192, 64), torch.bfloat16)  # the same bits either way, and faster
    weight = torch.randn(192, 64)
    x = torch.randn(8, 64)
    assert kernel_calls(lambda: prepacked_linear(x, weight, None, None)) == {"packed": 0, "mm": 1}
    assert kernel_calls(lambda: prepacked_linear(x, weight, None, prepack(weight)))["packed"] == 1


def test_a_batch_keeps_one_kernel_per_weight_from_prefill_to_its_last_row(tokenizer):
    """One copy of each weight in use per batch: the choice follows the batch's rows at its start, not each call's
    rows (a one-row batch's prefill of many tokens does not run the packed copy its decode steps then leave)."""
    engine = HFEngine(build_tiny_model("tiny-3m", tokenizer, seed=0).eval(), tokenizer)
    one = [GenerationRequest(tokenizer("12 + 3 = 15. The answer is")["input_ids"])]
    calls = kernel_calls(lambda: engine.generate(one, SamplingParams(max_new_tokens=8, temperature=0)))
    assert calls["packed"] == 0, calls  # tiny-3m's matmuls of one row are all under the one-row size
    many = kernel_calls(lambda: generate(engine, tokenizer))
    assert many["packed"] > 0 and many["mm"] == 0, many  # 12 rows: every matmul packed, to the batch's end


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer([f"{i} + {i + 3} = {2 * i + 3}. The answer is {2 * i + 3}.\n" for i in range(200)],
                           vocab_size=300)


def generate(engine: HFEngine, tokenizer, seed: int = 5):
    prompts = [tokenizer(t)["input_ids"] for t in ("12 + 3 =", "The answer is", "7 +")]
    sampling = SamplingParams(max_new_tokens=16, temperature=1.0, n=4, seed=seed)
    return engine.generate([GenerationRequest(p) for p in prompts], sampling)


@pytest.mark.parametrize("autocast", [None, "bfloat16"])
def test_the_engine_runs_prepacked_linears_with_the_same_samples(tokenizer, autocast):
    if autocast and not onednn_linear_works(torch.bfloat16):
        pytest.skip("no bfloat16 oneDNN linears in this build")
    model = build_tiny_model("tiny-3m", tokenizer, seed=0).eval()
    packed = HFEngine(model, tokenizer, autocast=autocast)
    plain = HFEngine(model, tokenizer, autocast=autocast, prepack_weights=False)
    ops = kernel_calls(lambda: generate(packed, tokenizer))
    assert ops["packed"] > 0 and ops["mm"] == 0, ops  # every linear of the 12-row batch went through oneDNN
    assert kernel_calls(lambda: generate(plain, tokenizer))["packed"] == 0
    with_packing, without = generate(packed, tokenizer), generate(plain, tokenizer)
    tokens = [[c.token_ids for c in group] for group in with_packing]
    assert tokens == [[c.token_ids for c in group] for group in without]
    logprobs = torch.tensor([lp for group in with_packing for c in group for lp in c.logprobs])
    reference = torch.tensor([lp for group in without for c in group for lp in c.logprobs])
    if autocast:  # bf16: the same kernel on the same operands, so the same bits
        assert torch.equal(logprobs, reference)
    else:
        torch.testing.assert_close(logprobs, reference, rtol=0, atol=1e-5)


def test_a_weight_update_reaches_the_prepacked_copies(tokenizer):
    if not onednn_linear_works(torch.bfloat16):
        pytest.skip("no bfloat16 oneDNN linears in this build: nothing packed to go stale")
    engine = HFEngine(build_tiny_model("tiny-1m", tokenizer, seed=0), tokenizer, autocast="bfloat16")
    before = generate(engine, tokenizer)
    other = build_tiny_model("tiny-1m", tokenizer, seed=1).eval()
    engine.update_weights(other.state_dict(), version=1)
    after = generate(engine, tokenizer)
    fresh = generate(HFEngine(other, tokenizer, autocast="bfloat16", prepack_weights=False), tokenizer)
    assert [[c.logprobs for c in g] for g in after] == [[c.logprobs for c in g] for g in fresh]
    assert [[c.logprobs for c in g] for g in after] != [[c.logprobs for c in g] for g in before]


def test_speculative_decoding_follows_a_weight_update(tokenizer):
    """The speculative runner keeps its own resolved weights (packed or not): an in-place update must reach them."""
    from posttrain.rollout import Speculation

    engine = HFEngine(build_tiny_model("tiny-3m", tokenizer, seed=0), tokenizer,
                      speculative=Speculation(None, num_tokens=4, ngram=2))
    prompts = [GenerationRequest(tokenizer(t)["input_ids"]) for t in ("12 + 3 =", "The answer is")]
    greedy = SamplingParams(max_new_tokens=12, temperature=0)
    before = [g[0].token_ids for g in engine.generate(prompts, greedy)]
    other = build_tiny_model("tiny-3m", tokenizer, seed=1).eval()
    engine.update_weights(other.state_dict(), version=1)
    after = [g[0].token_ids for g in engine.generate(prompts, greedy)]
    assert after == [g[0].token_ids for g in HFEngine(other, tokenizer).generate(prompts, greedy)]
    assert after != before


def test_parameters_replaced_by_new_objects_reach_the_next_batch(tokenizer):
    engine = HFEngine(build_tiny_model("tiny-3m", tokenizer, seed=0), tokenizer)
    before = generate(engine, tokenizer)
    other = build_tiny_model("tiny-3m", tokenizer, seed=1).eval()
    engine.model.load_state_dict(other.state_dict(), assign=True)  # new Parameter objects, not an in-place copy
    after = generate(engine, tokenizer)
    fresh = generate(HFEngine(other, tokenizer, prepack_weights=False), tokenizer)
    assert [[c.token_ids for c in g] for g in after] == [[c.token_ids for c in g] for g in fresh]
    assert [[c.token_ids for c in g] for g in after] != [[c.token_ids for c in g] for g in before]


def test_no_packing_means_none_anywhere_and_an_ambient_autocast_is_obeyed(tokenizer):
    from posttrain.rollout import Speculation

    model = build_tiny_model("tiny-3m", tokenizer, seed=0).eval()
    speculative = HFEngine(model, tokenizer, autocast="bfloat16", prepack_weights=False,
                           speculative=Speculation(None, num_tokens=4, ngram=2))
    assert kernel_calls(lambda: generate(speculative, tokenizer))["packed"] == 0  # the speculative runners too
    weight = torch.randn(768, 256)
    x = torch.randn(64, 256)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert prepacked_linear(x, weight, None, prepack(weight)).dtype == F.linear(x, weight).dtype == torch.bfloat16
