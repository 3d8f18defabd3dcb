"""Pipeline parallelism: each rank holds a range of the layers.

Every rank runs the whole model's forward, as one process would, with the same inputs: the
embedding, the final norm and the head are on every rank (replicated), and so are whatever
the architecture computes outside its layers. A layer another rank holds is a stand-in
that passes the hidden state on untouched (its cache only counts tokens, so offsets stay
right); the first layer of a rank's range takes the hidden state from the rank before
(``recv``), the last sends it to the next (``send``); after the model's last layer every
rank takes the last rank's hidden state (``all_gather``), so logits, and the tokens chosen
from them, are the same on every rank and the same bits as one process's. Taps are
gathered the same way, each from the rank that holds the layer.

The architecture needs nothing for this beyond ``model.layers`` (the list its forward runs
through, each layer called with its hidden state first and its cache second). Optional:
``layer_kv_sources`` (for each layer, the layer whose keys and values it attends over) keeps
layers that share keys and values on one rank, and a layer class's static
``pipeline_passthrough(x, cache, *args)`` says what a stand-in returns when the layer
returns more than its hidden state.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..cache import Cache
from ..model.interface import Model
from .group import DistributedError


class CountingCache(Cache):
    """The cache of a layer another rank holds: it keeps no state, only the offset (which
    architectures read from any of their caches)."""

    def advance(self, length: int) -> None:
        self.offset += length

    def restore(self, offset: int) -> None:
        self._check_restorable(offset)
        self.offset = offset


def stage_cuts(num_layers: int, size: int, kv_sources: Sequence[int] | None = None
               ) -> list[int]:
    """``size + 1`` layer indices: rank ``r`` holds layers ``cuts[r]:cuts[r + 1]``. As even as
    the layer count allows, never between a layer and the layer whose keys and values it
    reads."""
    if size > num_layers:
        raise DistributedError(f"{num_layers} layers cannot be split over {size} ranks")
    sources = list(kv_sources) if kv_sources is not None else list(range(num_layers))

    def allowed(c: int) -> bool:
        return all(sources[j] >= c for j in range(c, num_layers))

    points = [c for c in range(1, num_layers) if allowed(c)]
    if len(points) < size - 1:
        raise DistributedError(f"the model's {num_layers} layers cannot be split over "
                               f"{size} ranks without parting layers that share keys "
                               "and values")
    ideal = [round(k * num_layers / size) for k in range(1, size)]
    # the cuts nearest the even ones in all (the smallest on a tie), over the allowed points:
    # best[j] is the cheapest (distance, cuts) whose latest cut is points[j]
    best: list[tuple[int, tuple[int, ...]] | None] = [(0, ())] if size == 1 else \
        [(abs(p - ideal[0]), (p,)) for p in points]
    for k in range(1, size - 1):
        best = [_cheapest_ending_at([b for b in best[:j] if b is not None], p, ideal[k])
                for j, p in enumerate(points)]
    chosen = min(b for b in best if b is not None)
    return [0, *chosen[1], num_layers]


def _cheapest_ending_at(before: list[tuple[int, tuple[int, ...]]], point: int,
                        ideal: int) -> tuple[int, tuple[int, ...]] | None:
    """The cheapest of ``before`` followed by a cut at ``point`` (None: nothing before)."""
    if not before:
        return None
    cost, cuts = min(before)
    return cost + abs(point - ideal), (*cuts, point)


class Elsewhere(nn.Module):
    """Stands for a layer another rank holds (no parameters): passes the hidden state on.
    It keeps the layer's plain attributes (``is_linear``, ...), which ``make_cache`` and
    the like read."""

    def __init__(self, layer: nn.Module, passthrough: Callable[..., Any] | None,
                 finish: Callable[..., Any] | None) -> None:
        super().__init__()
        for key, value in vars(layer).items():
            if not key.startswith("_") and not isinstance(value, (mx.array, nn.Module)):
                object.__setattr__(self, key, value)
        self._passthrough = passthrough
        self._finish = finish

    def __call__(self, x: mx.array, cache: Any = None, *args: Any, **kwargs: Any) -> Any:
        if isinstance(cache, CountingCache):
            cache.advance(x.shape[1])
        out = (self._passthrough(x, cache, *args, **kwargs)
               if self._passthrough is not None else x)
        return out if self._finish is None else _with_hidden(out, self._finish)


def _with_hidden(out: Any, change: Callable[[mx.array], mx.array]) -> Any:
    """A layer's output with its hidden state (the output, or its first element) changed."""
    if isinstance(out, tuple):
        return (change(out[0]), *out[1:])
    return change(out)


