"""Speculative decoding for `HFEngine`: a cheap drafter proposes ``k`` tokens, the target checks them in one pass.

    engine = HFEngine(target, tokenizer, speculative=Speculation(draft=small_model, num_tokens=4))
    engine = HFEngine(target, tokenizer, speculative=Speculation(num_tokens=4, ngram=3))   # prompt lookup

A round, per running sequence (row):

1. the drafter proposes up to ``k`` tokens ``d_1..d_k``: a draft model (any smaller causal LM with the target's
   tokenizer, sampled with the same temperature / top-k / top-p, so its distributions ``q_i`` are known) or prompt
   lookup (the tokens that followed the latest earlier occurrence of the sequence's last ``n``-gram, ``n`` from
   ``ngram`` down to 1; a point mass, ``q_i = 1`` on its token);
2. the target runs the last emitted token and the ``k`` drafts in one forward pass: ``k + 1`` next-token
   distributions ``p_1..p_{k+1}`` (the engine's sampling distribution: ``softmax(z / T)`` cut by top-k/top-p);
3. verification (Leviathan et al. 2023, Chen et al. 2023): ``d_i`` is accepted with probability
   ``min(1, p_i(d_i) / q_i(d_i))``, in order; at the first rejection one token is drawn from
   ``norm(max(0, p_i - q_i))`` and the round ends; when all ``k`` are accepted a bonus token is drawn from
   ``p_{k+1}``. Every emitted token is then distributed exactly as plain sampling from the target would have
   it, whatever the drafter. Greedy (T = 0): drafts are accepted while they equal the target's argmax, and the
   token after them is the target's argmax — plain greedy decoding's output, in fewer target passes.

Every emitted token's logprob is the *target's* ``log_softmax(z / T)`` from the verify pass (T = 1 when greedy),
the engine's behaviour-logprob convention; stops (eos, stop tokens, stop strings) and length cut the accepted run
exactly where plain decoding would have stopped (`_Record` takes the tokens one by one).

Randomness: every row draws ``2k + 1`` uniforms per round from its own stream (seeded like plain sampling), so a
seeded call is reproducible and a row's tokens do not depend on the rest of the batch — but they are not the
tokens plain decoding draws from the same seed (same distribution, other draws).

The model maths: `BlockRunner`, the fast decoder's layer maths (`posttrain.rollout.decoder`) over a KV cache
with one slot per row and a length per row, so a pass can feed several tokens per row and a rejected draft is
dropped by not counting it (its KV is overwritten next round). Both models must take the fast path
(Llama-family); anything else is refused with the reason. The draft model is not updated by
`HFEngine.update_weights`: the outputs stay exact, the acceptance rate falls as the target moves away from it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from posttrain.rollout.decoder import DecoderRunner, _layers, _logits, fast_path_unsupported, masked_attention
from posttrain.rollout.errors import RolloutError
from posttrain.rollout.sampling import draw, truncated_weights
from posttrain.types import SamplingParams

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Speculation:
    """How `HFEngine` drafts: ``draft`` a model (sharing the target's tokenizer), or None for prompt lookup.

    ``num_tokens``: drafted tokens per round (k). ``ngram``: the longest n-gram prompt lookup matches.
    ``name``: what the draft was loaded from, for logs."""

    draft: torch.nn.Module | None = None
    num_tokens: int = 4
    ngram: int = 3
    name: str = ""

    def __post_init__(self) -> None:
        if self.num_tokens < 1:
            raise RolloutError(f"speculative.num_tokens must be >= 1, got {self.num_tokens}")
        if self.ngram < 1:
            raise RolloutError(f"speculative.ngram must be >= 1, got {self.ngram}")

    @property
    def kind(self) -> str:
        return "ngram" if self.draft is None else "draft"


def check_same_tokenizer(target: Any, draft: Any, where: str = "draft") -> None:
    """Raise RolloutError unless the draft's tokenizer is the target's: the same ids for every token and the same
    special tokens (`models.tokenizer_differences`; the chat template does not matter, the draft sees ids)."""
    from posttrain.models import tokenizer_differences

    problems = [p for p in tokenizer_differences(target, draft, ("target", "draft")) if "chat template" not in p]
    if problems:
        raise RolloutError(f"speculative {where}: its tokenizer differs from the target's ({'; '.join(problems)}); "
                           "a draft model must share the target's tokenizer")


def load_speculation(draft: str | None, tokenizer: Any, *, num_tokens: int = 4, ngram: int = 3,
                     seed: int = 0) -> Speculation | None:
    """A `Speculation` from a config string: ``"ngram"`` (prompt lookup), a tiny preset (``"tiny-3m"``: a fresh,
    untrained built-in model on ``tokenizer`` -- for tests and benchmarks) or a Hugging Face model directory
    (its tokenizer must equal ``tokenizer``); None (speculation off) for None."""
    if draft is None:
        return None
    if draft == "ngram":
        return Speculation(None, num_tokens, ngram, "ngram")
    from posttrain.models import PRESETS, build_tiny_model

    if draft in PRESETS:
        model = build_tiny_model(draft, tokenizer, seed=seed)
    else:
        path = Path(draft)
        if not (path / "config.json").is_file():
            raise RolloutError(f"speculative.draft: {draft!r} is not 'ngram', a tiny preset ({', '.join(PRESETS)}) "
                               "or a model directory (no config.json there)")
        from transformers import AutoModelForCausalLM, AutoTokenizer

        check_same_tokenizer(tokenizer, AutoTokenizer.from_pretrained(path), f"draft {draft}")
        model = AutoModelForCausalLM.from_pretrained(path)
    return Speculation(model.eval(), num_tokens, ngram, draft)


class BlockRunner:
    """A fast-path decoder that feeds any number of tokens per row per pass, over per-row KV lengths.

    KV caches are ``[rows, capacity, kv_heads, head_dim]`` per layer (float32 holding the attention-operand
    dtype's values, as `DecoderRunner`'s); ``lengths[r]`` columns of row r are valid. A pass writes its tokens'
    KV from column ``lengths[r]`` on and each token attends to the columns up to its own; the caller then sets
    how many of them to keep (`lengths`), so a rejected draft costs nothing to undo.
    """

    def __init__(self, model: torch.nn.Module, autocast: torch.dtype | None, what: str, prepack: bool = True):
        reason = fast_path_unsupported(model)
        if reason is not None:
            raise RolloutError(f"speculative decoding: the {what} cannot take the fast decoder ({reason}); "
                               "speculation runs Llama-family models only (Llama, Mistral, Qwen2, Qwen3)")
        self.base = DecoderRunner(model, autocast, prepack=prepack)  # its weights, rotary table and layer maths
        self.device = self.base.device
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.lengths = torch.zeros(0, dtype=torch.long)

    def start(self, prompts: list[list[int]], rows_per_prompt: int, capacity: int) -> None:
        """Fresh caches for the prompts (each with `rows_per_prompt` rows), holding all but each prompt's last
        token: the first round feeds that one."""
        base, count = self.base, len(prompts)
        base.watch_parameters()
        base.batch_rows = count * rows_per_prompt  # the kernels are chosen for the batch (`DecoderRunner._resolve`)
        base._rope(capacity)
        shape = (count, capacity, base.dims.kv_heads, base.dims.head_dim)
        # Zeros, not empty: a masked column still meets its value in the matmul (0 * NaN would be NaN).
        self.keys = [torch.zeros(shape, device=self.device) for _ in base.layers]
        self.values = [torch.zeros(shape, device=self.device) for _ in base.layers]
        self.lengths = torch.zeros(count, dtype=torch.long, device=self.device)
        heads = [p[:-1] for p in prompts]
        if max(len(h) for h in heads):
            self.forward(heads, last_only=True)
            self.lengths = torch.tensor([len(h) for h in heads], device=self.device)
        if rows_per_prompt > 1:
            self.keep(torch.arange(count, device=self.device).repeat_interleave(rows_per_prompt))

    def keep(self, rows: torch.Tensor) -> None:
        """Keep the rows `rows` (in that order; a row may repeat)."""
        self.keys = [k.index_select(0, rows) for k in self.keys]
        self.values = [v.index_select(0, rows) for v in self.values]
        self.lengths = self.lengths[rows]

    def forward(self, feeds: Sequence[Sequence[int]], last_only: bool = False) -> torch.Tensor:
        """Feed ``feeds[r]`` to row r at columns ``lengths[r]...`` (lengths are left as they are).

        Logits [rows, width, vocab] for every fed position (rows padded on the right: padding positions give
        finite garbage), or [rows, vocab] at each row's last fed token with `last_only` (an empty feed: garbage).
        """
        base, dims = self.base, self.base.dims
        rows, width = len(feeds), max(1, max(len(f) for f in feeds))
        tokens = torch.zeros(rows, width, dtype=torch.long)
        for row, feed in enumerate(feeds):
            tokens[row, : len(feed)] = torch.tensor(list(feed), dtype=torch.long)
        tokens = tokens.to(self.device)
        columns = self.lengths[:, None] + torch.arange(width, device=self.device)  # [rows, width]: positions
        upto = int(columns.max()) + 1
        visible = torch.arange(upto, device=self.device)[None, None, :] <= columns[:, :, None]  # [rows, width, T]
        hidden_mask = ~visible[:, None, None]
        row_index = torch.arange(rows, device=self.device)[:, None].expand(rows, width)

        def attend(index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
            self.keys[index][row_index, columns] = k.to(dims.attn_dtype).float()
            self.values[index][row_index, columns] = v.to(dims.attn_dtype).float()
            keys = self.keys[index][:, :upto].permute(0, 2, 3, 1)  # [rows, kv_heads, D, T]
            values = self.values[index][:, :upto].permute(0, 2, 1, 3)  # [rows, kv_heads, T, D]
            return masked_attention(q, keys, values, hidden_mask, scaling, dims)

        x = F.embedding(tokens, base.body.embed_tokens.weight)
        cos, sin = base.cos[columns].unsqueeze(2), base.sin[columns].unsqueeze(2)  # [rows, width, 1, D]
        layers, head = base._resolve(base.batch_rows)
        hidden = _layers(x, cos, sin, layers, dims, attend)
        if last_only:
            last = torch.tensor([max(len(f), 1) - 1 for f in feeds], device=self.device)
            hidden = hidden[torch.arange(rows, device=self.device), last]
        return _logits(hidden, base.final_norm, head, dims)


@dataclass
class RoundStats:
    rounds: int = 0
    drafted: int = 0
    accepted: int = 0


def lookup_draft(sequence: list[int], ngram: int, count: int) -> list[int]:
    """Prompt lookup: up to `count` tokens that followed the latest earlier occurrence of the sequence's last
    n-gram, trying n = `ngram` down to 1; [] when none occurs."""
    if count < 1:
        return []
    length = len(sequence)
    for n in range(min(ngram, length - 1), 0, -1):
        suffix = sequence[length - n :]
        for start in range(length - n - 1, -1, -1):
            if sequence[start : start + n] == suffix:
                return sequence[start + n : start + n + count]
    return []


class Speculator:
    """Runs one engine chunk by speculative rounds (see the module docstring)."""

    def __init__(self, target: torch.nn.Module, autocast: torch.dtype | None, speculation: Speculation,
                 prepack: bool = True):
        self.speculation = speculation
        self.k = speculation.num_tokens
        self.target = BlockRunner(target, autocast, "target", prepack)
        self.draft: BlockRunner | None = None
        if speculation.draft is not None:
            target_vocab = target.get_output_embeddings().weight.shape[0]
            draft_vocab = speculation.draft.get_output_embeddings().weight.shape[0]
            if draft_vocab != target_vocab:
                raise RolloutError(f"speculative draft {speculation.name or ''}: {draft_vocab} output logits, the "
                                   f"target has {target_vocab}; a draft model must share the target's vocabulary")
            speculation.draft.to(next(target.parameters()).device)
            self.draft = BlockRunner(speculation.draft.eval(), autocast, "draft model", prepack)

    def release(self) -> None:
        for runner in (self.target, self.draft):
            if runner is not None:
                runner.keys, runner.values = [], []

    def run(self, prompts: list[list[int]], n: int, row_limits: list[int], row_seeds: list[int],
            sampling: SamplingParams, record: Any) -> RoundStats:
        """Decode every row (n per prompt) into `record` (the engine's `_Record`) until each has stopped."""
        stats = RoundStats()
        k, greedy = self.k, sampling.temperature == 0
        capacity = max(len(p) for p in prompts) + max(row_limits) + 2 * k + 4
        self.target.start(prompts, n, capacity)
        if self.draft is not None:
            self.draft.start(prompts, n, capacity)
        sequences = [list(p) for p in prompts for _ in range(n)]
        generators = None if greedy else [torch.Generator().manual_seed(s) for s in row_seeds]
        rows = list(range(len(row_limits)))  # batch position -> row
        draft_fed = [len(s) - 1 for s in sequences]  # tokens in the draft model's cache, per position
        while True:
            # Finished rows stay in the batch (no budget, nothing recorded) until an eighth of it has finished.
            done = [record.reasons[r] is not None for r in rows]
            budgets = [0 if d else min(k, row_limits[r] - len(record.tokens[r]) - 1) for r, d in zip(rows, done)]
            uniforms = None
            if generators is not None:
                uniforms = torch.stack([torch.zeros(2 * k + 1) if d else torch.rand(2 * k + 1, generator=generators[r])
                                        for r, d in zip(rows, done)]).to(self.target.device)
            if self.draft is not None:
                drafts, q, draft_fed = self._draft(sequences, rows, budgets, draft_fed, sampling, uniforms)
            else:
                drafts = [lookup_draft(sequences[r], self.speculation.ngram, b) for r, b in zip(rows, budgets)]
                q = None
            emitted = self._verify(sequences, rows, drafts, q, sampling, uniforms)
            emitted = [[] if d else e for d, e in zip(done, emitted)]
            stats.rounds += 1
            stats.drafted += sum(len(d) for d in drafts)
            stats.accepted += sum(max(len(e) - 1, 0) for e in emitted)
            if self.draft is not None:  # the draft model's cache keeps what was accepted of what it was fed
                draft_fed = [min(fed, len(sequences[r]) + len(e) - 1) if e else fed
                             for fed, r, e in zip(draft_fed, rows, emitted)]
            for r, tokens in zip(rows, emitted):
                sequences[r] += [t for t, _ in tokens]
            self._record(record, [None if d else r for r, d in zip(rows, done)], emitted)
            alive = [p for p, r in enumerate(rows) if record.reasons[r] is None]
            if not alive:
                break
            if len(rows) - len(alive) >= max(1, len(rows) // 8):
                keep = torch.tensor(alive, dtype=torch.long, device=self.target.device)
                self.target.keep(keep)
                if self.draft is not None:
                    self.draft.keep(keep)
                rows = [rows[p] for p in alive]
                draft_fed = [draft_fed[p] for p in alive]
        return stats

    # ---- one round ----------------------------------------------------------------------------------------

    def _draft(self, sequences: list[list[int]], rows: list[int], budgets: list[int], fed: list[int],
               sampling: SamplingParams, uniforms: torch.Tensor | None
               ) -> tuple[list[list[int]], torch.Tensor | None, list[int]]:
        """Draft-model proposals: per position up to its budget of tokens, their distributions q
        [positions, max budget, vocab] (None when greedy) and the draft cache lengths after."""
        runner, steps = self.draft, max(budgets)
        assert runner is not None
        drafts: list[list[int]] = [[] for _ in rows]
        if steps == 0:
            return drafts, None, fed
        feeds = [sequences[r][f:] if b > 0 else [] for r, f, b in zip(rows, fed, budgets)]
        runner.lengths = torch.tensor(fed, device=runner.device)
        distributions = []
        for step in range(steps):
            logits = runner.forward(feeds, last_only=True)
            fed = [f + len(feed) for f, feed in zip(fed, feeds)]
            runner.lengths = torch.tensor(fed, device=runner.device)
            if uniforms is None:
                tokens = logits.argmax(-1)
            else:
                weights = _weights(logits, sampling)
                distributions.append(weights)
                tokens = draw(weights, uniforms[:, step])
            chosen = tokens.tolist()
            for position, budget in enumerate(budgets):
                if step < budget:
                    drafts[position].append(chosen[position])
            # The next pass feeds each row its newest draft while it has budget for another.
            feeds = [[chosen[p]] if step + 1 < b else [] for p, b in enumerate(budgets)]
        q = torch.stack(distributions, dim=1) if distributions else None
        return drafts, q, fed

    def _verify(self, sequences: list[list[int]], rows: list[int], drafts: list[list[int]],
                q: torch.Tensor | None, sampling: SamplingParams, uniforms: torch.Tensor | None
                ) -> list[list[tuple[int, float]]]:
        """The target's pass over (last token, drafts): per position the emitted (token, target logprob)s."""
        runner = self.target
        feeds = [sequences[r][-1:] + d for r, d in zip(rows, drafts)]
        runner.lengths = torch.tensor([len(sequences[r]) - 1 for r in rows], device=runner.device)
        logits = runner.forward(feeds)  # [positions, 1 + K, vocab]
        positions, width, vocab = logits.shape
        scaled = logits if uniforms is None else logits / float(sampling.temperature)
        logprobs = torch.log_softmax(scaled, dim=-1)
        steps = width - 1
        counts = torch.tensor([len(d) for d in drafts], device=runner.device)
        proposed = torch.zeros(positions, max(steps, 1), dtype=torch.long, device=runner.device)
        for position, draft in enumerate(drafts):
            if draft:
                proposed[position, : len(draft)] = torch.tensor(draft, dtype=torch.long)
        proposed = proposed[:, :steps]
        valid = torch.arange(steps, device=runner.device)[None, :] < counts[:, None]
        index = torch.arange(positions, device=runner.device)
        if uniforms is None:
            choice = scaled.argmax(-1)  # [positions, 1 + K]
            accepted = (choice[:, :steps] == proposed) & valid
            kept = accepted.long().cumprod(-1).sum(-1)  # leading accepted drafts
            final = choice[index, kept]
        else:
            p = _weights(scaled.reshape(-1, vocab), sampling, scaled=True).view(positions, width, vocab)
            p_drafted = p[:, :steps].gather(-1, proposed[..., None]).squeeze(-1)
            if q is None:  # prompt lookup: a point mass on each drafted token
                q_drafted = torch.ones_like(p_drafted)
            else:
                q = q[:, :steps]
                q_drafted = q.gather(-1, proposed[..., None]).squeeze(-1)
            accepted = (uniforms[:, self.k : self.k + steps] * q_drafted < p_drafted) & valid
            kept = accepted.long().cumprod(-1).sum(-1)
            at = p[index, kept]  # the distribution of the token after the accepted drafts
            rejected = kept < counts
            if steps:
                stop = kept.clamp(max=steps - 1)
                if q is None:
                    q_at = F.one_hot(proposed[index, stop], vocab).to(p.dtype)
                else:
                    q_at = q[index, stop]
                residual = (at - q_at).clamp_(min=0.0)
                # A residual of no mass (p == q up to rounding) cannot be reached but by rounding: sample p then.
                usable = rejected & (residual.sum(-1) > 0)
                at = torch.where(usable[:, None], residual, at)
            final = draw(at, uniforms[:, 2 * self.k])
        tokens = torch.cat([proposed, final[:, None]], dim=1)  # the token at column kept is the final one
        tokens[index, kept] = final
        chosen_logprobs = logprobs.gather(-1, tokens[..., None]).squeeze(-1)
        tokens_list, logprob_list, kept_list = tokens.tolist(), chosen_logprobs.tolist(), kept.tolist()
        return [list(zip(tokens_list[p][: kept_list[p] + 1], logprob_list[p][: kept_list[p] + 1]))
                for p in range(positions)]

    @staticmethod
    def _record(record: Any, rows: list[int | None], emitted: list[list[tuple[int, float]]]) -> None:
        """Hand the emitted tokens to the record one position at a time, so stops cut where plain decoding's do."""
        batch = list(rows)
        for step in range(max(len(e) for e in emitted)):
            current = [row if row is not None and step < len(e) else None for row, e in zip(batch, emitted)]
            tokens = [e[step][0] if step < len(e) else 0 for e in emitted]
            logprobs = [e[step][1] if step < len(e) else 0.0 for e in emitted]
            after = record.add(current, tokens, logprobs)
            batch = [row if row is not None and (c is None or a is not None) else None
                     for row, c, a in zip(batch, current, after)]


def _weights(logits: torch.Tensor, sampling: SamplingParams, scaled: bool = False) -> torch.Tensor:
    """The engine's sampling distribution (normalised) for float32 logits [rows, vocab]: softmax(z / T) cut by
    top-k and top-p (`posttrain.rollout.sampling`)."""
    if not scaled:
        logits = logits / float(sampling.temperature)
    weights = truncated_weights(torch.log_softmax(logits, dim=-1), sampling.top_k, sampling.top_p)
    return weights / weights.sum(-1, keepdim=True)
