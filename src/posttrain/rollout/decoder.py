"""The fast path: a Llama-family decoder run straight from the Hugging Face module's weights.

For decoding, a tiny model's time goes into Python and dispatch overhead and memory traffic, not arithmetic:
`generate` walks the module tree, builds masks and cache objects and runs logits processors at every step, and
gives every sample of a group its own copy of the prompt's KV. This runner keeps preallocated time-major KV
caches (a prompt's KV shared by its group, see `DecoderRunner`), a rotary table computed once by the model's
own rotary module, and runs the layer maths as one flat loop of tensor ops over the module's parameters, with
q/k/v and gate/up fused into one matmul each. The fused (and, under autocast, cast) weight copies, and on CPU
their copies prepacked for oneDNN (`posttrain.models.kernels`), are cached and re-made when a parameter's version
counter changes, i.e. after any in-place update through the tensor (``copy_``, an optimizer step; a write
through ``.data`` bumps no version and is not seen), or when a parameter is replaced by another object between
batches; in fp32 they cost up to two extra copies of the attention and MLP weights, per runner.

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

from typing import Callable, NamedTuple, Sequence

import torch
import torch.nn.functional as F

from posttrain.models import prefer_prepacked, prepack, prepacked_linear, prepare_compile

_SUPPORTED_TYPES = ("llama", "mistral", "qwen2", "qwen3")
PREFILL_CHUNK = 1024  # prompt columns per prefill pass (shorter prompts take one pass)
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
    if any(_quantized(module.weight) for module in body.layers.modules() if isinstance(module, torch.nn.Linear)):
        # The fused q/k/v and gate/up copies would dequantize the weights (or fail to concatenate them).
        return "quantized weights (a tensor subclass such as torchao's); the model's own forward runs them"
    return None


def _quantized(weight: torch.Tensor) -> bool:
    tensor = weight.data if isinstance(weight, torch.nn.Parameter) else weight
    return type(tensor) is not torch.Tensor


class _Weights:
    """The matmul weights in the dtype they are used in (the parameters themselves, or cached casts and fused
    copies), and their prepacked copies for the CPU's oneDNN linear (`posttrain.models.kernels`)."""

    def __init__(self, autocast: torch.dtype | None):
        self.autocast = autocast
        self._cache: dict[tuple, tuple[tuple, torch.Tensor | None]] = {}

    def linear(self, weights: tuple[torch.Tensor, ...], biases: tuple[torch.Tensor | None, ...],
               rows: int) -> Linear:
        """One matmul's operands: the weights (several are concatenated along dim 0: one matmul instead of
        several) and biases, cast when autocasting, and the weight prepacked where a batch of ``rows`` rows runs
        it faster so (`prefer_prepacked`; never with ``rows`` 0; None where prepacking does not apply)."""
        weight = self._cached(weights)
        bias = None if biases[0] is None else self._cached(biases)  # type: ignore[arg-type]
        packed = rows > 0 and prefer_prepacked(rows, weight)  # type: ignore[arg-type]
        return weight, bias, self._cached(weights, pack=True) if packed else None

    def clear(self) -> None:
        self._cache.clear()

    def _cached(self, tensors: tuple[torch.Tensor, ...], pack: bool = False) -> torch.Tensor | None:
        if not pack and len(tensors) == 1 and (self.autocast is None or tensors[0].dtype == self.autocast):
            return tensors[0]
        key = (pack, *(id(t) for t in tensors))
        stamp = tuple((t._version, t.data_ptr()) for t in tensors)
        hit = self._cache.get(key)
        if hit is None or hit[0] != stamp:
            if pack:
                made = prepack(self._cached(tensors))  # type: ignore[arg-type]
            else:
                joined = torch.cat([t.detach() for t in tensors]) if len(tensors) > 1 else tensors[0].detach()
                made = joined.to(self.autocast) if self.autocast is not None else joined
            hit = (stamp, made)
            self._cache[key] = hit
        return hit[1]


# (weight, bias, the weight prepacked or None) as a matmul uses them
Linear = tuple[torch.Tensor, "torch.Tensor | None", "torch.Tensor | None"]


