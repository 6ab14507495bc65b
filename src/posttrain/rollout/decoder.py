"""The fast path: a Llama-family decoder run straight from the Hugging Face module's weights.

For decoding, a tiny model's time goes into Python and dispatch overhead, not arithmetic: `generate` walks
the module tree, builds masks and cache objects and runs logits processors at every step. This runner keeps
a preallocated (static) KV cache per layer, shaped ``[rows, kv_heads, capacity, head_dim]``, a rotary table
computed once by the model's own rotary module, and runs the layer maths in one flat loop of tensor ops over
the module's own parameters (no copy; an update to the model's parameters is seen at the next step).

It computes exactly what the Hugging Face forward computes for these architectures (Llama, Mistral without a
sliding window, Qwen2 without a sliding window, Qwen3): the same RMSNorm (in float32, cast back), rotary
embedding, attention scaling and SwiGLU MLP, with the same dtypes at every op, so the logprobs agree with a
teacher-forced forward pass of the model to float rounding. Anything else goes through `GenericRunner`.

``autocast`` (e.g. ``torch.bfloat16``) reproduces `torch.autocast`: matmuls (every linear and the attention)
run in the low-precision dtype and return it, everything else (embedding, residual stream, norms, rotary) stays
as it is in the parameters' dtype — the numeric path a trainer under autocast takes. The low-precision copies
of the matmul weights are cached and re-cast only when a parameter changes (tracked by its version counter).

Rows are sequences; all rows share one column index, so prompts are left-padded and a boolean ``valid`` mask
marks which cache columns hold real tokens. Positions are per row (a left-padded prompt starts at 0).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

_SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "qwen3")
_DYNAMIC_ROPE = ("dynamic", "longrope")


def fast_path_unsupported(model: torch.nn.Module) -> str | None:
    """Why `model` cannot take the fast path, or None when it can."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in _SUPPORTED_TYPES:
        return f"model_type {model_type!r} is not one of {_SUPPORTED_TYPES}"
    body = getattr(model, "model", None)
    if body is None or not hasattr(body, "layers") or not hasattr(model, "lm_head"):
        return "the model does not have the `model.layers` / `lm_head` layout"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} (only silu)"
    if getattr(config, "sliding_window", None) is not None and model_type == "mistral":
        return "Mistral with a sliding window"
    if any(kind != "full_attention" for kind in (getattr(config, "layer_types", None) or [])):
        return "sliding-window attention layers"
    rope_type = getattr(getattr(body, "rotary_emb", None), "rope_type", None)
    if rope_type is None or rope_type in _DYNAMIC_ROPE:
        return f"rope type {rope_type!r} (the rotary table must not depend on the sequence length)"
    if getattr(config, "pretraining_tp", 1) != 1:
        return "pretraining_tp != 1"
    return None


