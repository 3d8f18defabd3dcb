"""One compiled decode step for every architecture.

A forward of up to ``MAX_TRACED`` tokens through filled caches (a decode step, a
speculative verify block) is traced once with ``mx.compile`` and replayed: a step then
costs one call from Python instead of building hundreds of graph nodes, and MLX fuses
its elementwise chains. The model is not asked to help: it runs unchanged on stand-ins of
its caches (see ``mlxrunner.cache``: a traced offset, fixed-size buffers, masks that make
attention over a whole buffer exact), so an architecture written in plain ``mlx.nn``
gets the compiled step too.

Attention over the keys a stand-in handed out is made exact however the model calls it:
:func:`mlxrunner.nn.attend` asks the thread's trace frame for the mask, and while a thread
traces, ``mx.fast.scaled_dot_product_attention`` called from that thread goes the same way
(other threads reach MLX's function unchanged). Two models may trace on two threads at once.

Each traced forward is checked against the eager forward at its first call and at its
first replay (a Python value the trace baked in shows only then); any error while tracing,
or any disagreement, turns tracing off for that model with one warning naming the plugin,
the architecture and the first layer whose output differs
(:attr:`CompiledSteps.fallback` keeps it for :mod:`mlxrunner.testing`), and the eager
forward's result is used. ``MLXRUNNER_COMPILE=0`` (:mod:`mlxrunner.settings`) runs every
forward eagerly. A forward whose products run on the host BLAS
(:func:`mlxrunner.nn.kernels.host_products`), which a traced graph cannot call, runs eagerly
once its first trace met enough of them (:func:`mlxrunner.nn.kernels.host_bound`): a
decision, so no warning.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Hashable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from copy import copy
from typing import Any, cast

import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from .. import settings
from ..cache import RowFrame, TraceFrame, framing
from ..cache.frame import active_frame
from ..constants import compiling
from ..nn import attend
from ..nn.attention import mlx_attention
from ..nn.host_ops import hosting
from ..nn.kernels import (
    HOST_TRACE_MIN_WORK,
    host_bound,
    host_declined,
    host_weights_run,
    off_scalar_pool,
    on_cuda,
)

log = logging.getLogger("mlxrunner.decode")

#: forwards of up to this many tokens through filled caches are traced; longer ones (prompts)
#: run eagerly
MAX_TRACED = 16

Result = tuple[mx.array, mx.array | None]
#: where a model keeps its CompiledSteps (outside its parameter tree)
ATTRIBUTE = "_mlxrunner_steps"


def forward(model: Any, ids: mx.array, caches: Sequence[Any] | None,
            taps: Sequence[int] | None = None) -> Any:
    """``model(ids, caches)`` (``taps=taps``: ``(logits, tapped)``), through a traced forward
    where one applies (see the module); an eager one with the core's layers on the host
    where products run there (:mod:`mlxrunner.nn.host_ops`)."""
    with hosting():
        return _forward(model, ids, caches, taps)


def _forward(model: Any, ids: mx.array, caches: Sequence[Any] | None,
             taps: Sequence[int] | None) -> Any:
    taps = None if taps is None else tuple(int(t) for t in taps)
    if caches is not None and settings.current().compile:
        result = compiled_steps(model).forward(ids, caches, taps)
        if result is not None:
            return result[0] if taps is None else result
    if caches is not None and _batched(caches):
        # batched caches run only through their stand-ins (per-row masks): untraced here
        logits, tapped = compiled_steps(model).through_stand_ins(ids, caches, taps)
        return logits if taps is None else (logits, tapped)
    return eager_forward(model, ids, caches, taps)


def eager_forward(model: Any, ids: mx.array, caches: Sequence[Any] | None,
                  taps: Sequence[int] | None = None, embeddings: mx.array | None = None,
                  positions: mx.array | None = None) -> Any:
    """``model(ids, caches)`` (with ``taps``; with input ``embeddings`` and ``positions``:
    a prompt chunk holding media, :class:`mlxrunner.media.MediaPrompt`) untraced, the
    core's layers on the host where products run there; whether its host products rule out
    traces is noted for the model (:meth:`CompiledSteps.saw_eager_forward`)."""
    before = host_weights_run()
    kwargs: dict[str, Any] = {} if taps is None else {"taps": taps}
    if embeddings is not None:
        kwargs["embeddings"] = embeddings
    if positions is not None:
        kwargs["positions"] = positions
    with hosting():
        out = model(ids, caches, **kwargs)
    if caches is not None:
        compiled_steps(model).saw_eager_forward(host_weights_run() - before)
    return out


def _batched(caches: Sequence[Any]) -> bool:
    """Whether the caches hold several sequences of their own lengths (``row_offsets``:
    see mlxrunner.cache.batched)."""
    return any(getattr(c, "row_offsets", None) is not None for c in caches if c is not None)


def _start_of(cache: Any) -> Hashable:
    """Where a forward through the cache starts: its offset, or a batched cache's per-row
    offsets."""
    rows = getattr(cache, "row_offsets", None)
    return cache.offset if rows is None else rows


def compiled_steps(model: Any) -> CompiledSteps:
    """The model's traced forwards (made on first use, dropped when its weights change)."""
    steps = model.__dict__.get(ATTRIBUTE)
    if steps is None:
        # (before the steps are kept: a model's update drops its steps)
        _move_small_parameters(model)
        steps = CompiledSteps(model)
        object.__setattr__(model, ATTRIBUTE, steps)
    return steps


