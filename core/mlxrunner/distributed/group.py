"""The process group: MLX's own distributed engine (``mx.distributed``), nothing of ours.

A job is launched by ``mlx.launch`` (or anything that sets the same environment): each
process gets ``MLX_RANK`` and, for the ring backend, ``MLX_HOSTFILE`` (a JSON list, one
entry per rank, of ``"ip:port"`` addresses). :func:`world` joins that group.
"""

from __future__ import annotations

import os
from typing import Any

import mlx.core as mx

from ..errors import MLXRunnerError

MODES = ("tensor", "pipeline")


class DistributedError(MLXRunnerError):
    """The group cannot be joined, the model cannot be split this way, or a rank is gone."""


def launched() -> bool:
    """Whether this process was started as one rank of a job (``MLX_RANK`` is set)."""
    return "MLX_RANK" in os.environ


_joined: dict[str, Any] = {}


def world(backend: str = "ring") -> Any:
    """The group of every process of this job (one rank of its own when not launched as a
    job), joined once per process. Joining waits for the other ranks, as MLX does."""
    if backend in _joined:
        return _joined[backend]
    if not launched():
        group = mx.distributed.init(strict=False, backend=backend)
    elif not mx.distributed.is_available():
        raise DistributedError("this MLX build has no distributed backend")
    else:
        try:
            group = mx.distributed.init(strict=True, backend=backend)
        except RuntimeError as exc:
            raise DistributedError(f"cannot join the {backend} group as rank "
                                   f"{os.environ.get('MLX_RANK')}: {exc}") from None
    _joined[backend] = group
    return group


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise DistributedError(f"unknown distributed mode {mode!r} (choose from "
                               f"{', '.join(MODES)})")
    return mode
