"""Block drafts (DFlash, DFlash2): a draft whose round is one block forward over the context
keys and values of every committed token, run by the core.

A subclass of :class:`BlockDraft` is the draft's math: its ``layers`` (each with a
``self_attn`` holding ``window`` (None for full attention), ``n_kv_heads``, ``head_dim`` and
``context_kv(rows, position)``, the keys and values of context rows ``[B, M, hidden]`` at
absolute positions, ``position`` an int or one per row ``[B]``), ``context(tapped)`` (the
target's tapped states ``[B, M, taps * hidden]`` to context rows), ``block_rows(anchor, pos,
n, stores)`` (the final-normed hidden states ``[B, n, hidden]`` of block rows 1..n of the
blocks anchored at ``anchor [B]``, at positions ``pos ..`` (an int or ``[B]``), attending
through ``stores``), ``greedy_tokens(hidden, anchor)`` (temperature 0: the proposed tokens
``[B, n]``, pure array code), ``sampled(session, hidden, anchor)`` (temperature > 0: one
sequence's :class:`DraftProposal`, ``hidden [1, n, hidden]``, drawn with ``session.draw``)
and ``compute_dtype``.

The core keeps one :class:`~mlxrunner.cache.context.ContextCache` per layer and runs each
round's block and each commit through a traced graph (one ``mx.compile`` graph per drafted
length or committed row count, shared by the draft's sessions: a new generation replays
them), the stores standing in as :class:`~mlxrunner.cache.context.TracedContext` over
fixed-size buffers; with ``MLXRUNNER_COMPILE=0`` both run eagerly, and so does a graph whose
trace met enough products that run on the host BLAS (:func:`mlxrunner.nn.kernels.host_products`).
Either way they compute the same thing.

In a batch (:class:`mlxrunner.batch.Scheduler`) the greedy sequences of one draft share a
:class:`BlockDraftBatch`: their contexts stacked one row each
(:class:`~mlxrunner.cache.context.RowContext` in the graphs), each round one block forward
for every row and one commit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import mlx.core as mx

from .. import settings
from ..cache.batched import grow_rows
from ..cache.context import ContextCache, RowContext, TracedContext
from ..cache.frame import bucket_capacity
from ..constants import compiling
from ..errors import DraftConfigError
from ..nn.kernels import host_bound, host_declined
from .draft import DraftModel, DraftProposal, DraftSession


@dataclass(frozen=True)
class BlockSettings:
    """What every block draft declares in its config (:meth:`BlockDraft.setting`)."""

    taps: tuple[int, ...]
    block_size: int
    mask_token_id: int
    hidden_size: int
    vocab_size: int | None = None
    num_target_layers: int | None = None
    own_embedding: bool = False
    own_head: bool = False


class BlockDraft(DraftModel):
    """Base class of block drafts: their settings and the round's machinery (see the
    module). The settings (``target_layer_ids``, ``block_size``, ``mask_token_id``, and
    ``hidden_size``, ``vocab_size``, ``num_target_layers`` where given) are read through
    :meth:`setting`; :meth:`embed_tokens` and :meth:`raw_logits` use the draft's own
    ``embed_tokens`` / ``lm_head`` modules when its checkpoint has them (``own_embedding`` /
    ``own_head``), else the target's."""

    taps_setting = "target_layer_ids"

    def __init__(self, config: dict[str, Any], target: Any) -> None:
        super().__init__(config, target)
        self.settings = self._read_settings(config, target)
        self._graphs: dict[tuple[Any, ...], Callable[..., Any]] = {}
        #: keys of graphs whose traces met products on the host BLAS: run eagerly
        self._host_bound: set[tuple[Any, ...]] = set()

    @classmethod
    def setting(cls, config: Mapping[str, Any], key: str, default: Any = None) -> Any:
        """One of the block settings in ``config``: its top-level key, else ``default``. A
        draft format that keeps them elsewhere (DFlash's ``dflash_config``) overrides this."""
        value = config.get(key)
        return default if value is None else value

    def _read_settings(self, config: Mapping[str, Any], target: Any) -> BlockSettings:
        taps = self.setting(config, "target_layer_ids")
        if taps is None:
            raise DraftConfigError(f"{type(self).__name__}: the draft config has no "
                                   "target_layer_ids")
        try:
            vocab = config.get("vocab_size")
            n_target = self.setting(config, "num_target_layers")
            return BlockSettings(
                taps=tuple(int(t) for t in taps),
                block_size=int(self.setting(config, "block_size", 0)),
                mask_token_id=int(self.setting(config, "mask_token_id", -1)),
                hidden_size=int(config.get("hidden_size") or target.hidden_size),
                vocab_size=int(vocab) if vocab is not None else None,
                num_target_layers=int(n_target) if n_target is not None else None,
                own_embedding=bool(config.get("draft_own_embedding", False)),
                own_head=bool(config.get("draft_own_head", False)))
        except (TypeError, ValueError) as exc:
            raise DraftConfigError(f"{type(self).__name__}: the draft config has a malformed "
                                   f"setting ({exc})") from None

    @property
    def taps(self) -> tuple[int, ...]:
        return self.settings.taps

    @property
    def block_size(self) -> int:
        return self.settings.block_size

    @property
    def max_depth(self) -> int:
        """Most drafts per round: ``block_size - 1``."""
        return self.block_size - 1

    @property
    def mask_token_id(self) -> int:
        return self.settings.mask_token_id

    @property
    def own_embedding(self) -> bool:
        return self.settings.own_embedding

    @property
    def own_head(self) -> bool:
        return self.settings.own_head

    @classmethod
    def config_for_checkpoint(cls, config: dict[str, Any],
                              tensor_names: Iterable[str]) -> dict[str, Any]:
        """Records whether the checkpoint carries its own embedding table or head
        (``draft_own_embedding`` / ``draft_own_head``), unless the config says so."""
        names = set(tensor_names)
        config = super().config_for_checkpoint(config, names)
        config.setdefault("draft_own_embedding", "embed_tokens.weight" in names)
        config.setdefault("draft_own_head", "lm_head.weight" in names)
        return config

    def validate(self, target: Any) -> None:
        name = type(self).__name__
        if self.block_size < 2:  # (before the base's depth check: the setting's own words)
            raise DraftConfigError(f"{name}: block_size must be at least 2, got "
                                   f"{self.block_size}")
        super().validate(target)
        own, layers, vocab = self.settings, target.num_layers, target.vocab_size
        if own.num_target_layers is not None and own.num_target_layers != layers:
            raise DraftConfigError(f"{name}: draft was made for a target with "
                                   f"{own.num_target_layers} layers, this one has {layers}")
        if not 0 <= self.mask_token_id < vocab:
            raise DraftConfigError(f"{name}: mask_token_id {self.mask_token_id} is outside the "
                                   f"target's vocabulary of {vocab}")
        if own.vocab_size is not None and own.vocab_size != vocab:
            raise DraftConfigError(f"{name}: vocabulary {own.vocab_size} differs from "
                                   f"the target's {vocab}")
        if not self.own_embedding and own.hidden_size != target.hidden_size:
            raise DraftConfigError(f"{name}: hidden size {own.hidden_size} differs from "
                                   f"the target's embedding width {target.hidden_size}")

    def embed_tokens(self, ids: mx.array) -> mx.array:
        """Token embeddings: the draft's own table if it has one, else the target's."""
        if self.own_embedding:
            return self["embed_tokens"](ids)
        return self.target.embed_tokens(ids)

    def raw_logits(self, hidden: mx.array) -> mx.array:
        """The output head on normalised hidden states: the draft's own ``lm_head``, its own
        embedding when tied (``tie_word_embeddings``, default true), else the target's."""
        if self.own_head:
            return self["lm_head"](hidden)
        if self.own_embedding and self.config.get("tie_word_embeddings", True):
            return self["embed_tokens"].as_linear(hidden)
        return self.target.raw_logits(hidden)

    # -- the subclass's math ----------------------------------------------------------------
    @property
    def compute_dtype(self) -> mx.Dtype:
        raise NotImplementedError

    def context(self, tapped: mx.array) -> mx.array:
        raise NotImplementedError

    def block_rows(self, anchor: mx.array, pos: int | mx.array, n: int,
                   stores: Sequence[ContextCache | TracedContext | RowContext]) -> mx.array:
        raise NotImplementedError

    def greedy_tokens(self, hidden: mx.array, anchor: mx.array) -> mx.array:
        raise NotImplementedError

    def sampled(self, session: BlockDraftSession, hidden: mx.array, anchor: mx.array
                ) -> DraftProposal:
        raise NotImplementedError

    # -- traced graphs --------------------------------------------------------------------
    def traced(self, key: tuple[Any, ...], build: Callable[[], Callable[..., Any]]) -> Any:
        """The compiled graph for ``key`` (built by ``build()`` on first use), shared by
        every session of this draft."""
        graph = self._graphs.get(key)
        if graph is None:
            traced = mx.compile(build())

            def compiled(*args: Any) -> Any:
                with compiling():  # (a thread's first call traces it)
                    return traced(*args)

            def first(*args: Any) -> Any:  # the tracing call
                declined = host_declined()
                out = compiled(*args)
                if host_bound(declined):
                    self._host_bound.add(key)
                self._graphs[key] = compiled
                return out

            graph = self._graphs[key] = first
        return graph

    # (mlx's Module is a dict whose update takes other arguments: hence the ignore)
    def update(self, parameters: dict, strict: bool = True) -> BlockDraft:  # type: ignore[override]
        self._graphs.clear()  # traced graphs hold the old weights
        super().update(parameters, strict=strict)
        return self

    def update_modules(self, modules: dict, strict: bool = True) -> BlockDraft:
        self._graphs.clear()
        super().update_modules(modules, strict=strict)
        return self

    def _windows(self) -> list[int | None]:
        return [layer.self_attn.window for layer in self.layers]

    def _block_graph(self, n: int, greedy: bool) -> Callable[..., list[mx.array]]:
        windows = self._windows()

        def graph(anchor: mx.array, pos: mx.array, state: list[mx.array]) -> list[mx.array]:
            masks: dict[Any, mx.array] = {}
            stores = [_traced_context(state, i, window, masks)
                      for i, window in enumerate(windows)]
            hidden = self.block_rows(anchor, pos, n, stores)
            rows = self.greedy_tokens(hidden, anchor)[0] if greedy else hidden
            return [rows] + [a for store in stores for a in (store.keys, store.values)]

        return graph

    def _append_graph(self) -> Callable[..., list[mx.array]]:
        windows = self._windows()

        def graph(tapped: mx.array, state: list[mx.array]) -> list[mx.array]:
            ctx = self.context(tapped)
            out: list[mx.array] = []
            for i, (layer, window) in enumerate(zip(self.layers, windows)):
                store = _traced_context(state, i, window)
                k, v = layer.self_attn.context_kv(ctx, store.start + store.length)
                out += store.with_block(k, v)
            return out

        return graph

    def new_session(self, sampler: Any) -> BlockDraftSession:
        return BlockDraftSession(self, sampler)

    def new_batch(self) -> BlockDraftBatch:
        """The shared context of this draft's greedy sequences in a batch."""
        return BlockDraftBatch(self)