class _Weights:
    """The matmul weights in the dtype they are used in: the parameters themselves, or cached casts."""

    def __init__(self, autocast: torch.dtype | None):
        self.autocast = autocast
        self._cache: dict[tuple[int, ...], tuple[tuple, torch.Tensor]] = {}

    def get(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        if tensor is None or self.autocast is None or tensor.dtype == self.autocast:
            return tensor
        return self._cached((tensor,))

    def fused(self, tensors: tuple[torch.Tensor | None, ...]) -> torch.Tensor | None:
        """The tensors concatenated along dim 0 (one matmul instead of several), cast when autocasting."""
        if tensors[0] is None:
            return None
        return self._cached(tensors)

    def _cached(self, tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
        key = tuple(id(t) for t in tensors)
        stamp = tuple((t._version, t.data_ptr()) for t in tensors)
        hit = self._cache.get(key)
        if hit is None or hit[0] != stamp:
            joined = torch.cat([t.detach() for t in tensors]) if len(tensors) > 1 else tensors[0].detach()
            hit = (stamp, joined.to(self.autocast) if self.autocast is not None else joined)
            self._cache[key] = hit
        return hit[1]


class _Layer:
    """One decoder layer's parameters, resolved once (attribute lookups cost per step)."""

    def __init__(self, layer: torch.nn.Module, weights: _Weights):
        attention, mlp = layer.self_attn, layer.mlp
        self.qkv = (attention.q_proj, attention.k_proj, attention.v_proj)
        self.o, self.gate_up, self.down = attention.o_proj, (mlp.gate_proj, mlp.up_proj), mlp.down_proj
        self.input_norm = layer.input_layernorm
        self.post_norm = layer.post_attention_layernorm
        self.q_norm = getattr(attention, "q_norm", None)
        self.k_norm = getattr(attention, "k_norm", None)
        self.scaling = float(attention.scaling)
        self.weights = weights

    def linears(self) -> list[tuple[torch.Tensor, torch.Tensor | None]]:
        """(weight, bias) of the fused q/k/v projection, o, the fused gate/up projection, and down."""
        get, fused = self.weights.get, self.weights.fused
        return [
            (fused(tuple(m.weight for m in self.qkv)), fused(tuple(m.bias for m in self.qkv))),
            (get(self.o.weight), get(self.o.bias)),
            (fused(tuple(m.weight for m in self.gate_up)), fused(tuple(m.bias for m in self.gate_up))),
            (get(self.down.weight), get(self.down.bias)),
        ]


def _rms_norm(x: torch.Tensor, module: torch.nn.Module) -> torch.Tensor:
    # Exactly the Hugging Face RMSNorm: statistics in float32, cast back, then scaled by the weight.
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + module.variance_epsilon)
    return module.weight * x32.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class DecoderRunner:
    """Prefill, decode and compaction over a static KV cache for one batch of rows.

    The cache is time-major, ``[capacity, rows, kv_heads, head_dim]`` per layer: a decode step writes one
    contiguous block and attention reads one contiguous prefix ``[:length]`` — on CPU that streams through
    memory about twice as fast as the row-major layout, whose rows each end in unused capacity.
    """

    def __init__(
        self, model: torch.nn.Module, autocast: torch.dtype | None = None, use_sdpa: bool | None = None
    ):
        reason = fast_path_unsupported(model)
        if reason is not None:
            raise ValueError(f"the fast decoder cannot run this model: {reason}")
        config = model.config
        self.model = model
        self.body = model.model
        self.weights = _Weights(autocast)
        self.layers = [_Layer(layer, self.weights) for layer in self.body.layers]
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.autocast = autocast
        self.device = self.body.embed_tokens.weight.device
        self.param_dtype = self.body.embed_tokens.weight.dtype
        # Attention operands are what SDPA would see (bf16 under autocast). On CPU the cache holds them
        # widened to float32 (exact) for the float32 matmuls; elsewhere as they are, for SDPA.
        self.attn_dtype = autocast or self.param_dtype
        self.use_sdpa = self.device.type != "cpu" if use_sdpa is None else use_sdpa
        self.cache_dtype = self.attn_dtype if self.use_sdpa else torch.float32
        self._rope_len = 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []

    # ---- rotary table ---------------------------------------------------------------------------

    def _rope(self, capacity: int) -> None:
        if capacity <= self._rope_len:
            return
        positions = torch.arange(capacity, device=self.device)[None]
        probe = torch.empty(1, capacity, 1, dtype=self.param_dtype, device=self.device)
        cos, sin = self.body.rotary_emb(probe, position_ids=positions)
        self.cos, self.sin = cos[0], sin[0]
        self._rope_len = capacity

    # ---- the layer maths --------------------------------------------------------------------------

    def _linear(self, x: torch.Tensor, weight: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
        if self.autocast is not None:
            x = x.to(self.autocast)
        return F.linear(x, weight[0], weight[1])

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, start: int, mask: torch.Tensor) -> torch.Tensor:
        """Run `ids` [B, S] at cache columns start..start+S; `mask` [B, 1, S, start+S] (True = attend)."""
        batch, width = ids.shape
        x = F.embedding(ids, self.body.embed_tokens.weight)
        cos, sin = self.cos[positions].unsqueeze(2), self.sin[positions].unsqueeze(2)  # [B, S, 1, D]
        end = start + width
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        for index, layer in enumerate(self.layers):
            w_qkv, w_o, w_gate_up, w_down = layer.linears()
            h = _rms_norm(x, layer.input_norm)
            qkv = self._linear(h, w_qkv).view(batch, width, heads + 2 * kv_heads, head_dim)
            if layer.q_norm is None:  # rotate q and k in one go
                qk = _rotate(qkv[:, :, : heads + kv_heads], cos, sin)
                q, k = qk[:, :, :heads], qk[:, :, heads:]
            else:
                q = _rotate(_rms_norm(qkv[:, :, :heads], layer.q_norm), cos, sin)
                k = _rotate(_rms_norm(qkv[:, :, heads : heads + kv_heads], layer.k_norm), cos, sin)
            # Time-major cache: [S, B, kv_heads, D] blocks.
            self.keys[index][start:end] = k.transpose(0, 1).to(self.attn_dtype)
            self.values[index][start:end] = qkv[:, :, heads + kv_heads :].transpose(0, 1).to(self.attn_dtype)
            attention = self._attend(q, index, end, mask, layer.scaling)  # [B, S, H * D]
            x = x + self._linear(attention, w_o)
            h = _rms_norm(x, layer.post_norm)
            gate, up = self._linear(h, w_gate_up).chunk(2, dim=-1)
            x = x + self._linear(F.silu(gate) * up, w_down)
        return x

    def _attend(self, q: torch.Tensor, index: int, end: int, mask: torch.Tensor, scaling: float) -> torch.Tensor:
        """softmax(q k^T * scaling + mask) v over cache columns [0, end): q [B, S, H, D] -> [B, S, H * D].

        On CPU it is written out with float32 matmuls on operands already rounded to the operand dtype:
        the fused SDPA kernel is slower there for one query per row (~7x slower in bf16), and float32
        accumulation is what SDPA does inside. Grouped-query attention packs the query heads of a group as
        extra query rows of their shared key/value head instead of repeating the keys.
        """
        keys = self.keys[index][:end].permute(1, 2, 0, 3)  # [B, kv_heads, T, D] views
        values = self.values[index][:end].permute(1, 2, 0, 3)
        batch, width, heads, head_dim = q.shape
        kv_heads = self.num_kv_heads
        group = heads // kv_heads
        q = q.to(self.attn_dtype).to(self.cache_dtype).transpose(1, 2)  # [B, H, S, D]
        if self.use_sdpa:
            if width == 1 and group > 1:
                q = q.reshape(batch, kv_heads, group, head_dim)
            elif group > 1:
                keys = keys.repeat_interleave(group, dim=1)
                values = values.repeat_interleave(group, dim=1)
            out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scaling)
            out = out.reshape(batch, heads, width, head_dim)
        else:
            q = q.reshape(batch, kv_heads, group * width, head_dim)
            scores = torch.matmul(q, keys.transpose(-1, -2)).mul_(scaling)
            if group > 1:
                scores = scores.view(batch, kv_heads, group, width, end)
                scores = scores.masked_fill_(~mask.unsqueeze(2), float("-inf")).view(batch, -1, group * width, end)
            else:
                scores = scores.masked_fill_(~mask, float("-inf"))
            out = torch.matmul(torch.softmax(scores, dim=-1), values).view(batch, heads, width, head_dim)
        return out.transpose(1, 2).reshape(batch, width, heads * head_dim).to(self.attn_dtype)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = _rms_norm(hidden, self.body.norm)
        head = self.model.lm_head
        return self._linear(hidden, (self.weights.get(head.weight), self.weights.get(head.bias))).float()

    # ---- the runner interface -----------------------------------------------------------------------

    def prefill(self, prompts: list[list[int]], rows_per_prompt: int, capacity: int) -> torch.Tensor:
        """Run the prompts once, give each `rows_per_prompt` rows sharing its KV; logits [rows, vocab]."""
        width = max(len(p) for p in prompts)
        self._rope(capacity)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        valid = torch.zeros(len(prompts), width, dtype=torch.bool)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            valid[row, width - len(prompt) :] = True
        ids, valid = ids.to(self.device), valid.to(self.device)
        positions = (valid.long().cumsum(-1) - 1).clamp_(min=0)
        causal = torch.ones(width, width, dtype=torch.bool, device=self.device).tril_()
        # A padding query sees only itself: finite garbage that no real token ever attends to.
        eye = torch.eye(width, dtype=torch.bool, device=self.device)
        mask = (causal & valid[:, None, :]) | eye
        self.keys = [self._empty(width, len(prompts)) for _ in self.layers]
        self.values = [self._empty(width, len(prompts)) for _ in self.layers]
        hidden = self._forward(ids, positions, 0, mask.unsqueeze(1))
        logits = self._logits(hidden[:, -1])
        # Expand: every row of a group gets its own copy of the prompt's KV, in a cache with room to grow.
        source = torch.arange(len(prompts), device=self.device).repeat_interleave(rows_per_prompt)
        self.length = width
        self._select(source, capacity)
        self.valid = torch.zeros(len(source), capacity, dtype=torch.bool, device=self.device)
        self.valid[:, :width] = valid[source]
        self.positions = valid.sum(-1)[source]
        return logits[source]

    def _empty(self, capacity: int, rows: int) -> torch.Tensor:
        shape = (capacity, rows, self.num_kv_heads, self.head_dim)
        return torch.empty(shape, dtype=self.cache_dtype, device=self.device)

    def _select(self, rows: torch.Tensor, capacity: int) -> None:
        """Rebuild the cache with only (or repeated) `rows`, room for `capacity` columns."""
        for caches in (self.keys, self.values):
            for index, cache in enumerate(caches):
                grown = self._empty(capacity, len(rows))
                torch.index_select(cache[: self.length], 1, rows, out=grown[: self.length])
                caches[index] = grown

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append one token per row; logits [rows, vocab] for the next one."""
        column = self.length
        self.valid[:, column] = True
        mask = self.valid[:, None, None, : column + 1]
        hidden = self._forward(tokens[:, None], self.positions[:, None], column, mask)
        self.positions += 1
        self.length += 1
        return self._logits(hidden[:, 0])

    def keep(self, rows: torch.Tensor) -> None:
        """Drop every row not in `rows` (finished sequences stop costing compute)."""
        self._select(rows, self.valid.shape[1])
        self.valid = self.valid[rows]
        self.positions = self.positions[rows]

    def release(self) -> None:
        self.keys, self.values = [], []