class _Norm(NamedTuple):
    weight: torch.Tensor
    eps: float


class _LayerWeights(NamedTuple):
    """One decoder layer's tensors for one step: what the layer maths reads (and all that a compiled step
    takes as inputs)."""

    input_norm: _Norm
    qkv: Linear  # q/k/v fused into one matmul
    q_norm: _Norm | None  # Qwen3
    k_norm: _Norm | None
    o: Linear
    post_norm: _Norm
    gate_up: Linear  # gate/up fused
    down: Linear
    scaling: float


class _Dims(NamedTuple):
    heads: int
    kv_heads: int
    group: int  # query heads per key/value head
    head_dim: int
    autocast: torch.dtype | None  # matmul dtype (None: the parameters')
    attn_dtype: torch.dtype  # what SDPA would be given: the attention operands are rounded to it


class _DecodeCaches(NamedTuple):
    keys: list[torch.Tensor]  # per layer [max_new, rows, kv_heads, head_dim], float32 or the attention dtype
    values: list[torch.Tensor]
    prompt_keys: list[torch.Tensor]  # per layer [P, prompts, kv_heads, head_dim]
    prompt_values: list[torch.Tensor]
    grid_index: torch.Tensor  # row -> its place on the [prompts, slots] grid
    row_bias: torch.Tensor  # [rows, 1, 1, P]: -inf on a row's prompt padding
    prompts: int
    slots: int
    dense: bool  # every prompt has `slots` rows: the grid is the rows themselves (grid_index is the identity)


class _Layer:
    """One decoder layer's parameters, resolved once (attribute lookups cost per step)."""

    def __init__(self, layer: torch.nn.Module, weights: _Weights):
        attention, mlp = layer.self_attn, layer.mlp
        self.qkv = (attention.q_proj, attention.k_proj, attention.v_proj)
        self.o, self.gate_up, self.down = attention.o_proj, (mlp.gate_proj, mlp.up_proj), mlp.down_proj
        self.input_norm = _norm(layer.input_layernorm)
        self.post_norm = _norm(layer.post_attention_layernorm)
        self.q_norm = _norm(getattr(attention, "q_norm", None))
        self.k_norm = _norm(getattr(attention, "k_norm", None))
        self.scaling = float(attention.scaling)
        self.weights = weights

    def resolve(self, rows: int) -> _LayerWeights:
        """The layer's tensors now, for a batch of ``rows`` rows (0: no prepacked weights): the fused q/k/v and
        gate/up projections, the casts and the prepacked weights come from the cache."""
        linear = self.weights.linear
        return _LayerWeights(
            self.input_norm,
            linear(tuple(m.weight for m in self.qkv), tuple(m.bias for m in self.qkv), rows),
            self.q_norm, self.k_norm,
            linear((self.o.weight,), (self.o.bias,), rows),
            self.post_norm,
            linear(tuple(m.weight for m in self.gate_up), tuple(m.bias for m in self.gate_up), rows),
            linear((self.down.weight,), (self.down.bias,), rows),
            self.scaling,
        )


def _norm(module: torch.nn.Module | None) -> _Norm | None:
    return None if module is None else _Norm(module.weight, float(module.variance_epsilon))


