"""DFlash: a block-diffusion draft conditioned on the target's tapped hidden states.

Context: the tapped states of every committed token, ``hidden_norm(fc(concat))``
(optionally RMS-normed per tap first). Every draft layer projects this same
context to keys and values (its own k_proj / v_proj, k_norm, RoPE at absolute
positions); context rows make no queries. A round runs one block
``[current, mask x (block_size - 1)]`` at positions ``pos ..``: embeddings from
the target times ``input_embedding_scale``, each layer attention over context +
block (bidirectional within the block unless causal) and a SwiGLU MLP, a final
norm, and the target's head (``raw_logits``) on block rows ``1 .. n``.

The session keeps context keys/values only: the block's are written after them
for the round and overwritten by the next commit.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn

import mlxrunner
from mlxrunner import DraftConfigError, DraftProposal, arange_constant, constant


class Linear(nn.Linear):
    """``nn.Linear`` through :func:`mlxrunner.project`: on CUDA a draft block's rows run as
    one-row products (MLX's matrix-vector kernel) instead of a short cuBLAS product."""

    def __call__(self, x: mx.array) -> mx.array:
        if "bias" in self:
            return super().__call__(x)
        return mlxrunner.project(x, self["weight"].T)


@dataclass(frozen=True)
class DFlashArgs:
    """A DFlash / DFlash2 config.json, parsed."""

    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    layer_types: tuple[str, ...]
    sliding_window: int | None
    causal: bool
    input_embedding_scale: float
    output_multiplier: float
    final_logit_softcapping: float | None
    aux_hidden_norms: bool
    conv_kernel_size: int = 0
    conv_group_size: int = 0
    selector_rank: int = 0
    selector_top_k: int = 0

    @classmethod
    def from_config(cls, config: Mapping[str, Any]) -> DFlashArgs:
        section = config.get("dflash_config") or {}

        def setting(key: str, default: Any = None) -> Any:
            value = section.get(key)
            if value is None:
                value = config.get(key)
            return default if value is None else value

        def required(key: str) -> Any:
            value = config.get(key)
            if value is None:
                raise DraftConfigError(f"draft config has no {key}")
            return value

        hidden = int(required("hidden_size"))
        layers = int(required("num_hidden_layers"))
        heads = int(required("num_attention_heads"))
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or hidden // heads)
        layer_types = tuple(config.get("layer_types") or ["full_attention"] * layers)
        if len(layer_types) != layers:
            raise DraftConfigError(f"draft config: {len(layer_types)} layer_types for "
                                   f"{layers} layers")
        unknown = sorted(set(layer_types) - {"full_attention", "sliding_attention"})
        if unknown:
            raise DraftConfigError(f"draft config: unsupported layer types {unknown}")
        window = config.get("sliding_window")
        if "sliding_attention" in layer_types and not window:
            raise DraftConfigError("draft config has sliding_attention layers but no "
                                   "sliding_window")
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in ("default", None):
            raise DraftConfigError(f"draft config: rope_type {rope_type!r} is not supported "
                                   "(only default RoPE)")
        theta = float(config.get("rope_theta") or rope.get("rope_theta") or 10000.0)
        causal = setting("causal")
        if causal is None:
            causal = config.get("is_causal")
        cap = setting("final_logit_softcapping")
        return cls(
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=int(required("intermediate_size")),
            rms_norm_eps=float(config.get("rms_norm_eps") or 1e-6),
            rope_theta=theta,
            layer_types=layer_types,
            sliding_window=int(window) if window else None,
            causal=bool(causal),
            input_embedding_scale=float(setting("input_embedding_scale", 1.0)),
            output_multiplier=float(setting("output_multiplier", 1.0)),
            final_logit_softcapping=float(cap) if cap else None,
            aux_hidden_norms=bool(setting("aux_hidden_norms", False)),
            conv_kernel_size=int(setting("conv_kernel_size", 0)),
            conv_group_size=int(setting("conv_group_size", 0)),
            selector_rank=int(setting("selector_rank", 0)),
            selector_top_k=int(setting("selector_top_k", 0)),
        )


class ContextKV:
    """One draft layer's context keys/values, rows at absolute positions ``start .. end-1``.

    The round's block is written just after the context (:meth:`with_block`)
    without advancing it, so the next :meth:`append` overwrites it: the block
    leaves nothing behind. A sliding layer keeps only the rows its window can
    still reach.
    """

    step = 256

    def __init__(self, window: int | None) -> None:
        self.window = window
        self.keys: mx.array | None = None
        self.values: mx.array | None = None
        self.start = 0
        self.length = 0

    @property
    def end(self) -> int:
        return self.start + self.length

    def reserve(self, extra: int, like_k: mx.array, like_v: mx.array) -> None:
        """Room for ``extra`` rows after the context. Capacity stays a multiple of ``step``,
        so a traced block sees few distinct buffer shapes."""
        need = self.length + extra
        if self.keys is not None and need <= self.keys.shape[2] and \
                self.keys.shape[2] % self.step == 0:
            return
        B, H, _, Dk = like_k.shape
        size = ((need + self.step - 1) // self.step) * self.step
        keys = mx.zeros((B, H, size, Dk), like_k.dtype)
        values = mx.zeros((B, like_v.shape[1], size, like_v.shape[3]), like_v.dtype)
        if self.keys is not None and self.length:
            keys[..., :self.length, :] = self.keys[..., :self.length, :]
            values[..., :self.length, :] = self.values[..., :self.length, :]
        self.keys, self.values = keys, values

    def make_room(self, m: int, like_k: mx.array, like_v: mx.array) -> None:
        """Before appending ``m`` rows: drop what no window can reach, reserve the rest."""
        if self.window is not None and self.keys is not None and self.length + m > 2 * self.window:
            # Rows more than a window behind the newest can never be attended again;
            # dropping them once per window of appends keeps the copy amortised.
            keep = min(self.length, max(self.window - 1 - m, 0))
            drop = self.length - keep
            if drop > 0:
                self.keys = self.keys[..., drop:self.length, :]
                self.values = self.values[..., drop:self.length, :]
                self.start += drop
                self.length = keep
        self.reserve(m, like_k, like_v)

    def append(self, keys: mx.array, values: mx.array) -> None:
        m = keys.shape[2]
        self.make_room(m, keys, values)
        self.keys[..., self.length:self.length + m, :] = keys
        self.values[..., self.length:self.length + m, :] = values
        self.length += m

    def with_block(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Context rows followed by the block's rows (the context does not advance)."""
        n = keys.shape[2]
        self.reserve(n, keys, values)
        self.keys[..., self.length:self.length + n, :] = keys
        self.values[..., self.length:self.length + n, :] = values
        end = self.length + n
        return self.keys[..., :end, :], self.values[..., :end, :]

    def block_mask(self, pos: int, block: int, causal: bool) -> mx.array | None:
        """Which of the rows :meth:`with_block` returns a block row may attend (None: all)."""
        ctx = self.length
        # every context row within the window of the last block row: nothing to mask
        in_window = self.window is None or (pos + block - 1) - self.start < self.window
        if in_window and not causal:
            return None
        query = pos + arange_constant(block)[:, None]
        if ctx:
            ctx_pos = self.start + arange_constant(ctx)[None]
            if self.window is not None:
                ctx_ok = (query - ctx_pos) < self.window
            else:
                ctx_ok = mx.ones((block, ctx), dtype=mx.bool_)
        else:
            ctx_ok = mx.zeros((block, 0), dtype=mx.bool_)
        if causal:
            blk_ok = arange_constant(block)[None] <= arange_constant(block)[:, None]
        else:
            blk_ok = mx.ones((block, block), dtype=mx.bool_)
        return mx.concatenate([mx.broadcast_to(ctx_ok, (block, ctx)), blk_ok], axis=1)


class TracedKV:
    """A :class:`ContextKV` inside a traced block: the whole buffer and the context's length
    and first position as arrays, so one trace serves every round until the buffer grows.
    The block is written at ``length`` (as :meth:`ContextKV.with_block` does) and attention
    reads the whole buffer under a validity mask."""

    def __init__(self, keys: mx.array, values: mx.array, length: mx.array, start: mx.array,
                 window: int | None, masks: dict[Any, mx.array] | None = None) -> None:
        self.keys, self.values = keys, values
        self.length, self.start, self.window = length, start, window
        # Layers with one window hold the same rows (same length and start), so one mask
        # serves them all: ``masks`` is shared by the stores of one traced block.
        self.masks = {} if masks is None else masks

    def with_block(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Writes rows at ``length`` (a block, or the rows a commit appends)."""
        at = self.length.reshape(1)
        self.keys = mx.slice_update(self.keys, keys, at, axes=(2,))
        self.values = mx.slice_update(self.values, values, at, axes=(2,))
        return self.keys, self.values

    def block_mask(self, pos: mx.array, block: int, causal: bool) -> mx.array:
        key = (self.window, self.keys.shape[2], block, causal)
        if key not in self.masks:
            self.masks[key] = self._mask(pos, block, causal)
        return self.masks[key]

    def _mask(self, pos: mx.array, block: int, causal: bool) -> mx.array:
        row = arange_constant(self.keys.shape[2])[None]  # row j: position start + j
        query = arange_constant(block)[:, None]
        in_context = row < self.length
        if self.window is not None:
            in_context &= (pos + query) - (self.start + row) < self.window
        in_block = (row >= self.length) & (row < self.length + block)
        if causal:
            in_block &= row - self.length <= query
        return in_context | in_block


class DraftAttention(nn.Module):
    def __init__(self, args: DFlashArgs, sliding: bool) -> None:
        super().__init__()
        self.n_heads = args.num_attention_heads
        self.n_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        self.scale = args.head_dim ** -0.5
        self.window = args.sliding_window if sliding else None
        self.causal = args.causal
        h, d = args.hidden_size, args.head_dim
        self.q_proj = Linear(h, self.n_heads * d, bias=False)
        self.k_proj = Linear(h, self.n_kv_heads * d, bias=False)
        self.v_proj = Linear(h, self.n_kv_heads * d, bias=False)
        self.o_proj = Linear(self.n_heads * d, h, bias=False)
        self.q_norm = nn.RMSNorm(d, eps=args.rms_norm_eps)
        self.k_norm = nn.RMSNorm(d, eps=args.rms_norm_eps)
        self.rope = nn.RoPE(d, traditional=False, base=args.rope_theta)

    def _keys_values(self, x: mx.array, position: int | mx.array) -> tuple[mx.array, mx.array]:
        B, L, _ = x.shape
        k = self.k_norm(self.k_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim))
        v = self.v_proj(x).reshape(B, L, self.n_kv_heads, self.head_dim)
        k = self.rope(k.transpose(0, 2, 1, 3), offset=position)
        return k, v.transpose(0, 2, 1, 3)

    def context_kv(self, context: mx.array, position: int) -> tuple[mx.array, mx.array]:
        """Keys/values of context rows starting at absolute ``position``."""
        return self._keys_values(context, position)

    def __call__(self, x: mx.array, pos: int | mx.array, store: ContextKV | TracedKV
                 ) -> mx.array:
        B, L, _ = x.shape
        q = self.q_norm(self.q_proj(x).reshape(B, L, self.n_heads, self.head_dim))
        q = self.rope(q.transpose(0, 2, 1, 3), offset=pos)
        k, v = self._keys_values(x, pos)
        mask = store.block_mask(pos, L, self.causal)
        keys, values = store.with_block(k, v)
        out = mlxrunner.attend(q, keys, values, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(B, L, -1))


class SwiGLU(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate, bias=False)
        self.up_proj = Linear(hidden, intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)

    def __call__(self, x: mx.array) -> mx.array:
        return self.down_proj(nn.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashLayer(nn.Module):
    def __init__(self, args: DFlashArgs, index: int) -> None:
        super().__init__()
        self.self_attn = DraftAttention(args, args.layer_types[index] == "sliding_attention")
        self.mlp = SwiGLU(args.hidden_size, args.intermediate_size)
        self.input_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)

    def __call__(self, h: mx.array, pos: int | mx.array, store: ContextKV | TracedKV
                 ) -> mx.array:
        h = h + self.self_attn(self.input_layernorm(h), pos, store)
        return h + self.mlp(self.post_attention_layernorm(h))


def softcap(x: mx.array, cap: float | None) -> mx.array:
    return x if not cap else cap * mx.tanh(x / cap)


class DFlashDraftModel(mlxrunner.DraftModel):
    """The DFlash block draft. Borrows the target's embedding and head; drafts with a
    depth chosen per round (``adaptive_depth``)."""

    adaptive_depth = True
    layer_class: type[nn.Module] = DFlashLayer
    #: run each round's block through a traced graph (off: eagerly, op by op)
    trace_blocks = True

    def __init__(self, config: dict[str, Any], target: mlxrunner.Model) -> None:
        super().__init__(config, target)
        args = DFlashArgs.from_config(config)
        self.args = args
        n_taps = len(self.taps)
        target_hidden = target.hidden_size
        if args.aux_hidden_norms:
            self.aux_hidden_norms = [nn.RMSNorm(target_hidden, eps=args.rms_norm_eps)
                                     for _ in range(n_taps)]
        self.fc = Linear(n_taps * target_hidden, args.hidden_size, bias=False)
        self.hidden_norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        self.layers = [self.layer_class(args, i) for i in range(args.num_hidden_layers)]
        self.norm = nn.RMSNorm(args.hidden_size, eps=args.rms_norm_eps)
        # Own embedding / head live under the checkpoint's names as dict entries (the
        # methods embed_tokens / raw_logits of the base class look them up).
        if self.own_embedding:
            self["embed_tokens"] = nn.Embedding(target.vocab_size, args.hidden_size)
        if self.own_head:
            self["lm_head"] = Linear(args.hidden_size, target.vocab_size, bias=False)
        self._graphs: dict[tuple[Any, ...], Any] = {}  # traced rounds (``traced``)

    @classmethod
    def config_for_checkpoint(cls, config: dict[str, Any], tensor_names: Any) -> dict[str, Any]:
        names = set(tensor_names)
        config = super().config_for_checkpoint(config, names)
        section = dict(config.get("dflash_config") or {})
        if "aux_hidden_norms" not in section and "aux_hidden_norms" not in config:
            section["aux_hidden_norms"] = any(n.startswith("aux_hidden_norms.") for n in names)
            config["dflash_config"] = section
        return config

    def validate(self, target: mlxrunner.Model) -> None:
        super().validate(target)
        args = self.args
        if args.num_attention_heads % args.num_key_value_heads:
            raise DraftConfigError(f"{type(self).__name__}: {args.num_attention_heads} heads "
                                   f"are not a multiple of {args.num_key_value_heads} KV heads")

    # -- the computation -----------------------------------------------------------
    @property
    def compute_dtype(self) -> mx.Dtype:
        """The dtype activations run in: the norms' (never quantized, unlike projections)."""
        return self.hidden_norm.weight.dtype

    def context(self, tapped: mx.array) -> mx.array:
        """Tapped target states [B, M, taps * hidden] -> context rows [B, M, hidden]."""
        dtype = self.compute_dtype
        if getattr(self, "aux_hidden_norms", None):
            parts = mx.split(tapped, len(self.taps), axis=-1)
            tapped = mx.concatenate([norm(p) for norm, p in zip(self.aux_hidden_norms, parts)],
                                    axis=-1)
        return self.hidden_norm(self.fc(tapped.astype(dtype)))

    def block_hidden(self, ids: mx.array, pos: int | mx.array,
                     stores: list[ContextKV] | list[TracedKV]) -> mx.array:
        """Final-normed hidden states of a block ``ids`` [1, L] at positions ``pos ..``."""
        h = self.embed_tokens(ids)
        if self.args.input_embedding_scale != 1.0:
            h = h * self.args.input_embedding_scale
        h = h.astype(self.compute_dtype)
        for layer, store in zip(self.layers, stores):
            h = layer(h, pos, store)
        return self.norm(h)

    def proposal_logits(self, hidden: mx.array) -> mx.array:
        """The draft's logits: the head, times output_multiplier, softcapped if configured."""
        logits = self.raw_logits(hidden).astype(mx.float32)
        return self.scale_logits(logits)

    def scale_logits(self, logits: mx.array) -> mx.array:
        if self.args.output_multiplier != 1.0:
            logits = logits * self.args.output_multiplier
        return softcap(logits, self.args.final_logit_softcapping)

    # -- rounds: the block and its proposals --------------------------------------------
    def block_rows(self, anchor: mx.array, pos: int | mx.array, n: int,
                   stores: list[ContextKV] | list[TracedKV]) -> mx.array:
        """Block rows 1..n, final-normed: [n, hidden]. The full trained block always runs
        (in-block attention is bidirectional); only the first n rows are proposals."""
        masks = constant((self.mask_token_id,) * (self.block_size - 1), mx.int32)
        ids = mx.concatenate([anchor.astype(mx.int32), masks])[None]
        return self.block_hidden(ids, pos, stores)[0, 1:1 + n]

    def greedy_tokens(self, hidden: mx.array, anchor: mx.array) -> mx.array:
        """Temperature 0: the proposed tokens [n] from block rows ``hidden`` [n, hidden]
        (pure array code: it runs inside the traced block)."""
        return mx.argmax(self.proposal_logits(hidden), axis=-1).astype(mx.int32)

    def prepare_trace(self) -> None:
        """Runs before a block graph is first traced: first-use checks that evaluate."""
        a = self.args
        mlxrunner.prepare_attend(a.num_attention_heads, a.num_key_value_heads, a.head_dim,
                                 a.head_dim, self.block_size, self.compute_dtype)

    def traced(self, key: tuple[Any, ...], build: Any) -> Any:
        """The compiled graph for ``key`` (built by ``build()`` on first use), shared by every
        session of this draft: a new generation replays the graphs, it does not retrace."""
        graph = self._graphs.get(key)
        if graph is None:
            self.prepare_trace()
            graph = self._graphs[key] = mx.compile(build())
        return graph

    def _block_graph(self, n: int, greedy: bool) -> Any:
        windows = [layer.self_attn.window for layer in self.layers]

        def graph(anchor: mx.array, pos: mx.array, state: list[mx.array]) -> list[mx.array]:
            masks: dict[Any, mx.array] = {}
            stores = [TracedKV(*state[4 * i:4 * i + 4], window, masks)
                      for i, window in enumerate(windows)]
            hidden = self.block_rows(anchor, pos, n, stores)
            rows = self.greedy_tokens(hidden, anchor) if greedy else hidden
            return [rows] + [a for store in stores for a in (store.keys, store.values)]

        return graph

    def _append_graph(self) -> Any:
        windows = [layer.self_attn.window for layer in self.layers]

        def graph(tapped: mx.array, state: list[mx.array]) -> list[mx.array]:
            ctx = self.context(tapped)
            out = []
            for i, (layer, window) in enumerate(zip(self.layers, windows)):
                store = TracedKV(*state[4 * i:4 * i + 4], window)
                k, v = layer.self_attn.context_kv(ctx, store.start + store.length)
                out += store.with_block(k, v)
            return out

        return graph

    def new_session(self, sampler: Any) -> DFlashSession:
        return DFlashSession(self, sampler)


class DFlashSession(mlxrunner.DraftSession):
    """Context keys/values per draft layer; proposals from one block forward per round.

    The block and each commit run through traced graphs (one ``mx.compile`` graph per
    drafted length or committed row count, shared by the draft's sessions: a few fused
    kernels instead of hundreds of small ones) unless the draft's ``trace_blocks`` is off;
    both paths compute the same thing.
    """

    draft: DFlashDraftModel

    def __init__(self, draft: DFlashDraftModel, sampler: Any) -> None:
        super().__init__(draft, sampler)
        self.stores = [ContextKV(layer.self_attn.window) for layer in draft.layers]
        # empty arrays with each layer's key/value shape and dtype: what a store allocates by
        # when a traced graph needs room (made once, not every round)
        self._empty_kv = [mx.zeros((1, layer.self_attn.n_kv_heads, 0,
                                    layer.self_attn.head_dim), draft.compute_dtype)
                          for layer in draft.layers]

    @property
    def context_length(self) -> int:
        return self.stores[0].end if self.stores else 0

    @property
    def state(self) -> list[mx.array]:
        return [a for store in self.stores for a in (store.keys, store.values) if a is not None]

    def prefill(self, tapped: mx.array) -> None:
        self._append(tapped)

    def commit(self, tapped: mx.array) -> None:
        self._append(tapped)

    def _append(self, tapped: mx.array) -> None:
        draft = self.draft
        rows = tapped.shape[1]
        if draft.trace_blocks and rows <= draft.block_size and self.context_length:
            # a commit (a few rows): through a traced graph, one per row count
            graph = draft.traced(("append", rows), draft._append_graph)
            self._take_state(graph(tapped, self._graph_state(rows, appending=True)))
            for store in self.stores:
                store.length += rows
            return
        ctx = draft.context(tapped)
        for layer, store in zip(draft.layers, self.stores):
            k, v = layer.self_attn.context_kv(ctx, store.end)
            store.append(k, v)

    def _graph_state(self, rows: int, appending: bool) -> list[mx.array]:
        """Every store's (keys, values, length, start) for a traced graph that writes
        ``rows`` rows at the context's end (``appending``: rows the context keeps, so
        rows out of every window's reach may go first). The stores let go of their
        buffers so that the graph may write them in place (:meth:`_take_state`)."""
        state: list[mx.array] = []
        for like, store in zip(self._empty_kv, self.stores):
            if appending:
                store.make_room(rows, like, like)
            else:
                store.reserve(rows, like, like)
            state += [store.keys, store.values, mx.array(store.length, dtype=mx.int32),
                      mx.array(store.start, dtype=mx.int32)]
            store.keys = store.values = None
        return state

    def _take_state(self, buffers: Sequence[mx.array]) -> None:
        for i, store in enumerate(self.stores):
            store.keys, store.values = buffers[2 * i], buffers[2 * i + 1]

    def _check_block(self, pos: int, n: int) -> None:
        if pos != self.context_length:
            raise ValueError(f"draft context ends at {self.context_length}, round is at {pos}")
        size = self.draft.block_size
        if not 1 <= n <= size - 1:
            raise ValueError(f"a {size}-block drafts 1..{size - 1} tokens, asked for {n}")

    def block(self, current: int, pos: int, n: int) -> mx.array:
        """Final-normed hidden states of block rows 1..n ([n, hidden]), computed eagerly."""
        self._check_block(pos, n)
        return self.draft.block_rows(mx.array([current], dtype=mx.int32), pos, n, self.stores)

    def sampled(self, hidden: mx.array, anchor: mx.array) -> DraftProposal:
        """Temperature > 0: draws from the request's stream (outside any trace)."""
        logits = self.draft.proposal_logits(hidden)
        probs = mx.softmax(logits / self.temperature, axis=-1, precise=True)
        return DraftProposal(self.draw(probs), probs)

    def propose(self, current: int, pos: int, n: int) -> DraftProposal:
        self._check_block(pos, n)
        greedy = self.temperature <= 0
        anchor = mx.array([current], dtype=mx.int32)
        if self.draft.trace_blocks:
            rows = self._traced(anchor, pos, n, greedy)
        else:
            hidden = self.draft.block_rows(anchor, pos, n, self.stores)
            rows = self.draft.greedy_tokens(hidden, anchor) if greedy else hidden
        if greedy:
            return DraftProposal.point_mass(rows)
        return self.sampled(rows, anchor)

    def _traced(self, anchor: mx.array, pos: int, n: int, greedy: bool) -> mx.array:
        """The block through its traced graph: the tokens (greedy) or the hidden rows."""
        draft = self.draft
        graph = draft.traced(("block", n, greedy), lambda: draft._block_graph(n, greedy))
        state = self._graph_state(draft.block_size, appending=False)
        out = graph(anchor, mx.array(pos, dtype=mx.int32), state)
        self._take_state(out[1:])
        return out[0]