def _staged(layer: nn.Module, receive: Callable[[mx.array], mx.array] | None,
            finish: Callable[[mx.array], mx.array] | None) -> None:
    """Make this one layer object take its input from ``receive`` and pass its output through
    ``finish`` (its class becomes a subclass; its parameters and names are unchanged)."""
    base = type(layer)

    def __call__(self: nn.Module, x: mx.array, *args: Any, **kwargs: Any) -> Any:
        if receive is not None:
            x = receive(x)
        out = base.__call__(self, x, *args, **kwargs)
        return out if finish is None else _with_hidden(out, finish)

    layer.__class__ = type(f"Staged{base.__name__}", (base,), {"__call__": __call__})


def apply_pipeline(model: Model, group: Any) -> tuple[str, ...]:
    """Turn ``model`` into this rank's stage: layers of other ranks become stand-ins, the
    stage's ends exchange hidden states, its forward gathers taps and the final hidden state.
    Returns the paths (``model.layers.7.``) of the layers it no longer holds: the
    checkpoint's tensors under them are not read."""
    rank, size = group.rank(), group.size()
    layers: list[nn.Module] = getattr(model, "layers")  # noqa: B009 (not on Model)
    n = len(layers)
    cuts = stage_cuts(n, size, model.layer_kv_sources)
    first, stop = cuts[rank], cuts[rank + 1]
    owner = [r for r in range(size) for _ in range(cuts[r], cuts[r + 1])]
    paths = {id(module): path for path, module in model.named_modules()}
    dropped: list[str] = []

    # Each hand-over (and gather) is evaluated where it is built, so that every rank meets
    # its sends, receives and gathers in one order: left lazy, a rank whose forward evaluates
    # partway (a product on the host BLAS) waited in its receive while the rank before
    # waited in the gather.
    def receive(x: mx.array) -> mx.array:
        received = mx.distributed.recv_like(x, rank - 1, group=group)
        mx.eval(received)
        return received

    def send(x: mx.array) -> mx.array:
        sent = mx.distributed.send(x, rank + 1, group=group)
        mx.eval(sent)
        return sent

    def gather_last(x: mx.array) -> mx.array:
        batch = x.shape[0]
        last = mx.distributed.all_gather(x, group=group)[(size - 1) * batch:size * batch]
        mx.eval(last)
        return last

    for i in range(n):
        last_layer = i == n - 1
        if first <= i < stop:
            finish = gather_last if last_layer else (send if i == stop - 1 and rank < size - 1
                                                     else None)
            _staged(layers[i], receive if i == first and rank > 0 else None, finish)
        else:
            passthrough = getattr(type(layers[i]), "pipeline_passthrough", None)
            dropped.append(paths[id(layers[i])] + ".")
            layers[i] = Elsewhere(layers[i], passthrough, gather_last if last_layer else None)
    mx.clear_cache()

    base = type(model)

    def __call__(self: Model, ids: mx.array, cache: Sequence[Cache | None] | None = None, *,
                 taps: Sequence[int] | None = None) -> Any:
        out = base.__call__(self, ids, cache, taps=taps)
        if not taps:
            return out
        logits, tapped = out
        batch, width = tapped.shape[0], tapped.shape[-1] // len(taps)
        everyone = mx.distributed.all_gather(tapped, group=group)
        mx.eval(everyone)
        pieces = [everyone[owner[t] * batch:(owner[t] + 1) * batch, :, j * width:(j + 1) * width]
                  for j, t in enumerate(taps)]
        return logits, mx.concatenate(pieces, axis=-1)

    def make_cache(self: Model) -> list[Any]:
        caches = base.make_cache(self)
        return [CountingCache() if c is not None and not first <= i < stop else c
                for i, c in enumerate(caches)]

    model.__class__ = type(base.__name__, (base,), {
        "__call__": __call__, "make_cache": make_cache,
        "pipeline_stage": (first, stop), "__module__": base.__module__})
    return tuple(dropped)
