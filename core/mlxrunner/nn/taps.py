"""The residual stream after chosen layers: what a forward with ``taps`` returns beside its
logits (the Model contract), collected in one place for every architecture."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import mlx.core as mx

from .. import settings
from ..constants import in_compiled
from .cuda_products import current


class _State(threading.local):
    rows = "all"  # (class defaults: a missing thread-local attribute raises and catches inside)


_state = _State()


@contextmanager
def last_logits_only() -> Iterator[None]:
    """In this thread, forwards give the logits of their last position alone (see
    :func:`head_rows`): what the core's prefill asks for, which reads no other row's."""
    with _rows_wanted("last"):
        yield


@contextmanager
def caches_only() -> Iterator[None]:
    """In this thread, forwards fill their caches and no one reads their logits (a prompt's
    chunk before its last): :func:`head_rows` gives no row, and an architecture may skip
    whatever writes no cache (the layers after its last cache write)."""
    with _rows_wanted("none"):
        yield


#: on a GPU, a prompt chunk's stream is submitted every this many layers (unless
#: ``prompt_submit_layers`` says otherwise; the fastest k in bench/prompt_submit.py); on the
#: CPU the evaluation would take the build's cores, and the chunk is submitted whole
GPU_SUBMIT_LAYERS = 2
#: a stream of fewer rows is never submitted: a fused launch of a few rows may still be
#: joined by the next product's launch, which stands for it (``current``), and submitted it
#: would run as well; and the rows after an architecture's cut to the last are little work
SUBMIT_MIN_ROWS = 64


@contextmanager
def _rows_wanted(rows: str) -> Iterator[None]:
    held = _state.rows
    _state.rows = rows
    try:
        yield
    finally:
        _state.rows = held


def _submit_stream(layer: int, layers: int, hidden: mx.array) -> None:
    """Inside a prefill's forward (:func:`last_logits_only`, :func:`caches_only`), every
    ``prompt_submit_layers`` layers (``mlxrunner.settings``): hand the stream after
    ``layer`` to the device, which runs the layers so far while the rest are built. Never
    the last layer's: a chunk before a prompt's last reads none of its stream (submitted,
    its MLP would run for nothing), and the last chunk is evaluated next anyway."""
    if _state.rows == "all" or layer >= layers - 1:
        return
    every = settings.current().prompt_submit_layers
    if every is None:
        every = GPU_SUBMIT_LAYERS if mx.default_device() == mx.gpu else 0
    if every and (layer + 1) % every == 0 and hidden.ndim > 1 \
            and hidden.size >= SUBMIT_MIN_ROWS * hidden.shape[-1] and not in_compiled():
        mx.async_eval(hidden)


def head_rows(hidden: mx.array) -> mx.array:
    """The rows of the final hidden states ``[B, L, D]`` the output head should read: all of
    them, the last (``[B, 1, D]``) inside :func:`last_logits_only`, none (``[B, 0, D]``)
    inside :func:`caches_only`. An architecture that passes its stream through this before
    its final norm and head spares a prompt's chunk the widest product of its forward for
    every row it does not read (optional: without it the core takes the last row of the
    whole logits)."""
    rows = _state.rows
    if rows == "all":
        return hidden
    return hidden[:, -1:] if rows == "last" else hidden[:, :0]


class Taps:
    """``taps = Taps(requested, num_layers)``, then ``h = taps.after(i, h)`` after layer
    ``i`` and ``return taps.result(logits)``: the logits alone (``requested`` None), else
    ``(logits, tapped)`` with ``tapped [B, L, len(requested) * hidden]`` in request order.
    A layer outside the model or named twice is a ValueError."""

    def __init__(self, requested: Sequence[int] | None, num_layers: int) -> None:
        self.requested = None if requested is None else tuple(int(t) for t in requested)
        if self.requested:
            bad = [t for t in self.requested if not 0 <= t < num_layers]
            if bad:
                raise ValueError(f"tap layers {bad} out of range 0..{num_layers - 1}")
            if len(set(self.requested)) != len(self.requested):
                raise ValueError(f"tap layers {list(self.requested)} name a layer twice")
        self._states: dict[int, mx.array] = {}
        self._wanted = frozenset(self.requested or ())
        self._layers = num_layers

    def after(self, layer: int, hidden: mx.array) -> mx.array:
        """Record ``hidden`` as the stream after ``layer`` if it is tapped; returns it."""
        # (a stream tapped earlier may since be the output of a launch that also normed it:
        # asked now, while the core still remembers, not at the end of the forward)
        for tapped, state in self._states.items():
            self._states[tapped] = current(state)
        if layer in self._wanted:
            self._states[layer] = hidden
        _submit_stream(layer, self._layers, hidden)
        return hidden

    def result(self, logits: mx.array) -> mx.array | tuple[mx.array, mx.array]:
        if self.requested is None:
            return logits
        if not self.requested:
            return logits, mx.zeros((*logits.shape[:-1], 0), dtype=logits.dtype)
        # (the last layer's stream: the final norm's launch may have written it again)
        return logits, mx.concatenate([current(self._states[t]) for t in self.requested],
                                      axis=-1)
