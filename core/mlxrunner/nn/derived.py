"""Arrays derived from a module's parameters once (a packed matrix, a transposed view, a
weight plus one), held beside the module and rebuilt when the parameters change.

Derived arrays are evaluated when made: a traced forward then holds them as constants
instead of replaying their operations on every call. Making one inside a decode trace is
fine (it depends on parameters only, which that trace holds as constants). Where the
parameters themselves are traced (a compiled training step, a gradient), what they make
cannot be evaluated or held: it is returned as the operations, so gradients flow.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Sequence
from typing import Any

import mlx.core as mx
import mlx.nn as nn

_HELD = "_mlxrunner_derived"


def derived(module: nn.Module, name: str, sources: Sequence[mx.array],
            make: Callable[..., Any]) -> Any:
    """``make(*sources)``, evaluated and held on ``module`` under ``name`` until one of
    ``sources`` is another array object (new weights were loaded)."""
    held: dict[str, tuple[tuple[mx.array, ...], Any]] | None = module.__dict__.get(_HELD)
    if held is None:
        held = module.__dict__[_HELD] = {}
    entry = held.get(name)
    # (asked by every layer of every forward: map over is_, not a generator)
    if entry is not None and len(entry[0]) == len(sources) and all(
            map(operator.is_, entry[0], sources)):
        return entry[1]
    value = make(*sources)
    try:
        mx.eval(value)
    except ValueError:  # the sources are traced (see the module): not held
        return value
    held[name] = (tuple(sources), value)
    return value
