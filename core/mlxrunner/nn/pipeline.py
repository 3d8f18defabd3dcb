"""A prompt's graph handed to the GPU while Python still builds the rest of it.

An eager forward builds its whole graph and only then evaluates it: on a GPU the device waits
through the build (a Gemma 4 E2B prompt of 511 tokens on an H100: 9.1 ms of build before
9.3 ms of evaluation, ``bench/gemma4_prefill.py``). Inside :func:`pipelined` (the core's own
eager forward of a prompt, :func:`mlxrunner.decode.step.eager_forward`), every
``PIPELINE_EVERY``-th attention of the forward (:func:`mlxrunner.nn.attend`, which every layer
built from ``mlxrunner.nn`` calls) submits what was built so far with ``mx.async_eval``: the
GPU runs the first layers while the later ones are built. The result is the same arrays
either way. Not on MLX's CPU device (there the build is a small share of a prompt's time and
the submissions made this machine's build wait), not in a traced forward (a trace is built
once), and not below ``MIN_TOKENS`` tokens. ``MLXRUNNER_PIPELINE`` (:mod:`mlxrunner.settings`):
``0`` turns it off, ``1`` on for every device.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import mlx.core as mx

from .. import settings
from .host_ops import host_active

#: attentions of a forward per submission (each submission commits MLX's work so far: a
#: few of them a forward, not one a layer)
PIPELINE_EVERY = 4
#: the fewest tokens a pipelined forward takes (a decode step or verify block is traced)
MIN_TOKENS = 64

_state = threading.local()


@contextmanager
def pipelined(tokens: int) -> Iterator[None]:
    """This thread's forward of ``tokens`` tokens inside: submitted as it is built (see the
    module) where that applies."""
    held = getattr(_state, "seen", None)
    mode = settings.current().pipeline
    on = tokens >= MIN_TOKENS and not host_active() \
        and (mode == "1" or (mode == "auto" and mx.default_device() == mx.gpu))
    _state.seen = 0 if on else None
    try:
        yield
    finally:
        _state.seen = held


def submit_built(*arrays: mx.array) -> None:
    """At an attention of a pipelined forward: every ``PIPELINE_EVERY``-th call submits
    ``arrays`` (the layer's queries, keys and values: every layer before it) for
    evaluation; elsewhere nothing."""
    seen = getattr(_state, "seen", None)
    if seen is None:
        return
    _state.seen = seen + 1
    if (seen + 1) % PIPELINE_EVERY == 0:
        mx.async_eval(*arrays)
