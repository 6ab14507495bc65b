"""The fast path: a Llama-family decoder run straight from the Hugging Face module's weights.

For decoding, a tiny model's time goes into Python and dispatch overhead and memory traffic, not arithmetic:
`generate` walks the module tree, builds masks and cache objects and runs logits processors at every step, and
gives every sample of a group its own copy of the prompt's KV. This runner keeps preallocated time-major KV
caches (a prompt's KV shared by its group, see `DecoderRunner`), a rotary table computed once by the model's
own rotary module, and runs the layer maths as one flat loop of tensor ops over the module's parameters, with
q/k/v and gate/up fused into one matmul each. The fused (and, under autocast, cast) weight copies are cached
and re-made when a parameter's version counter changes, i.e. after any in-place update; in fp32 they cost
one extra copy of the attention and MLP weights.

It computes what the Hugging Face forward computes for these architectures (Llama, Mistral without a sliding
window, Qwen2 without a sliding window, Qwen3): the same RMSNorm (in float32, cast back), rotary embedding,
attention scaling and SwiGLU MLP, with the same dtypes at every op, so the logprobs agree with a teacher-forced
forward pass of the model to float rounding. Anything else goes through `GenericRunner`.

``autocast`` (e.g. ``torch.bfloat16``) reproduces `torch.autocast`: matmuls (every linear and the attention)
run in the low-precision dtype and return it, everything else (embedding, residual stream, norms, rotary) stays
in the parameters' dtype — the numeric path a trainer under autocast takes.

Prompts are left-padded for the prefill (a per-prompt bias masks the padding columns); positions count real
tokens only, so a padded prompt sees the positions it would see alone.
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
    """Prefill, decode and compaction for one batch of rows (sequences), the prompt KV shared by its group.

    KV caches are time-major, ``[length, batch, kv_heads, head_dim]`` per layer, rounded to the attention
    operand dtype (bf16 under autocast: exactly what SDPA would be given) and stored widened to float32, the
    dtype of the attention matmuls (SDPA accumulates in float32). Storing them widened doubles their memory but
    reads less per step than widening a low-precision cache at every step (2 bytes read, 4 written and read
    again per element), and saves an op per cache and layer; on tiny-3m it cut a decode step's time by a fifth:

    * the prompt part, one slot per distinct prompt, written once by the prefill and never copied per row;
    * the generated part, one slot per row, preallocated for ``max_new_tokens`` columns.

    A decode step's attention is the softmax over both parts together. The prompt part is computed per
    group: the query rows of a prompt's sequences are laid out on a ``[prompts, rows per prompt]`` grid so
    one matmul per prompt reads its KV once, instead of once per sequence — for n samples of a long prompt,
    n times less KV memory and traffic. Dropping finished rows re-packs the grid (and the prompts left).
    """

    def __init__(self, model: torch.nn.Module, autocast: torch.dtype | None = None):
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
        self.group = self.num_heads // self.num_kv_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.autocast = autocast
        self.device = self.body.embed_tokens.weight.device
        self.param_dtype = self.body.embed_tokens.weight.dtype
        # What SDPA would see (bf16 under autocast): the operands are rounded to it before the float32 maths.
        self.attn_dtype = autocast or self.param_dtype
        self._rope_len = 0
        self.release()

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

    def _forward(self, ids: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        """The decoder over `ids` [B, S]; ``attend(layer, q, k, v, scaling)`` stores k/v and returns [B, S, H*D]."""
        batch, width = ids.shape
        x = F.embedding(ids, self.body.embed_tokens.weight)
        cos, sin = self.cos[positions].unsqueeze(2), self.sin[positions].unsqueeze(2)  # [B, S, 1, D]
        heads, kv_heads = self.num_heads, self.num_kv_heads
        for index, layer in enumerate(self.layers):
            w_qkv, w_o, w_gate_up, w_down = layer.linears()
            h = _rms_norm(x, layer.input_norm)
            qkv = self._linear(h, w_qkv).view(batch, width, heads + 2 * kv_heads, self.head_dim)
            if layer.q_norm is None:  # rotate q and k in one go
                qk = _rotate(qkv[:, :, : heads + kv_heads], cos, sin)
                q, k = qk[:, :, :heads], qk[:, :, heads:]
            else:
                q = _rotate(_rms_norm(qkv[:, :, :heads], layer.q_norm), cos, sin)
                k = _rotate(_rms_norm(qkv[:, :, heads : heads + kv_heads], layer.k_norm), cos, sin)
            v = qkv[:, :, heads + kv_heads :]
            x = x + self._linear(attend(index, q, k, v, layer.scaling), w_o)
            h = _rms_norm(x, layer.post_norm)
            gate, up = self._linear(h, w_gate_up).chunk(2, dim=-1)
            x = x + self._linear(F.silu(gate) * up, w_down)
        return x

    def _operand(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self.attn_dtype).to(torch.float32)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = _rms_norm(hidden, self.body.norm)
        head = self.model.lm_head
        return self._linear(hidden, (self.weights.get(head.weight), self.weights.get(head.bias))).float()

    # ---- prefill: the prompts attend to themselves ------------------------------------------------------

    def prefill(self, prompts: list[list[int]], rows_per_prompt: int, max_new_tokens: int) -> torch.Tensor:
        """Run the distinct prompts once; each gets `rows_per_prompt` rows. Logits [rows, vocab]."""
        width = max(len(p) for p in prompts)
        self._rope(width + max_new_tokens)
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        valid = torch.zeros(len(prompts), width, dtype=torch.bool)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            valid[row, width - len(prompt) :] = True
        ids, valid = ids.to(self.device), valid.to(self.device)
        positions = (valid.long().cumsum(-1) - 1).clamp_(min=0)
        # A padding query sees only itself: finite garbage that no real token ever attends to.
        causal = torch.ones(width, width, dtype=torch.bool, device=self.device).tril_()
        mask = ((causal & valid[:, None, :]) | torch.eye(width, dtype=torch.bool, device=self.device))[:, None]
        self.prompt_keys = [self._empty(width, len(prompts)) for _ in self.layers]
        self.prompt_values = [self._empty(width, len(prompts)) for _ in self.layers]

        def attend(index, q, k, v, scaling):
            self.prompt_keys[index][:] = k.transpose(0, 1).to(self.attn_dtype)
            self.prompt_values[index][:] = v.transpose(0, 1).to(self.attn_dtype)
            keys = self.prompt_keys[index].permute(1, 2, 3, 0)  # [B, kv_heads, D, P]
            values = self.prompt_values[index].permute(1, 2, 0, 3)  # [B, kv_heads, P, D]
            batch, _, heads, head_dim = q.shape
            # [B, S, H, D] -> [B, kv_heads, group * S, D]: a group's query heads share their key/value head.
            q = self._operand(q).permute(0, 2, 1, 3).reshape(batch, self.num_kv_heads, self.group * width, head_dim)
            scores = torch.matmul(q, keys).mul_(scaling)
            scores = scores.view(batch, self.num_kv_heads, self.group, width, width).masked_fill_(
                ~mask[:, :, None], float("-inf")
            )
            weights = torch.softmax(scores.view(batch, self.num_kv_heads, -1, width), dim=-1)
            out = torch.matmul(weights, values).view(batch, heads, width, head_dim)
            return out.transpose(1, 2).reshape(batch, width, heads * head_dim).to(self.attn_dtype)

        hidden = self._forward(ids, positions, attend)
        logits = self._logits(hidden[:, -1])
        rows_prompt = torch.arange(len(prompts), device=self.device).repeat_interleave(rows_per_prompt)
        self.prompt_bias = torch.zeros(valid.shape, device=self.device).masked_fill_(~valid, float("-inf"))
        self.keys = [self._empty(max_new_tokens, len(rows_prompt)) for _ in self.layers]
        self.values = [self._empty(max_new_tokens, len(rows_prompt)) for _ in self.layers]
        self.length = 0
        self.positions = valid.sum(-1)[rows_prompt]
        self._regroup(rows_prompt)
        return logits[rows_prompt]

    def _empty(self, length: int, batch: int) -> torch.Tensor:
        shape = (length, batch, self.num_kv_heads, self.head_dim)
        return torch.empty(shape, dtype=torch.float32, device=self.device)  # holds attn_dtype-rounded values

    # ---- decode: one token per row, attending to its prompt (shared) and its own tokens ---------------

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append one token per row; logits [rows, vocab] for the next one."""
        hidden = self._forward(tokens[:, None], self.positions[:, None], self._attend_step)
        self.positions += 1
        self.length += 1
        return self._logits(hidden[:, 0])

    def _attend_step(self, index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float):
        rows, kv_heads, group, head_dim = q.shape[0], self.num_kv_heads, self.group, self.head_dim
        self.keys[index][self.length] = k[:, 0].to(self.attn_dtype)
        self.values[index][self.length] = v[:, 0].to(self.attn_dtype)
        q = self._operand(q).view(rows, kv_heads, group, head_dim)
        prompt_keys = self.prompt_keys[index].permute(1, 2, 3, 0)  # [prompts, kv_heads, D, P]
        own_keys = self.keys[index][: self.length + 1].permute(1, 2, 3, 0)  # [rows, kv_heads, D, t]
        prompt_scores = self._from_grid(torch.matmul(self._to_grid(q), prompt_keys)) + self.row_bias
        scores = torch.cat([prompt_scores, torch.matmul(q, own_keys)], dim=-1).mul_(scaling)
        weights = torch.softmax(scores, dim=-1)
        width = prompt_keys.shape[-1]
        own_values = self.values[index][: self.length + 1].permute(1, 2, 0, 3)  # [rows, kv_heads, t, D]
        out = torch.matmul(weights[..., width:], own_values)
        prompt_values = self.prompt_values[index].permute(1, 2, 0, 3)  # [prompts, kv_heads, P, D]
        out += self._from_grid(torch.matmul(self._to_grid(weights[..., :width]), prompt_values))
        return out.view(rows, 1, kv_heads * group * head_dim).to(self.attn_dtype)

    def _to_grid(self, x: torch.Tensor) -> torch.Tensor:
        """[rows, kv_heads, group, F] -> [prompts, kv_heads, slots * group, F], zero where no row sits."""
        prompts, slots = self.grid
        grid = x.new_zeros(prompts * slots, *x.shape[1:])
        grid.index_copy_(0, self.grid_index, x)
        grid = grid.view(prompts, slots, *x.shape[1:]).transpose(1, 2)
        return grid.reshape(prompts, x.shape[1], slots * x.shape[2], x.shape[3])

    def _from_grid(self, grid: torch.Tensor) -> torch.Tensor:
        prompts, slots = self.grid
        kv_heads, features = grid.shape[1], grid.shape[-1]
        grid = grid.view(prompts, kv_heads, slots, self.group, features).transpose(1, 2)
        return grid.reshape(prompts * slots, kv_heads, self.group, features)[self.grid_index]

    def _regroup(self, rows_prompt: torch.Tensor) -> None:
        """Lay the rows (sorted by prompt) on the [prompts, slots] grid; drop prompts with no rows left."""
        alive, local = torch.unique(rows_prompt, return_inverse=True)
        if len(alive) < self.prompt_bias.shape[0]:
            self.prompt_keys = [k.index_select(1, alive) for k in self.prompt_keys]
            self.prompt_values = [v.index_select(1, alive) for v in self.prompt_values]
            self.prompt_bias = self.prompt_bias[alive]
        counts = torch.bincount(local, minlength=len(alive))
        first = counts.cumsum(0) - counts
        slot = torch.arange(len(local), device=self.device) - first[local]
        self.grid = (len(alive), int(counts.max()))
        self.grid_index = local * self.grid[1] + slot
        self.rows_prompt = local
        self.row_bias = self.prompt_bias[local][:, None, None, :]  # [rows, 1, 1, P]

    def keep(self, rows: torch.Tensor) -> None:
        """Drop every row not in `rows` (ascending): finished sequences stop costing compute."""
        for caches in (self.keys, self.values):
            for index, cache in enumerate(caches):
                kept = self._empty(cache.shape[0], len(rows))
                torch.index_select(cache[: self.length], 1, rows, out=kept[: self.length])
                caches[index] = kept
        self.positions = self.positions[rows]
        self._regroup(self.rows_prompt[rows])

    def release(self) -> None:
        self.keys, self.values, self.prompt_keys, self.prompt_values = [], [], [], []