class _Traced:
    """One traced forward: the compiled function, what its caches recorded, how often it
    ran."""

    def __init__(self, function: Callable[..., list[mx.array]], compiled: bool = True) -> None:
        self.function = function
        #: compiled: its graph is evaluated after the call; else the model runs as called
        #: (host operations evaluate as they go)
        self.compiled = compiled
        self.calls = 0
        #: checked calls by thread: MLX keeps a compiled function's trace per thread, so each
        #: thread's first call and first replay are checked
        self.checks: dict[int, int] = {}
        self.records: list[object] | None = None
        self.counts: list[int] | None = None


def _move_small_parameters(model: Any) -> None:
    """The model's parameters of at most 8 bytes (a layer's scalar) moved out of MLX's
    managed scalar pool on CUDA (see :func:`mlxrunner.nn.kernels.off_scalar_pool`): the
    kernels of every step read them."""
    if not (on_cuda() and hasattr(model, "parameters") and hasattr(model, "update")):
        return
    flat = cast("list[tuple[str, mx.array]]", tree_flatten(model.parameters()))
    moved = [(name, off_scalar_pool(p)) for name, p in flat if p.nbytes <= 8]
    if moved:
        mx.eval([p for _, p in moved])
        model.update(tree_unflatten(moved))


class CompiledSteps:
    """A model's traced forwards, by length, taps and cache layout."""

    def __init__(self, model: Any) -> None:
        self.model = model
        self.enabled = True
        #: why tracing went off for this model (one line), or None
        self.fallback: str | None = None
        # one forward at a time through a model's traces (its caches' records are shared)
        self._lock = threading.RLock()
        self._traced: dict[Hashable, _Traced] = {}
        #: (input shape, settings) of forwards whose traces met host products: run eagerly
        self._host_bound: set[Hashable] = set()
        #: settings under which an eager forward ran enough host products that every
        #: forward would (host products apply by weight, not by row): none is traced
        self._host_bound_settings: set[Hashable] = set()
        #: forwards traced so far (each a compile of its own)
        self.traces_made = 0

    def clear(self) -> None:
        self._traced.clear()

    def saw_eager_forward(self, host_weights: int) -> None:
        """An eager forward of the model ran host products over ``host_weights`` weights
        (:func:`mlxrunner.nn.kernels.host_weights_run`): at ``HOST_TRACE_MIN_WORK`` or more,
        a trace would be declined for them, so none is tried (a trace costs the first step
        of a CPU run a fraction of a second)."""
        if host_weights >= HOST_TRACE_MIN_WORK:
            self._host_bound_settings.add(_switches())

    @property
    def shapes(self) -> int:
        """How many traced forwards are held (one per input shape, taps and cache layout)."""
        return len(self._traced)

    def replays(self) -> int:
        """How many calls replayed a trace (the first call of each traces it)."""
        return sum(max(0, t.calls - 1) for t in self._traced.values())

    # -- the entry point ------------------------------------------------------------------
    def forward(self, ids: mx.array, caches: Sequence[Any], taps: tuple[int, ...] | None
                ) -> Result | None:
        """The traced forward's ``(logits, tapped)``, or None where none applies (the
        caller runs the model eagerly)."""
        if not self.enabled:
            return None
        with self._lock:
            return self._forward(ids, caches, taps)

    def _forward(self, ids: mx.array, caches: Sequence[Any], taps: tuple[int, ...] | None
                 ) -> Result | None:
        key = self._key(ids, caches, taps)
        switches = _switches()
        if key is None or (ids.shape, switches) in self._host_bound \
                or switches in self._host_bound_settings:
            return None
        traced = self._traced.get(key)
        if traced is None:
            traced = self._traced[key] = _Traced(mx.compile(self._graph(ids.shape[1], taps)))
            self.traces_made += 1
        thread = threading.get_ident()
        checking = traced.checks.get(thread, 0) < 2
        live = [(i, c) for i, c in enumerate(caches) if c is not None]
        shadows = [_detached(c) for _, c in live] if checking else None
        # the caches as they were, for finding the layer that differs (lazy copies: computed
        # only if a check fails)
        pristine = [_detached(c) for _, c in live] if checking else None
        declined = host_declined()
        try:
            logits, tapped = self._run(traced, ids, caches, taps)
        except Exception as exc:
            self._disable(key, f"traced forward unavailable ({type(exc).__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else '?'})")
            return None
        traced.calls += 1
        if checking:
            traced.checks[thread] = traced.checks.get(thread, 0) + 1
        if host_bound(declined):  # (this result is right)
            self._host_bound.add((ids.shape, switches))
            del self._traced[key]
        if shadows is not None:
            eager = self._eager(ids, caches, live, shadows, taps)
            if not agree(logits, eager[0]):
                assert pristine is not None
                where = self._first_differing_layer(ids, caches, live, pristine)
                self._disable(key, f"traced forward disagrees with the eager forward{where}")
                for (_, c), shadow in zip(live, shadows):
                    c.__dict__.update(shadow.__dict__)
                return eager
        return logits, tapped

    def _run(self, traced: _Traced, ids: mx.array, caches: Sequence[Any],
             taps: tuple[int, ...] | None) -> Result:
        """Run ``traced.function`` (compiled or not) on the caches' arrays and let each
        cache adopt what its stand-in wrote. On an error it propagates, a compiled
        function's caches having taken their arrays back; an uncompiled one's caches are
        left without them (their arrays were handed on: see below)."""
        live = [c for c in caches if c is not None]
        inputs = [c.trace_inputs(ids.shape[1]) for c in live]
        counts = [len(a) for a in inputs]
        flat = [a for arrays in inputs for a in arrays]
        # An uncompiled forward evaluates as it goes (host operations): the arrays a cache
        # hands on must have no holder but the forward, or each write into them copies the
        # whole buffer (a batch's caches held twice at every step); a compiled function's
        # graph is evaluated once this returns, when nothing here holds them any more.
        held = inputs if traced.compiled else None
        del inputs
        offset = mx.array(live[0].offset, dtype=mx.int32)
        try:
            with _tracing(caches, counts, traced), _attention_routed(), \
                    (compiling() if traced.compiled else nullcontext()):
                out = traced.function(ids, offset, flat)
        except Exception:
            for c, arrays in zip(live, held or ()):
                c.give_back(arrays)
            raise
        assert traced.records is not None and traced.counts is not None  # set while tracing
        logits, tapped, rest = out[0], (out[1] if taps is not None else None), \
            out[1 + (taps is not None):]
        at = 0
        for c, record, count in zip(live, traced.records, traced.counts):
            c.adopt(rest[at:at + count], ids.shape[1], record)
            at += count
        return logits, tapped

    def through_stand_ins(self, ids: mx.array, caches: Sequence[Any],
                          taps: tuple[int, ...] | None) -> Result:
        """The forward on the caches' stand-ins, untraced: what a batched cache runs when
        no trace applies (see mlxrunner.cache.batched)."""
        return self._run(_Traced(self._graph(ids.shape[1], taps), compiled=False), ids, caches,
                         taps)

    def _eager(self, ids: mx.array, caches: Sequence[Any], live: list[tuple[int, Any]],
               shadows: list[Any], taps: tuple[int, ...] | None) -> Result:
        stand = list(caches)
        for (i, _), shadow in zip(live, shadows):
            stand[i] = shadow
        if _batched(stand):
            return self.through_stand_ins(ids, stand, taps)
        out = self.model(ids, stand) if taps is None else self.model(ids, stand, taps=taps)
        return (out, None) if taps is None else out

    def _first_differing_layer(self, ids: mx.array, caches: Sequence[Any],
                               live: list[tuple[int, Any]], pristine: list[Any]) -> str:
        """Where the traced forward first parts from the eager one, from every layer's
        output (taps) of both run on copies of the caches as they were, the trace's graph
        uncompiled; "" where the model offers no taps or the caches are batched."""
        n = getattr(self.model, "num_layers", None)
        if not getattr(self.model, "supports_taps", True) or not isinstance(n, int) or n < 1 \
                or _batched(caches):
            return ""
        every = tuple(range(n))
        eager, traced = list(caches), list(caches)
        for (i, _), cache in zip(live, pristine):
            eager[i], traced[i] = _detached(cache), _detached(cache)
        try:
            _, want = self.model(ids, eager, taps=every)
            _, got = self.through_stand_ins(ids, traced, every)
        except Exception as exc:  # a diagnosis only: the fallback stands without it
            log.debug("no per-layer comparison: %s", exc)
            return ""
        if got is None or got.shape != want.shape:
            return ""
        width = want.shape[-1] // n

        def part(x: mx.array, layer: int) -> mx.array:
            return x[..., layer * width:(layer + 1) * width]

        for layer in range(n):
            if not agree(part(got, layer), part(want, layer)):
                # how far apart, and the layer before: a drop from agreement to far apart
                # at one layer reads as that layer broken, a slide as rounding amplified
                gaps = ", ".join(f"layer {i} {_gap(part(got, i), part(want, i))}"
                                 for i in range(max(0, layer - 1), layer + 1))
                return f"; layer {layer} is the first whose output differs ({gaps})"
        return ("; every layer agrees when the trace runs uncompiled (a Python value fixed "
                "at its first call?)")

    def _disable(self, key: Hashable, why: str) -> None:
        self.enabled = False
        self._traced.clear()
        self.fallback = f"{describe(self.model)}: {why}"
        log.warning("%s; running eagerly", self.fallback)

    # -- what a trace depends on ----------------------------------------------------------
    def _key(self, ids: mx.array, caches: Sequence[Any], taps: tuple[int, ...] | None
             ) -> Hashable | None:
        if ids.ndim != 2 or not 0 < ids.shape[1] <= MAX_TRACED:
            return None
        length = ids.shape[1]
        offsets = set()
        parts: list[Hashable] = []
        for c in caches:
            if c is None:
                parts.append(None)
                continue
            part = c.trace_key(length)
            if part is None:
                return None
            offsets.add(_start_of(c))
            parts.append((type(c), part))
        if len(offsets) != 1:
            return None
        return (ids.shape, str(ids.dtype), taps, tuple(parts), _switches())

    # -- the traced function --------------------------------------------------------------
    def _graph(self, length: int, taps: tuple[int, ...] | None
               ) -> Callable[[mx.array, mx.array, list[mx.array]], list[mx.array]]:
        model = self.model

        def graph(ids: mx.array, offset: mx.array, arrays: list[mx.array]) -> list[mx.array]:
            caches, traced = _current.caches, _current.traced
            # read by a kernel of every layer: out of MLX's managed scalar pool once a step
            offset = off_scalar_pool(offset)
            frame = (RowFrame if _batched(caches) else TraceFrame)(offset, length)
            stand: list[Any] = []
            at = 0
            counts = iter(_current.in_counts)
            for c in caches:
                if c is None:
                    stand.append(None)
                    continue
                n = next(counts)
                stand.append(c.stand_in(frame, arrays[at:at + n]))
                at += n
            arrays.clear()  # the stand-ins hold them now (see CompiledSteps._run)
            with framing(frame):
                out = model(ids, stand) if taps is None else model(ids, stand, taps=taps)
            logits, tapped = (out, None) if taps is None else out
            live = [s for s in stand if s is not None]
            outputs = [s.trace_outputs() for s in live]
            traced.records = [s.trace_record() for s in live]
            traced.counts = [len(o) for o in outputs]
            head = [logits] if taps is None else [logits, tapped]
            return head + [a for o in outputs for a in o]

        return graph