def _traced(draft: BlockDraft, key: tuple[Any, ...]) -> bool:
    """Whether graph ``key`` runs traced (see the module)."""
    return settings.current().compile and key not in draft._host_bound


def _traced_context(state: list[mx.array], i: int, window: int | None,
                    masks: dict[Any, mx.array] | None = None) -> TracedContext:
    """Store ``i`` of a traced graph's state (each store's keys, values, length, start)."""
    keys, values, length, start = state[4 * i:4 * i + 4]
    return TracedContext(keys, values, length, start, window, masks)


class BlockDraftSession(DraftSession):
    """Context keys/values per draft layer; proposals from one block forward per round."""

    draft: BlockDraft

    def __init__(self, draft: BlockDraft, sampler: Any) -> None:
        super().__init__(draft, sampler)
        self.stores = [ContextCache(layer.self_attn.window) for layer in draft.layers]
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
        if _traced(draft, ("append", rows)) and rows <= draft.block_size and self.context_length:
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
        ``rows`` rows at the context's end (``appending``: rows the context keeps, so rows
        out of every window's reach may go first). The stores let go of their buffers so
        that the graph may write them in place (:meth:`_take_state`)."""
        state: list[mx.array] = []
        for like, store in zip(self._empty_kv, self.stores):
            if appending:
                store.make_room(rows, like, like)
            else:
                store.reserve(rows, like, like)
            assert store.keys is not None and store.values is not None  # room made
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
        return self.draft.block_rows(mx.array([current], dtype=mx.int32), pos, n,
                                     self.stores)[0]

    def propose(self, current: int, pos: int, n: int) -> DraftProposal:
        self._check_block(pos, n)
        greedy = self.temperature <= 0
        anchor = mx.array([current], dtype=mx.int32)
        if _traced(self.draft, ("block", n, greedy)):
            rows = self.traced_rows(anchor, pos, n, greedy)
        else:
            hidden = self.draft.block_rows(anchor, pos, n, self.stores)
            rows = self.draft.greedy_tokens(hidden, anchor)[0] if greedy else hidden
        if greedy:
            return DraftProposal.point_mass(rows)
        return self.draft.sampled(self, rows, anchor)

    def traced_rows(self, anchor: mx.array, pos: int, n: int, greedy: bool) -> mx.array:
        """The block through its traced graph: the tokens ``[n]`` (greedy) or the hidden rows
        ``[1, n, hidden]``."""
        draft = self.draft
        graph = draft.traced(("block", n, greedy), lambda: draft._block_graph(n, greedy))
        state = self._graph_state(draft.block_size, appending=False)
        out = graph(anchor, mx.array(pos, dtype=mx.int32), state)
        self._take_state(out[1:])
        return out[0]


class BlockDraftBatch:
    """The contexts of many greedy sequences of one block draft, one row per batch row (the
    scheduler's rows): per draft layer keys and values ``[B, H, S, D]``, slot ``j`` of a row
    its position ``j`` (a sliding layer's window is applied by the mask, not by dropping
    rows), and each row's context length. Each round is one block forward over every row
    (:meth:`propose`) and each row's accepted tokens one commit over every row
    (:meth:`commit`), both through traced graphs keyed by the row count, the buffer's size
    and the drafted or committed length.

    Rows are the batch's: :meth:`add` takes a sequence's session after its prefill (the
    session's stores are handed over: it drafts through the batch from then on),
    :meth:`remove` frees a row, :meth:`compact` follows the batch's compaction. A free row
    has length 0; what a graph writes there is never read.
    """

    step = ContextCache.step

    def __init__(self, draft: BlockDraft) -> None:
        self.draft = draft
        self.windows = draft._windows()
        self.keys: list[mx.array | None] = [None] * len(self.windows)
        self.values: list[mx.array | None] = [None] * len(self.windows)
        self.lengths: list[int] = []

    @property
    def rows(self) -> int:
        return len(self.lengths)

    @property
    def size(self) -> int:
        """Slots per row (one of :func:`bucket_capacity`'s sizes for ``step``)."""
        first = self.keys[0]
        return 0 if first is None else first.shape[2]

    @property
    def state(self) -> list[mx.array]:
        return [a for a in (*self.keys, *self.values) if a is not None]

    # -- rows ------------------------------------------------------------------------------
    def set_rows(self, rows: int) -> None:
        """Room for ``rows`` rows (free rows appended)."""
        extra = rows - self.rows
        if extra <= 0:
            return
        self.lengths += [0] * extra
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            if k is not None and v is not None:
                self.keys[i], self.values[i] = grow_rows(k, rows), grow_rows(v, rows)

    def add(self, row: int, session: BlockDraftSession) -> None:
        """Take ``session``'s context into free ``row`` (grown to if needed)."""
        self.set_rows(row + 1)
        end = session.context_length
        self._reserve(end + self.draft.block_size)
        for i, store in enumerate(session.stores):
            k, v = self.keys[i], self.values[i]
            assert k is not None and v is not None  # reserved
            if store.length and store.keys is not None and store.values is not None:
                k[row:row + 1, :, store.start:store.end, :] = store.keys[..., :store.length, :]
                v[row:row + 1, :, store.start:store.end, :] = \
                    store.values[..., :store.length, :]
        self.lengths[row] = end
        session.stores = [ContextCache(window) for window in self.windows]

    def remove(self, row: int) -> None:
        self.lengths[row] = 0

    def compact(self, moved: dict[int, int], rows: int) -> None:
        """Follow the batch's compaction: row ``old`` to ``moved[old]`` of ``rows`` rows."""
        order = sorted(moved, key=moved.__getitem__)
        if [moved[r] for r in order] != list(range(len(order))):
            raise ValueError("a compaction moves its rows to the front, in order")
        take = mx.array(order, dtype=mx.int32)
        self.lengths = [self.lengths[r] for r in order] + [0] * (rows - len(order))
        for i, (k, v) in enumerate(zip(self.keys, self.values)):
            if k is not None and v is not None:
                self.keys[i] = mx.contiguous(grow_rows(k[take], rows))
                self.values[i] = mx.contiguous(grow_rows(v[take], rows))

    def _reserve(self, need: int) -> None:
        """Every row ``need`` slots at least."""
        if need <= self.size:
            return
        size = bucket_capacity(need, self.step)
        for i, layer in enumerate(self.draft.layers):
            attn = layer.self_attn
            shape = (self.rows, attn.n_kv_heads, size, attn.head_dim)
            fresh_k = mx.zeros(shape, self.draft.compute_dtype)
            fresh_v = mx.zeros(shape, self.draft.compute_dtype)
            k, v = self.keys[i], self.values[i]
            if k is not None and v is not None:
                fresh_k[:, :, :k.shape[2]] = k
                fresh_v[:, :, :v.shape[2]] = v
            self.keys[i], self.values[i] = fresh_k, fresh_v

    # -- rounds ----------------------------------------------------------------------------
    def commit(self, tapped: mx.array, counts: Sequence[int]) -> None:
        """Row ``b`` takes the first ``counts[b]`` of its tapped states ``tapped [B, M, ...]``
        (lazy: one traced graph for every row)."""
        if len(counts) != self.rows or tapped.shape[0] != self.rows:
            raise ValueError(f"a commit of {tapped.shape[0]} rows and {len(counts)} counts "
                             f"for a batch of {self.rows}")
        if not any(counts):
            return
        width = tapped.shape[1]
        self._reserve(max(self.lengths) + max(width, self.draft.block_size))
        key = ("rows-commit", self.rows, self.size, width)
        out = self._run(key, self._commit_graph, tapped)
        self._take(out)
        self.lengths = [n + c for n, c in zip(self.lengths, counts)]

    def propose(self, anchors: Sequence[int], n: int) -> mx.array:
        """Each row's ``n`` greedy drafts ``[B, n]`` (lazy) for the block anchored at its
        last token ``anchors[b]``, at its context's end."""
        size = self.draft.block_size
        if not 1 <= n <= size - 1:
            raise ValueError(f"a {size}-block drafts 1..{size - 1} tokens, asked for {n}")
        self._reserve(max(self.lengths) + size)
        key = ("rows-block", self.rows, self.size, n)
        out = self._run(key, lambda: self._block_graph(n),
                        mx.array(list(anchors), dtype=mx.int32))
        self._take(out[1:])
        return out[0]

    def _run(self, key: tuple[Any, ...], build: Callable[[], Callable[..., list[mx.array]]],
             first: mx.array) -> list[mx.array]:
        graph = self.draft.traced(key, build) if _traced(self.draft, key) else build()
        lengths = mx.array(self.lengths, dtype=mx.int32)
        state = [a for pair in zip(self.keys, self.values) for a in pair]
        # the graph may write the buffers in place: nothing else holds them meanwhile
        self.keys = [None] * len(self.windows)
        self.values = [None] * len(self.windows)
        return graph(first, lengths, state)

    def _take(self, buffers: Sequence[mx.array]) -> None:
        self.keys = list(buffers[0::2])
        self.values = list(buffers[1::2])

    def _commit_graph(self) -> Callable[..., list[mx.array]]:
        draft, windows = self.draft, self.windows

        def graph(tapped: mx.array, lengths: mx.array, state: list[mx.array]
                  ) -> list[mx.array]:
            ctx = draft.context(tapped)
            out: list[mx.array] = []
            for layer, store in zip(draft.layers, _row_stores(windows, lengths, state)):
                k, v = layer.self_attn.context_kv(ctx, lengths)
                out += store.with_block(k, v)
            return out

        return graph

    def _block_graph(self, n: int) -> Callable[..., list[mx.array]]:
        draft, windows = self.draft, self.windows

        def graph(anchors: mx.array, lengths: mx.array, state: list[mx.array]
                  ) -> list[mx.array]:
            stores = _row_stores(windows, lengths, state)
            tokens = draft.greedy_tokens(draft.block_rows(anchors, lengths, n, stores), anchors)
            return [tokens] + [a for store in stores for a in (store.keys, store.values)]

        return graph


def _row_stores(windows: list[int | None], lengths: mx.array, state: list[mx.array]
                ) -> list[RowContext]:
    """A batch graph's stores (each layer's keys, values in ``state``); the layers of one
    window share their mask."""
    masks: dict[Any, mx.array] = {}
    return [RowContext(state[2 * i], state[2 * i + 1], lengths, window, masks)
            for i, window in enumerate(windows)]
