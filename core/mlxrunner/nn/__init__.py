"""What architectures compose their layers from: attention over cache buffers, linear
products, kernel self-checks and switches, trace constants (``mlxrunner.nn``, public).

Each call picks MLX's operations, fast operations or our kernels for the device it runs on,
with one self-check and a fallback. Names outside ``__all__`` are internal (the tests' view
of the CUDA paths).
"""

from __future__ import annotations

from .attention import ATTEND_SOURCE as ATTEND_SOURCE
from .attention import ATTEND_THREADS as ATTEND_THREADS
from .attention import ENV_SWITCH as ENV_SWITCH
from .attention import FOLD_MAX_QUERIES as FOLD_MAX_QUERIES
from .attention import attend, prepare_attend
from .attention import folded_attention as folded_attention
from .attention import keys_at_once as keys_at_once
from .attention import mode as mode
from .kernels import ROW_PRODUCT_MAX_ROWS as ROW_PRODUCT_MAX_ROWS
from .kernels import (
    arange_constant,
    check_kernel,
    constant,
    on_cuda,
    outputs_agree,
    project,
    switch_allows,
)

__all__ = [
    "arange_constant",
    "attend",
    "check_kernel",
    "constant",
    "on_cuda",
    "outputs_agree",
    "prepare_attend",
    "project",
    "switch_allows",
]
