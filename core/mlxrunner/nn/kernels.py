"""Fused kernels and the one mechanism that decides whether one may serve; the products
every linear layer runs through.

A fused kernel never decides an output alone. The first time a case (shapes, dtypes,
sizes) is asked for, :func:`serves` runs it beside the MLX operations it replaces on probe
inputs of that case; any error (a source that does not compile, a launch the backend
refuses) or mismatch keeps the operations for that case, with one warning (logger
``mlxrunner.nn``; the CLI prints it on stderr). The check depends on the probe inputs
alone, so it may run while a forward is being traced. ``MLXRUNNER_KERNELS`` (see
:mod:`mlxrunner.settings`) turns kernels off by name.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Collection, Hashable, Sequence
from typing import Any

import mlx.core as mx

from .. import settings
from ..constants import constant
from ..errors import MLXRunnerError

log = logging.getLogger("mlxrunner.nn")

Outputs = mx.array | Sequence[mx.array | None]


def on_cuda() -> bool:
    """Whether operations run on MLX's CUDA backend: the default device is a CUDA GPU
    (custom CUDA kernels serve only then)."""
    cuda = getattr(mx, "cuda", None)
    return mx.default_device() == mx.gpu and cuda is not None and cuda.is_available()


#: on CUDA, products of 2..this many rows run as one-row products (see :func:`project`)
ROW_PRODUCT_MAX_ROWS = 16
def project(x: mx.array, weight_t: mx.array, residual: mx.array | None = None) -> mx.array:
    """``x @ weight_t`` (``+ residual``): activation rows ``x [..., K]`` times a weight held as
    the transposed view of a row-major ``[N, K]`` matrix (``linear.weight.T``), giving
    ``[..., N]``.

    On CUDA a product of 2 to ``ROW_PRODUCT_MAX_ROWS`` rows (a speculative verify block, a
    draft block) runs as that many one-row products: one GatherMM over the one weight,
    which MLX serves with the matrix-vector kernel of a one-token decode step. cuBLAS
    takes short float32 products (7+ rows, TF32 off) to a kernel several times slower, and
    each row then rounds exactly as the same row of a one-token step does. (MLX serves
    that GatherMM only for a transposed view; ``MLXRUNNER_ROW_PRODUCTS=0`` turns it off.)
    A ``residual`` rides in one AddMM off CUDA; on CUDA it is a separate add, since MLX's
    CUDA AddMM costs 12-19 us of host time against 5-10 for a product and an add (H200,
    bench/op_costs.py), and a small model's decode step is bound by host time.
    """
    cuda = on_cuda()
    if residual is not None:
        return project(x, weight_t) + residual if cuda else mx.addmm(residual, x, weight_t)
    rows = x.size // x.shape[-1] if x.ndim and x.shape[-1] else 0
    if not (cuda and 1 < rows <= ROW_PRODUCT_MAX_ROWS and weight_t.ndim == 2
            and x.shape[-1] % 32 == 0 and x.dtype == weight_t.dtype
            and settings.current().row_products):
        return x @ weight_t
    lhs = constant(tuple(range(rows)), mx.uint32)
    rhs = constant((0,) * rows, mx.uint32)
    out = mx.gather_mm(x.reshape(rows, 1, x.shape[-1]), weight_t[None], lhs, rhs)
    return out.reshape(*x.shape[:-1], weight_t.shape[-1])


def _as_list(outputs: Outputs) -> list[mx.array | None]:
    return [outputs] if isinstance(outputs, mx.array) else list(outputs)


def outputs_agree(got: Outputs, want: Outputs, tolerance: float) -> bool:
    """Whether every output matches its reference in shape, dtype and value: ``max |got -
    want| <= tolerance * (1 + max |want|)`` per output; None only where the reference has
    None."""
    got, want = _as_list(got), _as_list(want)
    if len(got) != len(want):
        return False
    for a, b in zip(got, want):
        if (a is None) != (b is None):
            return False
        if a is None or b is None:
            continue
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        a, b = a.astype(mx.float32), b.astype(mx.float32)
        if not float(mx.abs(a - b).max()) <= tolerance * (1.0 + float(mx.abs(b).max())):
            return False
    return True


def check_kernel(label: str, kernel: Callable[[], Outputs], reference: Callable[[], Outputs],
                 tolerance: float, against: str = "MLX's operations") -> bool:
    """Run ``kernel()`` and ``reference()`` (the same inputs; see :func:`outputs_agree`)
    and say whether the kernel may serve. An exception from the kernel logs ``{label}
    unavailable (...); using {against}``, a mismatch ``{label} disagrees with {against};
    using {against}``, each as a warning of logger ``mlxrunner.nn``, and returns False."""
    try:
        got = kernel()
        mx.eval([a for a in _as_list(got) if a is not None])
    except Exception as exc:  # a kernel that does not build or run must not stop decoding
        first = (str(exc).strip() or "?").splitlines()[0]
        log.warning("%s unavailable (%s: %s); using %s", label, type(exc).__name__, first,
                    against)
        return False
    if not outputs_agree(got, reference(), tolerance):
        log.warning("%s disagrees with %s; using %s", label, against, against)
        return False
    return True


_verdicts: dict[tuple[str, Hashable], bool] = {}


def kernel_allowed(name: str) -> bool:
    """Whether the core's fused kernel ``name`` may run at all: on MLX's CUDA backend and
    not turned off (``MLXRUNNER_KERNELS``)."""
    return on_cuda() and settings.current().kernel_allowed(name)


def serves(name: str, case: Hashable, kernel: Callable[[Any], Outputs],
           reference: Callable[[Any], Outputs], probe: Callable[[], Any], tolerance: float,
           against: str = "MLX's operations") -> bool:
    """Whether fused kernel ``name`` may serve ``case``: settled once per case, the first
    time it is asked, by :func:`check_kernel` on ``kernel(probe())`` beside
    ``reference(probe())`` (the probe: random inputs with the case's shapes and dtypes).
    The caller checks :func:`kernel_allowed` first."""
    key = (name, case)
    verdict = _verdicts.get(key)
    if verdict is None:
        inputs = probe()
        verdict = _verdicts[key] = check_kernel(
            f"mlxrunner: fused {name} kernel", lambda: kernel(inputs),
            lambda: reference(inputs), tolerance, against)
    return verdict


def switch_allows(variable: str, name: str, known: Collection[str]) -> bool:
    """Whether environment variable ``variable`` (a plugin's kernel switch over the kernels
    ``known``) lets kernel ``name`` run: unset or "1", all; "0", none; a comma-separated
    list, those named. A name not in ``known`` is refused (a typo must not turn a kernel
    off unnoticed)."""
    value = os.environ.get(variable, "1").strip()
    if value in ("0", "1"):
        return value == "1"
    names = [n.strip() for n in value.split(",") if n.strip()]
    unknown = [n for n in names if n not in known]
    if unknown:
        raise MLXRunnerError(f"{variable}={value!r}: unknown kernel {unknown[0]!r} (use 0, 1 "
                             f"or a comma-separated list of {', '.join(sorted(known))})")
    return name in names