def _switches() -> Hashable:
    """The settings a trace depends on."""
    s = settings.current()
    return (s.kernels, s.attention, s.row_products, s.host_products, s.packed_kernels)


# what the traced function reads when MLX traces it (its first call; replays run no
# Python): the calling thread's own
_current = threading.local()


def describe(model: Any) -> str:
    """The model's class with the plugin and architecture name it was registered under."""
    from ..host import manager

    name = type(model).__name__
    try:
        for reg in manager.iter_registrations("architectures"):
            if reg.obj is type(model):
                plugin = manager.host().distribution_of(reg.plugin)
                return f"{name} (plugin {plugin}, architecture {reg.name})"
    except Exception as exc:  # naming the plugin must not hide the message itself
        log.debug("no plugin found for %s: %s", name, exc)
    return f"{name} (registered by no plugin)"


def _detached(cache: Any) -> Any:
    """A copy of a cache whose arrays are objects of their own: an eager forward through it
    (which may write its buffers in place) leaves the original as it is."""
    twin = copy(cache)
    for name, value in vars(twin).items():
        if isinstance(value, mx.array):
            setattr(twin, name, mx.array(value))
    return twin


@contextmanager
def _tracing(caches: Sequence[Any], in_counts: list[int], traced: _Traced) -> Iterator[None]:
    _current.caches, _current.in_counts, _current.traced = caches, in_counts, traced
    try:
        yield
    finally:
        del _current.caches, _current.in_counts, _current.traced