def _rms_norm(x: torch.Tensor, norm: _Norm) -> torch.Tensor:
    # Exactly the Hugging Face RMSNorm: statistics in float32, cast back, then scaled by the weight.
    x32 = _as(x, torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + norm.eps)
    return norm.weight * _as(x32, x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding with ``sin`` sign-folded (`_signed_sin`): x * cos + cat(x2, x1) * [-sin1, sin2] is the
    Hugging Face x * cos + cat(-x2, x1) * sin (a sign flip is exact) in two ops fewer."""
    half = x.shape[-1] // 2
    swapped = torch.cat((x[..., half:], x[..., :half]), dim=-1)
    return torch.addcmul(x * cos, swapped, sin)


def _signed_sin(sin: torch.Tensor) -> torch.Tensor:
    half = sin.shape[-1] // 2
    return torch.cat((-sin[..., :half], sin[..., half:]), dim=-1)


def _linear(x: torch.Tensor, weight: Linear, autocast: torch.dtype | None) -> torch.Tensor:
    if autocast is not None:
        x = x.to(autocast)
    return prepacked_linear(x, *weight)


def _as(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x.to(dtype)``, skipping the dispatch when it is a no-op (the fp32 path calls this per layer and step)."""
    return x if x.dtype == dtype else x.to(dtype)


def _operand(x: torch.Tensor, dims: _Dims) -> torch.Tensor:
    return _as(_as(x, dims.attn_dtype), torch.float32)


def masked_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, hidden: torch.Tensor,
                     scaling: float, dims: _Dims) -> torch.Tensor:
    """q [B, S, H, D] against keys [B, kv_heads, D, T] and values [B, kv_heads, T, D]; `hidden` (broadcast to
    [B, kv_heads, group, S, T]) is True where a query must not see a key. Returns [B, S, H * D]."""
    batch, width, heads, head_dim = q.shape
    columns = keys.shape[-1]
    # [B, S, H, D] -> [B, kv_heads, group * S, D]: a group's query heads share their key/value head.
    q = _operand(q, dims).permute(0, 2, 1, 3).reshape(batch, dims.kv_heads, dims.group * width, head_dim)
    scores = torch.matmul(q, keys).mul_(scaling)
    scores = scores.view(batch, dims.kv_heads, dims.group, width, columns).masked_fill_(hidden, float("-inf"))
    weights = torch.softmax(scores.view(batch, dims.kv_heads, -1, columns), dim=-1)
    out = torch.matmul(weights, values).view(batch, heads, width, head_dim)
    return out.transpose(1, 2).reshape(batch, width, heads * head_dim).to(dims.attn_dtype)


Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]


def _layers(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layers: list[_LayerWeights], dims: _Dims,
            attend: Attend) -> torch.Tensor:
    """The decoder layers over `x` [B, S, hidden]; ``attend(layer, q, k, v, scaling)`` stores k/v and returns
    [B, S, heads * head_dim]."""
    batch, width = x.shape[0], x.shape[1]
    heads, kv_heads = dims.heads, dims.kv_heads
    for index, layer in enumerate(layers):
        h = _rms_norm(x, layer.input_norm)
        qkv = _linear(h, layer.qkv, dims.autocast).view(batch, width, heads + 2 * kv_heads, dims.head_dim)
        if layer.q_norm is None:  # rotate q and k in one go
            qk = _rotate(qkv[:, :, : heads + kv_heads], cos, sin)
            q, k = qk[:, :, :heads], qk[:, :, heads:]
        else:
            q = _rotate(_rms_norm(qkv[:, :, :heads], layer.q_norm), cos, sin)
            k = _rotate(_rms_norm(qkv[:, :, heads : heads + kv_heads], layer.k_norm), cos, sin)
        v = qkv[:, :, heads + kv_heads :]
        x = x + _linear(attend(index, q, k, v, layer.scaling), layer.o, dims.autocast)
        h = _rms_norm(x, layer.post_norm)
        gate, up = _linear(h, layer.gate_up, dims.autocast).chunk(2, dim=-1)
        x = x + _linear(F.silu(gate) * up, layer.down, dims.autocast)
    return x


def _logits(hidden: torch.Tensor, norm: _Norm, head: Linear, dims: _Dims) -> torch.Tensor:
    return _linear(_rms_norm(hidden, norm), head, dims.autocast).float()


def _wide(cache: torch.Tensor) -> torch.Tensor:
    return _as(cache, torch.float32)


def _to_grid(x: torch.Tensor, caches: _DecodeCaches) -> torch.Tensor:
    """[rows, kv_heads, group, F] -> [prompts, kv_heads, slots * group, F], zero where no row sits."""
    prompts, slots = caches.prompts, caches.slots
    if caches.dense:
        grid = x
    else:
        grid = x.new_zeros(prompts * slots, *x.shape[1:])
        grid.index_copy_(0, caches.grid_index, x)
    grid = grid.view(prompts, slots, *x.shape[1:]).transpose(1, 2)
    return grid.reshape(prompts, x.shape[1], slots * x.shape[2], x.shape[3])


