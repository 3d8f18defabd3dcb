"""Block drafts (DFlash, DFlash2): a draft whose round is one block forward over the context
keys and values of every committed token, run by the core.

A subclass of :class:`BlockDraft` is the draft's math: its ``layers`` (each with a
``self_attn`` holding ``window`` (None for full attention), ``n_kv_heads``, ``head_dim`` and
``context_kv(rows, position)``, the keys and values of context rows at absolute positions),
``context(tapped)`` (the target's tapped states to context rows), ``block_rows(anchor, pos,
n, stores)`` (the final-normed hidden states of block rows 1..n, attending through
``stores``), ``greedy_tokens(hidden, anchor)`` (temperature 0: the proposed tokens, pure
array code), ``sampled(session, hidden, anchor)`` (temperature > 0: a
:class:`DraftProposal` drawn with ``session.draw``) and ``compute_dtype``.

The core keeps one :class:`~mlxrunner.cache.context.ContextCache` per layer and runs each
round's block and each commit through a traced graph (one ``mx.compile`` graph per drafted
length or committed row count, shared by the draft's sessions: a new generation replays
them), the stores standing in as :class:`~mlxrunner.cache.context.TracedContext` over
fixed-size buffers; with ``MLXRUNNER_COMPILE=0`` both run eagerly, and so does a graph whose
trace met enough products that run on the host BLAS (:func:`mlxrunner.nn.host_products`).
Either way they compute the same thing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx

from .. import settings
from ..cache.context import ContextCache, TracedContext
from ..nn import host_bound, host_declined
from .draft import DraftModel, DraftProposal, DraftSession


class BlockDraft(DraftModel):
    """Base class of block drafts: the round's machinery (see the module)."""

    def __init__(self, config: dict[str, Any], target: Any) -> None:
        super().__init__(config, target)
        self._graphs: dict[tuple[Any, ...], Callable[..., Any]] = {}
        #: keys of graphs whose traces met products on the host BLAS: run eagerly
        self._host_bound: set[tuple[Any, ...]] = set()

    # -- the subclass's math ----------------------------------------------------------------
    @property
    def compute_dtype(self) -> mx.Dtype:
        raise NotImplementedError

    def context(self, tapped: mx.array) -> mx.array:
        raise NotImplementedError

    def block_rows(self, anchor: mx.array, pos: int | mx.array, n: int,
                   stores: Sequence[ContextCache | TracedContext]) -> mx.array:
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
            compiled = mx.compile(build())

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
            rows = self.greedy_tokens(hidden, anchor) if greedy else hidden
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
        return self.draft.block_rows(mx.array([current], dtype=mx.int32), pos, n, self.stores)

    def propose(self, current: int, pos: int, n: int) -> DraftProposal:
        self._check_block(pos, n)
        greedy = self.temperature <= 0
        anchor = mx.array([current], dtype=mx.int32)
        if _traced(self.draft, ("block", n, greedy)):
            rows = self.traced_rows(anchor, pos, n, greedy)
        else:
            hidden = self.draft.block_rows(anchor, pos, n, self.stores)
            rows = self.draft.greedy_tokens(hidden, anchor) if greedy else hidden
        if greedy:
            return DraftProposal.point_mass(rows)
        return self.draft.sampled(self, rows, anchor)

    def traced_rows(self, anchor: mx.array, pos: int, n: int, greedy: bool) -> mx.array:
        """The block through its traced graph: the tokens (greedy) or the hidden rows."""
        draft = self.draft
        graph = draft.traced(("block", n, greedy), lambda: draft._block_graph(n, greedy))
        state = self._graph_state(draft.block_size, appending=False)
        out = graph(anchor, mx.array(pos, dtype=mx.int32), state)
        self._take_state(out[1:])
        return out[0]