def _routed_attention(q: mx.array, k: mx.array, v: mx.array, *, scale: float,
                      mask: Any = None, **kwargs: Any) -> mx.array:
    """``mx.fast.scaled_dot_product_attention`` while some thread traces: the calling thread's
    trace frame fixes the mask (through :func:`mlxrunner.nn.attend`); without one, MLX's
    function as called."""
    frame = active_frame()
    if frame is None:
        return mlx_attention(q, k, v, scale=scale, mask=mask, **kwargs)
    if kwargs:  # (attention sinks and the like: MLX's function, the mask fixed)
        return mlx_attention(q, k, v, scale=scale, mask=frame.mask_for(k, mask), **kwargs)
    return attend(q, k, v, scale=scale, mask=mask)


_routing = threading.Lock()
_routing_users = 0


@contextmanager
def _attention_routed() -> Iterator[None]:
    """MLX's attention routed through :func:`_routed_attention` while any thread traces
    (models that call MLX's function directly reach it only through ``mx.fast``)."""
    global _routing_users
    with _routing:
        if _routing_users == 0:
            mx.fast.scaled_dot_product_attention = _routed_attention
        _routing_users += 1
    try:
        yield
    finally:
        with _routing:
            _routing_users -= 1
            if _routing_users == 0:
                mx.fast.scaled_dot_product_attention = mlx_attention