def _from_grid(grid: torch.Tensor, caches: _DecodeCaches, group: int) -> torch.Tensor:
    prompts, slots = caches.prompts, caches.slots
    kv_heads, features = grid.shape[1], grid.shape[-1]
    grid = grid.view(prompts, kv_heads, slots, group, features).transpose(1, 2)
    rows = grid.reshape(prompts * slots, kv_heads, group, features)
    return rows if caches.dense else rows[caches.grid_index]


def _decode_step(ids: torch.Tensor, positions: torch.Tensor, length: int, embed: torch.Tensor,
                 layers: list[_LayerWeights], final_norm: _Norm, head: Linear, cos_table: torch.Tensor,
                 sin_table: torch.Tensor, caches: _DecodeCaches, dims: _Dims) -> torch.Tensor:
    """One token per row ([rows, 1] ids at their positions): writes its k/v at column `length` of the caches
    and returns the next token's logits [rows, vocab]. A pure function of its inputs (but for the cache
    writes), so it can be compiled whole (`DecoderRunner(compile=True)`)."""
    rows, kv_heads, group, head_dim = ids.shape[0], dims.kv_heads, dims.group, dims.head_dim

    def attend(index: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scaling: float) -> torch.Tensor:
        caches.keys[index][length] = _as(k[:, 0], dims.attn_dtype)
        caches.values[index][length] = _as(v[:, 0], dims.attn_dtype)
        q = _operand(q, dims).view(rows, kv_heads, group, head_dim)
        # A cache stored in the model's dtype is widened here, one layer at a time (a no-op for float32).
        prompt_keys = _wide(caches.prompt_keys[index]).permute(1, 2, 3, 0)  # [prompts, kv_heads, D, P]
        own_keys = _wide(caches.keys[index][: length + 1]).permute(1, 2, 3, 0)  # [rows, kv_heads, D, t]
        prompt_scores = _from_grid(torch.matmul(_to_grid(q, caches), prompt_keys), caches, group) + caches.row_bias
        scores = torch.cat([prompt_scores, torch.matmul(q, own_keys)], dim=-1).mul_(scaling)
        weights = torch.softmax(scores, dim=-1)
        width = prompt_keys.shape[-1]
        own_values = _wide(caches.values[index][: length + 1]).permute(1, 2, 0, 3)  # [rows, kv_heads, t, D]
        out = torch.matmul(weights[..., width:], own_values)
        prompt_values = _wide(caches.prompt_values[index]).permute(1, 2, 0, 3)  # [prompts, kv_heads, P, D]
        out += _from_grid(torch.matmul(_to_grid(weights[..., :width], caches), prompt_values), caches, group)
        return _as(out.view(rows, 1, kv_heads * group * head_dim), dims.attn_dtype)

    x = F.embedding(ids, embed)
    cos, sin = cos_table[positions].unsqueeze(2), sin_table[positions].unsqueeze(2)  # [rows, 1, 1, D]
    hidden = _layers(x, cos, sin, layers, dims, attend)
    return _logits(hidden[:, 0], final_norm, head, dims)


_compiled_decode_step: Callable[..., torch.Tensor] | None = None


def _compiled_step() -> Callable[..., torch.Tensor]:
    """`_decode_step` under torch.compile, made once per process (dynamic shapes: rows, columns and prompts
    change from step to step; one graph serves them)."""
    global _compiled_decode_step
    if _compiled_decode_step is None:
        prepare_compile()
        _compiled_decode_step = torch.compile(_decode_step, dynamic=True)
    return _compiled_decode_step


