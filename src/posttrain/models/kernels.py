"""Prepacked CPU linears: a weight reordered once into oneDNN's blocked layout, then multiplied many times.

`F.linear` on CPU sends float32 matmuls to the BLAS torch was built with (MKL), which on some CPUs runs far
below the core's peak — measured on a 2-core AMD EPYC with AVX-512 (CPU family 26): float32 linears of 64 rows
x 256 -> 768 at ~110 GFLOP/s through `F.linear`, ~240 through oneDNN with the weight prepacked; oneDNN's JIT
picks the ISA from the CPU's features. bfloat16 `F.linear` already runs oneDNN but reorders the weight on every
call; prepacked it is 1.03-2.18x faster and gives the same bits (the same kernel on the same operands). Both
kernels compute a float32 matmul in float32 (no reduced-precision mode: the error against a float64 reference is
the same, ~2e-6 at these shapes); only the order of the sums differs, so results agree to float rounding.

A weight changed in place (an optimizer step, a weight sync) must be packed again: the callers key their packed
copies on the parameter's version counter. `torch.compile` cannot take a packed weight as a graph input
(inductor packs constants itself, under freezing), so compiled code keeps `F.linear`.

Where MKL is faster: small float32 matmuls, where oneDNN's fixed cost per call (~9-11 us) outweighs its
faster inner loop. Measured on the same core, 1 thread, the crossover is at ~0.5M multiply-adds for two rows or
more (2 x 256 -> 512, 0.26M: MKL 12 us, oneDNN 16; 4 x 256 -> 512: 19 against 16) and ~2M for a single row
(1 x 896 -> 1,152: MKL 1.1x ahead; 1 x 1,024 -> 2,048: even); `bench/linear_kernels.py` measures them. The
choice is made per weight for a whole batch (`prefer_prepacked`, from the batch's rows), not per call: a weight
whose prefill ran on its packed copy and whose decode steps ran on the dense one keeps both copies in the cache
(batch-1 sampling on tiny-3m was 6% slower that way than with `F.linear` throughout, in a development A/B).

Use: ``packed = prepack(weight)`` (None where the kernel is unavailable: not a CPU tensor, a dtype other than
float32/bfloat16, a torch built without oneDNN, or a self-check that failed); for a batch of ``rows`` rows pass
it where ``prefer_prepacked(rows, weight)``: ``prepacked_linear(x, weight, bias, packed or None)``.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

PACKABLE = (torch.float32, torch.bfloat16)
# float32 matmuls smaller than these (multiply-adds) stay with `F.linear` (see above)
MIN_MACS = 1 << 19
MIN_MACS_ONE_ROW = 1 << 21


@functools.cache
def onednn_linear_works(dtype: torch.dtype) -> bool:
    """Whether this torch build runs prepacked oneDNN linears in `dtype` and they agree with `F.linear`
    (checked once per process on a small random case)."""
    if dtype not in PACKABLE or not torch.backends.mkldnn.is_available():
        return False
    try:
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(5, 48, generator=generator).to(dtype)
        weight = torch.randn(40, 48, generator=generator).to(dtype)
        bias = torch.randn(40, generator=generator).to(dtype)
        with torch.inference_mode():
            got = torch.ops.mkldnn._linear_pointwise(x, _reorder(weight), bias, "none", [], "")
            want = F.linear(x, weight, bias)
    except (RuntimeError, AttributeError) as error:  # a build without the op, or a CPU oneDNN cannot run
        log.info("prepacked oneDNN linears unavailable in %s: %s", dtype, error)
        return False
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    agrees = got.shape == want.shape and bool(torch.allclose(got.float(), want.float(), rtol=tolerance, atol=tolerance))
    if not agrees:
        log.warning("prepacked oneDNN linears disagree with F.linear in %s; not used", dtype)
    return agrees


def _reorder(weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), None)


def prepack(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` ([out, in]) in oneDNN's layout for `linear`, or None where the kernel does not apply."""
    if weight.device.type != "cpu" or weight.dim() != 2 or not onednn_linear_works(weight.dtype):
        return None
    if type(weight.data if isinstance(weight, torch.nn.Parameter) else weight) is not torch.Tensor:
        return None  # a tensor subclass (quantized weights): its own matmul runs it
    with torch.inference_mode():
        return _reorder(weight)


def prefer_prepacked(rows: int, weight: torch.Tensor) -> bool:
    """Whether a batch of `rows` rows (sequences decoding one token each) runs `weight` faster prepacked: always in
    bfloat16 (the same bits, and faster), in float32 above the sizes where MKL's call is cheaper (see above)."""
    if weight.dtype != torch.float32:
        return True
    macs = weight.numel()
    return rows * macs >= MIN_MACS and (rows >= 2 or macs >= MIN_MACS_ONE_ROW)


def prepacked_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                     packed: torch.Tensor | None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, through `packed` (the weight prepacked) when given."""
    if packed is None or x.dtype != weight.dtype or torch.is_autocast_enabled(x.device.type):
        return F.linear(x, weight, bias)  # (under an ambient autocast F.linear casts; the packed kernel would not)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