def agree(got: mx.array, want: mx.array) -> bool:
    """Logits of the traced and the eager forward agree up to their rounding (loose: this
    catches broken traces). In float32 to a few ulps; in half precision the two round
    differently and random weights amplify that, so there the check compares directions."""
    if got.shape != want.shape:
        return False
    if want.dtype == mx.float32:
        return _relative_gap(got, want) <= 1e-3
    return _least_cosine(got, want) >= 0.95


def _relative_gap(got: mx.array, want: mx.array) -> float:
    """The largest difference, over 1 + the largest magnitude of ``want`` (float32)."""
    want32 = want.astype(mx.float32)
    scale = 1.0 + float(mx.abs(want32).max())
    return float(mx.abs(got.astype(mx.float32) - want32).max()) / scale


def _least_cosine(got: mx.array, want: mx.array) -> float:
    """The least cosine between a row of ``got`` and its row of ``want``, each centred."""
    g = got.astype(mx.float32).reshape(-1, got.shape[-1])
    w = want.astype(mx.float32).reshape(-1, want.shape[-1])
    g = g - g.mean(axis=-1, keepdims=True)
    w = w - w.mean(axis=-1, keepdims=True)
    cosine = (g * w).sum(-1) / mx.sqrt((g * g).sum(-1) * (w * w).sum(-1) + 1e-12)
    return float(cosine.min())


def _gap(got: mx.array, want: mx.array) -> str:
    """How far ``got`` lies from ``want`` by :func:`agree`'s own measure, in words."""
    if want.dtype == mx.float32:
        return f"relative difference {_relative_gap(got, want):.2e}"
    return f"cosine {_least_cosine(got, want):.3f}"