class DecoderRunner:
    """Prefill, decode and compaction for one batch of rows (sequences), the prompt KV shared by its group.

    KV caches are time-major, ``[length, batch, kv_heads, head_dim]`` per layer, rounded to the attention
    operand dtype (bf16 under autocast: exactly what SDPA would be given) and stored in ``kv_dtype``: widened
    to float32, the dtype of the attention matmuls (SDPA accumulates in float32), or in the attention dtype
    itself. Widened, they take twice the memory but read less per step than widening a low-precision cache at
    every step (2 bytes read, 4 written and read again per element), and save an op per cache and layer
    (tiny-3m, 64 x 32 tokens: 133 -> 111 ms); the engine keeps them in the model's dtype for long prompts and
    large caches (`HFEngine`'s ``kv_cache_dtype``). The values are the same either way. Two parts:

    * the prompt part, one slot per distinct prompt, written once by the prefill and never copied per row;
    * the generated part, one slot per row, preallocated for ``max_new_tokens`` columns.

    A decode step's attention is the softmax over both parts together. The prompt part is computed per
    group: the query rows of a prompt's sequences are laid out on a ``[prompts, rows per prompt]`` grid so
    one matmul per prompt reads its KV once, instead of once per sequence — for n samples of a long prompt,
    n times less KV memory and traffic. Dropping finished rows re-packs the grid (and the prompts left).

    ``prepack`` (on by default) runs the eager steps' linears on CPU through weights prepacked for oneDNN
    (`posttrain.models.kernels`: float32 ~2x faster than `F.linear` on a CPU where MKL runs below peak, bfloat16
    1.03-2.18x and bit-identical), at the cost of one more copy of the linear weights; off, `F.linear` on the weights.
    """

    def __init__(self, model: torch.nn.Module, autocast: torch.dtype | None = None, compile: bool = False,
                 kv_dtype: torch.dtype = torch.float32, prefill_chunk: int | None = PREFILL_CHUNK,
                 prepack: bool = True):
        reason = fast_path_unsupported(model)
        if reason is not None:
            raise ValueError(f"the fast decoder cannot run this model: {reason}")
        config = model.config
        self.model = model
        self.body = model.model
        self.weights = _Weights(autocast)
        self.layers = [_Layer(layer, self.weights) for layer in self.body.layers]
        self.final_norm = _norm(self.body.norm)
        num_heads = config.num_attention_heads
        num_kv_heads = getattr(config, "num_key_value_heads", None) or num_heads
        param_dtype = self.body.embed_tokens.weight.dtype
        # What SDPA would see (bf16 under autocast): the operands are rounded to it before the float32 maths.
        self.dims = _Dims(num_heads, num_kv_heads, num_heads // num_kv_heads,
                          getattr(config, "head_dim", None) or config.hidden_size // num_heads,
                          autocast, autocast or param_dtype)
        self.device = self.body.embed_tokens.weight.device
        self.param_dtype = param_dtype
        self.step = _compiled_step() if compile else _decode_step
        # float32 (the default: the fastest here, see the class docstring) or the attention dtype (half the
        # memory); the engine picks per chunk (`HFEngine(kv_cache_dtype=...)`), so it is an attribute.
        self.kv_dtype = kv_dtype
        self.prefill_chunk = prefill_chunk
        self.prepack = prepack  # eager linears through prepacked oneDNN weights where they apply (on CPU)
        self.batch_rows = 0  # the rows the running batch started with (prefill/join): what kernels are chosen for
        self._parameters: list[torch.Tensor] = []  # what `_resolve`'s stamp watches (`watch_parameters`)
        # the parameters' stamps, and per batch size the resolved weights (`_resolve`)
        self._resolved: tuple[list, dict[int, tuple[list[_LayerWeights], Linear]]] = ([], {})
        self.peak_kv_bytes = 0
        self._rope_len = 0
        self.release()

    def _rope(self, capacity: int) -> None:
        if capacity <= self._rope_len:
            return
        positions = torch.arange(capacity, device=self.device)[None]
        probe = torch.empty(1, capacity, 1, dtype=self.param_dtype, device=self.device)
        cos, sin = self.body.rotary_emb(probe, position_ids=positions)
        self.cos, self.sin = cos[0], _signed_sin(sin[0])  # sign-folded for `_rotate`
        self._rope_len = capacity

    # ---- the layer maths (module-level functions, shared with the decode step) ------------------------

    def watch_parameters(self) -> None:
        """List the model's parameters for `_resolve`'s stamp; called per batch (prefill, or a speculative runner's
        start), so a parameter replaced by another object between batches is seen, not only one updated in place
        (within a batch the engine's lock keeps the weights as they are)."""
        parameters = list(self.model.parameters())
        if [id(p) for p in parameters] != [id(p) for p in self._parameters]:
            self.weights.clear()  # copies of replaced parameters: keyed by ids that may be reused
        self._parameters = parameters

    def _resolve(self, rows: int) -> tuple[list[_LayerWeights], Linear]:
        """Every layer's tensors and the head's now, for a batch of ``rows`` rows: with prepacked weights where
        they are faster for it (0: none; a compiled step cannot take them as inputs, see
        `posttrain.models.kernels`). Resolved again only when a parameter changed (its version counter or its
        storage): a decode step of one row is ~0.1 ms of Python cheaper than looking each matmul's weights up."""
        rows = rows if self.prepack else 0
        stamp = [(id(p), p._version, p.data_ptr()) for p in self._parameters]
        if self._resolved[0] != stamp:
            self._resolved = (stamp, {})
        hit = self._resolved[1].get(rows)
        if hit is None:
            head = self.model.lm_head
            hit = ([layer.resolve(rows) for layer in self.layers],
                   self.weights.linear((head.weight,), (head.bias,), rows))
            self._resolved[1][rows] = hit
        return hit

    # ---- prefill: the prompts attend to themselves ------------------------------------------------------

    def prefill(self, prompts: list[list[int]], rows_per_prompt: int | Sequence[int],
                max_new_tokens: int, running: int = 0) -> torch.Tensor:
        """Run the distinct prompts once; each gets `rows_per_prompt` rows (one count for all, or one per
        prompt), the rows in prompt order. Logits [rows, vocab]. ``running``: rows already decoding beside these
        (`join`); the batch's kernels are chosen for all its rows.

        Prompts longer than `prefill_chunk` run `prefill_chunk` columns at a time through all layers (each
        chunk attends to the KV of the chunks before it and causally to itself): the attention scores are
        ``[chunk, P]`` per head instead of ``[P, P]``, which for an 8k prompt is 16x less transient memory."""
        width = max(len(p) for p in prompts)
        self._rope(width + max_new_tokens)
        counted = rows_per_prompt * len(prompts) if isinstance(rows_per_prompt, int) else sum(rows_per_prompt)
        self.batch_rows = running + counted  # fixed for the batch: one copy of each weight in use (`_resolve`)
        self.watch_parameters()
        ids = torch.zeros(len(prompts), width, dtype=torch.long)
        valid = torch.zeros(len(prompts), width, dtype=torch.bool)
        for row, prompt in enumerate(prompts):
            ids[row, width - len(prompt) :] = torch.tensor(prompt)
            valid[row, width - len(prompt) :] = True
        ids, valid = ids.to(self.device), valid.to(self.device)
        positions = (valid.long().cumsum(-1) - 1).clamp_(min=0)
        self.prompt_keys = [self._empty(width, len(prompts)) for _ in self.layers]
        self.prompt_values = [self._empty(width, len(prompts)) for _ in self.layers]
        (layers, head), chunk = self._resolve(self.batch_rows), self.prefill_chunk or width
        for start in range(0, width, chunk):
            hidden = self._prefill_columns(ids, valid, positions, start, min(width, start + chunk), layers)
        logits = _logits(hidden[:, -1], self.final_norm, head, self.dims)
        counts = rows_per_prompt if isinstance(rows_per_prompt, int) else torch.tensor(rows_per_prompt,
                                                                                       device=self.device)
        rows_prompt = torch.arange(len(prompts), device=self.device).repeat_interleave(counts)
        self.prompt_bias = torch.zeros(valid.shape, device=self.device).masked_fill_(~valid, float("-inf"))
        self.keys = [self._empty(max_new_tokens, len(rows_prompt)) for _ in self.layers]
        self.values = [self._empty(max_new_tokens, len(rows_prompt)) for _ in self.layers]
        self.length = 0
        self.positions = valid.sum(-1)[rows_prompt]
        self._regroup(rows_prompt)
        self.peak_kv_bytes = max(self.peak_kv_bytes, self.kv_bytes())
        return logits[rows_prompt]

    def _prefill_columns(self, ids: torch.Tensor, valid: torch.Tensor, positions: torch.Tensor, start: int,
                         end: int, layers: list[_LayerWeights]) -> torch.Tensor:
        """Prompt columns [start, end) through every layer, their KV written into the prompt caches; the hidden
        states [B, end - start, hidden]."""
        dims = self.dims
        query_at = torch.arange(start, end, device=self.device)[:, None]
        key_at = torch.arange(end, device=self.device)[None, :]
        # A padding query sees only itself: finite garbage that no real token ever attends to.
        mask = (((key_at <= query_at) & valid[:, None, :end]) | (key_at == query_at))[:, None]

        def attend(index, q, k, v, scaling):
            self.prompt_keys[index][start:end] = k.transpose(0, 1).to(dims.attn_dtype)
            self.prompt_values[index][start:end] = v.transpose(0, 1).to(dims.attn_dtype)
            keys = _wide(self.prompt_keys[index][:end]).permute(1, 2, 3, 0)  # [B, kv_heads, D, end]
            values = _wide(self.prompt_values[index][:end]).permute(1, 2, 0, 3)  # [B, kv_heads, end, D]
            return masked_attention(q, keys, values, ~mask[:, :, None], scaling, dims)

        x = F.embedding(ids[:, start:end], self.body.embed_tokens.weight)
        where = positions[:, start:end]
        cos, sin = self.cos[where].unsqueeze(2), self.sin[where].unsqueeze(2)  # [B, S, 1, D]
        return _layers(x, cos, sin, layers, dims, attend)

    def kv_bytes(self) -> int:
        """Bytes the KV caches hold now (prompt part and generated part, every layer)."""
        return sum(t.numel() * t.element_size()
                   for caches in (self.prompt_keys, self.prompt_values, self.keys, self.values) for t in caches)

    def _empty(self, length: int, batch: int) -> torch.Tensor:
        shape = (length, batch, self.dims.kv_heads, self.dims.head_dim)
        return torch.empty(shape, dtype=self.kv_dtype, device=self.device)  # holds attn_dtype-rounded values

    # ---- decode: one token per row, attending to its prompt (shared) and its own tokens ---------------

    def decode(self, tokens: torch.Tensor) -> torch.Tensor:
        """Append one token per row; logits [rows, vocab] for the next one."""
        # The first two columns, and the last rows of a batch once one prompt is left, run eagerly: torch
        # specializes sizes 0 and 1, so each would be a compiled graph of its own (a recompile of ~9-30 CPU-s on 2
        # cores) for a step or two in 32. (One row per prompt, as RL's episodes ask, is the usual layout: compiled.)
        compiled = self.step is not _decode_step and self.length >= 2 and self.grid[0] >= 2
        step = self.step if compiled else _decode_step
        # Dense: every prompt keeps all its rows, so the grid needs no index. Compiled with several rows per prompt,
        # the indexed layout always (the dense grid is the indexed one with the identity index): one graph before
        # and after finished rows are dropped -- the switch cost a recompile of minutes on 2 cores. One row per
        # prompt is always dense (and its own graph: torch specializes a size of 1).
        dense = self.grid[0] * self.grid[1] == len(self.rows_prompt) and not (compiled and self.grid[1] > 1)
        caches = _DecodeCaches(self.keys, self.values, self.prompt_keys, self.prompt_values, self.grid_index,
                               self.row_bias, *self.grid, dense)
        layers, head = self._resolve(0 if compiled else self.batch_rows)
        logits = step(tokens[:, None], self.positions[:, None], self.length, self.body.embed_tokens.weight, layers,
                      self.final_norm, head, self.cos, self.sin, caches, self.dims)
        self.positions += 1
        self.length += 1
        return logits

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

    # ---- continuous batching: new prompts join a running batch --------------------------------------------

    @property
    def rows(self) -> int:
        """How many rows (sequences) the batch holds now (0 after `release`)."""
        return self.keys[0].shape[1] if self.keys else 0

    def join(self, prompts: list[list[int]], rows_per_prompt: int, capacity: int) -> torch.Tensor:
        """Add `prompts` (each with `rows_per_prompt` rows) to the running rows; logits [new rows, vocab].

        The running rows stay first, in order, the new rows follow. Every running row's generated KV is folded
        into a prompt slot of its own (its prompt KV, then its tokens so far), so all rows restart their
        generated part at column 0 with room for `capacity` more tokens each. The fold copies the batch's KV
        once per join (a serving scheduler joins arrivals together, not one per step); the attention maths of
        later steps is unchanged: a row attends to the same keys, in another layout.
        """
        if not self.rows:
            return self.prefill(prompts, rows_per_prompt, capacity)
        old_keys, old_values, old_bias = self._folded()
        old_positions = self.positions
        logits = self.prefill(prompts, rows_per_prompt, capacity, running=len(old_positions))
        width = max(old_bias.shape[1], self.prompt_bias.shape[1])
        self.prompt_keys = [torch.cat([_left_pad(a, width), _left_pad(b, width)], dim=1)
                            for a, b in zip(old_keys, self.prompt_keys)]
        self.prompt_values = [torch.cat([_left_pad(a, width), _left_pad(b, width)], dim=1)
                              for a, b in zip(old_values, self.prompt_values)]
        self.prompt_bias = torch.cat([_left_pad_bias(old_bias, width), _left_pad_bias(self.prompt_bias, width)])
        old_rows, new_rows = len(old_positions), len(self.positions)
        self.keys = [self._empty(capacity, old_rows + new_rows) for _ in self.layers]
        self.values = [self._empty(capacity, old_rows + new_rows) for _ in self.layers]
        self.positions = torch.cat([old_positions, self.positions])
        self._rope(int(self.positions.max()) + capacity + 1)
        rows_prompt = torch.cat([torch.arange(old_rows, device=self.device), old_rows + self.rows_prompt])
        self._regroup(rows_prompt)
        self.peak_kv_bytes = max(self.peak_kv_bytes, self.kv_bytes())
        return logits

    def reserve(self, capacity: int) -> None:
        """Make room for `capacity` generated columns per row (copying the generated KV when it grows)."""
        if not self.keys or self.keys[0].shape[0] >= capacity:
            return
        for caches in (self.keys, self.values):
            for index, cache in enumerate(caches):
                grown = self._empty(capacity, cache.shape[1])
                grown[: self.length] = cache[: self.length]
                caches[index] = grown
        self._rope(int(self.positions.max()) + capacity - self.length + 1)
        self.peak_kv_bytes = max(self.peak_kv_bytes, self.kv_bytes())

    def _folded(self) -> tuple[list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
        """Per running row: its prompt KV then its generated KV, as one prompt slot per row ([P + t, rows, ...])
        and the bias over those columns."""
        rows_prompt, length = self.rows_prompt, self.length
        keys = [torch.cat([p.index_select(1, rows_prompt), k[:length]]) for p, k in zip(self.prompt_keys, self.keys)]
        values = [torch.cat([p.index_select(1, rows_prompt), v[:length]])
                  for p, v in zip(self.prompt_values, self.values)]
        bias = self.prompt_bias[rows_prompt]
        bias = torch.cat([bias, bias.new_zeros(len(rows_prompt), length)], dim=1)
        return keys, values, bias

    def release(self) -> None:
        self.keys, self.values, self.prompt_keys, self.prompt_values = [], [], [], []


def _left_pad(cache: torch.Tensor, width: int) -> torch.Tensor:
    """A time-major prompt cache [P, prompts, ...] padded on the left to `width` columns (masked by the bias)."""
    if cache.shape[0] == width:
        return cache
    return torch.cat([cache.new_zeros(width - cache.shape[0], *cache.shape[1:]), cache])


def _left_pad_bias(bias: torch.Tensor, width: int) -> torch.Tensor:
    if bias.shape[1] == width:
        return bias
    return torch.cat([bias.new_full((bias.shape[0], width - bias.shape[1]), float("-inf")), bias], dim=1)
