"""Token sampling: temperature, top-k, top-p, greedy, and per-sequence random streams.

One step, for logits ``z`` of the rows still running:

    logprobs = log_softmax(z / T)                      (T = 1 when greedy: the reported behaviour logprobs)
    w        = exp(logprobs), zeroed outside top-k and then outside top-p (of the top-k mass)
    token    = first i with cumsum(w)[i] > u * sum(w)  (inverse-CDF draw, u ~ U[0, 1) from the row's stream)

so the reported logprob is always the untruncated temperature-scaled one (the `Completion` contract), and the
truncated distribution needs no renormalisation: scaling ``u`` by the surviving mass does it.

Reproducibility: every sequence (row) draws its uniforms up front from its own generator, seeded from
(seed, request slot, sample index) — so a seeded request samples the same tokens whatever else is in the
batch, however the batch is chunked, and whichever rows finish early. Without a seed, the seed is drawn from
torch's global generator, so ``torch.manual_seed`` fixes unseeded runs too.
"""

from __future__ import annotations

import hashlib

import torch

from posttrain.rollout.errors import RolloutError
from posttrain.types import SamplingParams


def stream_seed(seed: int, slot: int, sample: int) -> int:
    """The seed of the random stream of completion `sample` of the request in `slot`, for call seed `seed`."""
    digest = hashlib.blake2b(f"{seed}/{slot}/{sample}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & (2**63 - 1)


def unseeded() -> int:
    return int(torch.randint(0, 2**62, ()).item())


def check_sampling(sampling: SamplingParams) -> None:
    """Raise RolloutError naming the field when `sampling` cannot be honoured."""
    problems = []
    if sampling.temperature < 0:
        problems.append(f"temperature must be >= 0 (0 = greedy), got {sampling.temperature}")
    if not 0 < sampling.top_p <= 1:
        problems.append(f"top_p must be in (0, 1], got {sampling.top_p}")
    if sampling.top_k < 0:
        problems.append(f"top_k must be >= 0 (0 = off), got {sampling.top_k}")
    if sampling.n < 1:
        problems.append(f"n must be >= 1, got {sampling.n}")
    if sampling.max_new_tokens < 1:
        problems.append(f"max_new_tokens must be >= 1, got {sampling.max_new_tokens}")
    if any(not isinstance(s, str) or not s for s in sampling.stop):
        problems.append(f"stop strings must be non-empty strings, got {sampling.stop!r}")
    if problems:
        raise RolloutError("SamplingParams: " + "; ".join(problems))


class Sampler:
    """Samples one token per running row per step; rows can be dropped as they finish."""

    def __init__(self, sampling: SamplingParams, row_seeds: list[int], steps: int, device: torch.device):
        self.greedy = sampling.temperature == 0
        self.temperature = 1.0 if self.greedy else float(sampling.temperature)
        self.top_k = sampling.top_k
        self.top_p = sampling.top_p
        self.uniforms = None
        if not self.greedy:
            draws = [torch.rand(steps, generator=torch.Generator().manual_seed(s)) for s in row_seeds]
            self.uniforms = torch.stack(draws).to(device)

    def keep(self, rows: torch.Tensor) -> None:
        if self.uniforms is not None:
            self.uniforms = self.uniforms[rows]

    def sample(self, logits: torch.Tensor, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Tokens [rows] and their logprobs [rows] from float32 logits [rows, vocab]."""
        if self.temperature != 1.0:
            logits = logits / self.temperature
        logprobs = torch.log_softmax(logits, dim=-1)
        if self.greedy:
            tokens = logits.argmax(-1)
        else:
            tokens = self._draw(logprobs, self.uniforms[:, step])
        return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)

    def _draw(self, logprobs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
        return draw(truncated_weights(logprobs, self.top_k, self.top_p), uniforms)


def truncated_weights(logprobs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """exp(logprobs) [rows, vocab], zeroed outside top-k and then outside top-p (of the top-k mass); unnormalised."""
    weights = logprobs.exp()
    if 0 < top_k < weights.shape[-1]:
        kth = torch.topk(logprobs, top_k, dim=-1).values[:, -1:]
        weights = weights.masked_fill(logprobs < kth, 0.0)
    if top_p < 1.0:
        ordered, order = weights.sort(dim=-1, descending=True)
        cumulative = ordered.cumsum(-1)
        # Keep a token while the mass strictly before it is under top_p (of the surviving mass).
        drop = (cumulative - ordered) >= top_p * cumulative[:, -1:]
        weights = weights.scatter(-1, order, ordered.masked_fill(drop, 0.0))
    return weights


def draw(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row from unnormalised `weights` [rows, vocab] by inverse CDF, u ~ `uniforms` [rows]."""
    cdf = weights.cumsum(-1)
    tokens = torch.searchsorted(cdf, uniforms[:, None] * cdf[:, -1:], right=True).squeeze(-1)
    # u * total can round up to total; the first index reaching the total is the last token with mass.
    return torch.minimum(tokens, cdf.argmax(-1))
