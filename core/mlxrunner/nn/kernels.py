"""Fused kernels and the one mechanism that decides whether one may serve; the products
every linear layer runs through.

A fused kernel never decides an output alone. The first time a case (shapes, dtypes,
sizes) is asked for, :func:`serves` runs it beside the MLX operations it replaces on probe
inputs of that case; any error (a source that does not compile, a launch the backend
refuses) or mismatch keeps the operations for that case, with one warning (logger
``mlxrunner.nn``; the CLI prints it on stderr). The check depends on the probe inputs
alone, so it may run while a forward is being traced. ``MLXRUNNER_KERNELS`` (see
:mod:`mlxrunner.settings`) turns kernels off by name.

On a GPU a kernel that passed its check is remembered on disk, beside MLX's kernel cache
(:class:`VerdictStore`), keyed by the device, MLX's version, the kernel's source and the
case: a later process on the same machine trusts it without running the check again; a
changed kernel or MLX checks again. A kernel that failed is checked (and warned about) in
every process.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import sys
import tempfile
import threading
from collections.abc import Callable, Collection, Hashable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import numpy as np

from .. import settings
from ..constants import constant, padding_entries
from ..errors import MLXRunnerError

log = logging.getLogger("mlxrunner.nn")

Outputs = mx.array | Sequence[mx.array | None]


def on_cuda() -> bool:
    """Whether operations run on MLX's CUDA backend: the default device is a CUDA GPU
    (custom CUDA kernels serve only then)."""
    return _cuda_available() and mx.default_device() == mx.gpu


@functools.cache
def _cuda_available() -> bool:
    # (asked by every layer of a forward: the backend does not change in a process)
    cuda = getattr(mx, "cuda", None)
    return cuda is not None and bool(cuda.is_available())


def off_scalar_pool(a: mx.array) -> mx.array:
    """``a``, where it holds at most 8 bytes on MLX's CUDA backend, copied by one kernel
    into a buffer of ``MIN_CONSTANT_BYTES`` (a view of its first entries): one kernel reads
    ``a`` where MLX keeps it, in its managed scalar pool (see
    :func:`mlxrunner.constants.constant`), the kernels after it read the GPU's own memory.
    Elsewhere ``a`` itself."""
    if a.nbytes > 8 or not on_cuda():
        return a
    zeros = constant((0,) * padding_entries(a.size, a.dtype), a.dtype)
    return mx.concatenate([a.reshape(-1), zeros])[:a.size].reshape(a.shape)


#: on CUDA, float32 products of 2..this many rows run as one-row products (see
#: :func:`project`); half-precision ones up to ``ROW_PRODUCT_MAX_HALF_ROWS``
ROW_PRODUCT_MAX_ROWS = 16
ROW_PRODUCT_MAX_HALF_ROWS = 4
#: ... and only over weights of at most this many bytes: each row reads the weight again,
#: from the GPU's L2 cache where it fits there (a vocabulary's head does not: 16 rows of a
#: 248320 x 1024 bf16 head took 1.8 ms against 0.14 for the plain product, H200)
ROW_PRODUCT_MAX_BYTES = 32 << 20
#: on the host (see :func:`host_products`), weights of at least this many elements (in x
#: out); a smaller product costs MLX less than the host's round trip (an evaluation)
HOST_PRODUCT_MIN_SIZE = 1 << 16
#: the tolerance of the host product's first-use check against MLX's product (float32
#: rounding of another summation order: measured within 2e-6 of the largest output)
HOST_PRODUCT_TOLERANCE = 1e-5


def project(x: mx.array, weight_t: mx.array, residual: mx.array | None = None) -> mx.array:
    """``x @ weight_t`` (``+ residual``): activation rows ``x [..., K]`` times a weight held as
    the transposed view of a row-major ``[N, K]`` matrix (``linear.weight.T``), giving
    ``[..., N]``.

    On MLX's CPU device off macOS a float32 product of a weight of at least
    ``HOST_PRODUCT_MIN_SIZE`` elements runs on the host BLAS (see :func:`host_products`).
    On CUDA a short product (a speculative verify block, a draft block, a small batch's
    step: 2 to ``ROW_PRODUCT_MAX_ROWS`` float32 rows, 2 to ``ROW_PRODUCT_MAX_HALF_ROWS`` in
    half precision, over a weight of at most ``ROW_PRODUCT_MAX_BYTES``) runs as that many
    one-row products: one GatherMM over the one weight, which MLX serves with the
    matrix-vector kernel of a one-token decode step, so each row rounds exactly as the same
    row of a one-token step does; and cuBLAS takes short float32 products (7+ rows, TF32
    off) to a kernel several times slower. Past those bounds the re-read weight costs more
    than the plain product (bench/row_products.py: 8 bf16 rows of the 0.8B's MLP took
    38 us this way against 26), and rows round as the plain product does. (MLX serves that
    GatherMM only for a transposed view; ``MLXRUNNER_ROW_PRODUCTS=0`` turns it off.)
    A ``residual`` rides in one AddMM off CUDA; on CUDA it is a separate add, since MLX's
    CUDA AddMM costs 12-19 us of host time against 5-10 for a product and an add (H200,
    bench/op_costs.py), and a small model's decode step is bound by host time.
    """
    hosted = host_project(x, weight_t)
    if hosted is not None:
        return hosted if residual is None else hosted + residual
    cuda = on_cuda()
    if residual is not None:
        return project(x, weight_t) + residual if cuda else mx.addmm(residual, x, weight_t)
    rows = x.size // x.shape[-1] if x.ndim and x.shape[-1] else 0
    if not (cuda and row_products_serve(rows, x, weight_t)):
        return x @ weight_t
    lhs = constant(tuple(range(rows)), mx.uint32)
    rhs = constant((0,) * rows, mx.uint32)
    out = mx.gather_mm(x.reshape(rows, 1, x.shape[-1]), weight_t[None], lhs, rhs)
    return out.reshape(*x.shape[:-1], weight_t.shape[-1])


def mlx_product_rows(x: mx.array) -> bool:
    """Whether a float product of rows ``x`` is MLX's plain one whatever else :func:`project`
    and the fused products ask: on CUDA, more rows than a fused product or row products
    take (``ROW_PRODUCT_MAX_ROWS``, past the fused products' ``MAX_ROWS``: a prompt chunk's),
    and the host runs none there."""
    return x.ndim > 0 and x.size > ROW_PRODUCT_MAX_ROWS * x.shape[-1] and on_cuda()


def row_products_serve(rows: int, x: mx.array, weight_t: mx.array) -> bool:
    """Whether :func:`project` runs ``rows`` rows of ``x`` as one-row products on CUDA."""
    top = ROW_PRODUCT_MAX_ROWS if x.dtype == mx.float32 else ROW_PRODUCT_MAX_HALF_ROWS
    return (1 < rows <= top and weight_t.ndim == 2 and weight_t.nbytes <= ROW_PRODUCT_MAX_BYTES
            and x.shape[-1] % 32 == 0 and x.dtype == weight_t.dtype
            and settings.current().row_products)


def host_products() -> bool:
    """Whether float32 products run on the host BLAS: on MLX's CPU device off macOS, unless
    ``MLXRUNNER_HOST_PRODUCTS=0``. MLX's Linux CPU build multiplies through the reference
    BLAS it bundles (a [16, 576] x [576, 1536] product: 19 ms, against 0.8 ms in numpy's
    OpenBLAS; bench/cpu_products.py), and its quantized products through loops as slow;
    numpy, which MLX itself depends on, brings an optimised one. A traced graph cannot call
    the host: a decode step or draft block whose trace met enough such products runs
    eagerly from then on (:func:`host_declined`)."""
    return (settings.current().host_products and sys.platform != "darwin"
            and mx.default_device() == mx.cpu)


def host_eligible(x: mx.array, in_dims: int, out_dims: int) -> bool:
    """Whether a product of ``x`` with a weight ``[out_dims, in_dims]`` is one the host
    takes (see :func:`host_products`): float32 rows, a weight of at least
    ``HOST_PRODUCT_MIN_SIZE`` elements."""
    return (x.dtype == mx.float32 and x.ndim > 0 and x.shape[-1] == in_dims and x.size > 0
            and in_dims * out_dims >= HOST_PRODUCT_MIN_SIZE and host_products())


@mx.custom_function
def _host_matmul(x: mx.array, weight_t: mx.array) -> mx.array:
    # np.asarray is a view of an evaluated array (it evaluates x); mx.array copies the result
    return mx.array(np.matmul(np.asarray(x), np.asarray(weight_t)))


@_host_matmul.vjp
def _host_matmul_vjp(primals: list[mx.array], cotangent: mx.array, output: mx.array
                     ) -> tuple[mx.array, mx.array]:
    # a gradient through a host product (a draft trained on the CPU) is MLX's
    x, weight_t = primals
    return cotangent @ weight_t.T, x.T @ cotangent


class _Declined(threading.local):
    count = 0
    run = 0


_declined = _Declined()
_threads_set = False


def _limit_blas_threads() -> None:
    """numpy's OpenBLAS to half the cores (one on two), unless the environment chose
    (``OPENBLAS_NUM_THREADS``, ``OMP_NUM_THREADS``). Host products alternate with MLX's
    own thread, and OpenBLAS workers spin while they wait: on a busy 2-core machine two
    of them made a decode step's products 15x slower (bench/cpu_products.py)."""
    global _threads_set
    if _threads_set or any(v in os.environ for v in ("OPENBLAS_NUM_THREADS",
                                                     "OMP_NUM_THREADS")):
        return
    _threads_set = True
    import ctypes

    threads = max(1, (os.cpu_count() or 2) // 2)
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "openblas" in line.lower()}
    except OSError:  # not Linux: OpenBLAS's own choice
        return
    for path in sorted(paths):
        try:
            library = ctypes.CDLL(path)
        except OSError:
            continue
        for name in ("scipy_openblas_set_num_threads64_", "scipy_openblas_set_num_threads",
                     "openblas_set_num_threads64_", "openblas_set_num_threads"):
            setter = getattr(library, name, None)
            if setter is not None:
                setter(threads)
                log.debug("mlxrunner: numpy's OpenBLAS (%s) set to %d threads", path, threads)
                break


#: a traced forward whose products would have run on the host for at least this many
#: multiply-adds runs eagerly instead (:func:`host_declined`): MLX's reference product
#: does about 1e9 a second on these CPUs, and leaving the trace costs a small model's step
#: a few milliseconds (the demo pair's one-token step: 13 ms traced, 22 eager)
HOST_TRACE_MIN_WORK = 1 << 22


def host_declined() -> int:
    """The multiply-adds of the host products that traced functions have asked for so far
    in this thread (each ran as MLX's product inside the trace): a trace that raised this
    by ``HOST_TRACE_MIN_WORK`` or more should not be replayed where speed matters (see
    mlxrunner.decode.step)."""
    return _declined.count


def host_weights_run() -> int:
    """The weights (in x out, each product counted once whatever its rows) of the host
    products run in this thread so far: a forward that raised this by
    ``HOST_TRACE_MIN_WORK`` or more would have been declined traced, one row as many (see
    mlxrunner.decode.step)."""
    return _declined.run


def note_host_run(weights: int) -> None:
    """Count a host product over ``weights`` weights (see :func:`host_weights_run`)."""
    _declined.run = host_weights_run() + weights


def note_declined(work: int) -> None:
    """Count ``work`` multiply-adds of a host product a traced function asked for (see
    :func:`host_declined`)."""
    _declined.count = host_declined() + work


def host_bound(declined: int) -> bool:
    """Whether the host products traced since :func:`host_declined` returned ``declined``
    add up to ``HOST_TRACE_MIN_WORK``: that trace should give way to eager forwards."""
    return host_declined() - declined >= HOST_TRACE_MIN_WORK


def host_matmul(x: mx.array, weight_t: mx.array) -> mx.array | None:
    """``x @ weight_t`` computed by numpy's BLAS (any float dtype numpy multiplies; rows
    flattened into one matrix), None inside a traced function (``mx.compile``), where the
    host cannot read the arrays (counted: :func:`host_declined`). Gradients flow through
    it as through MLX's product."""
    rows = x.size // x.shape[-1]
    try:
        y = cast(mx.array, _host_matmul(x.reshape(rows, x.shape[-1]), weight_t))
    except ValueError:  # "[eval] ... not allowed" while tracing
        note_declined(rows * x.shape[-1] * weight_t.shape[-1])
        return None
    note_host_run(x.shape[-1] * weight_t.shape[-1])
    return y.reshape(*x.shape[:-1], weight_t.shape[-1])


def host_project(x: mx.array, weight_t: mx.array) -> mx.array | None:
    """:func:`project`'s product on the host where it applies (:func:`host_eligible`, not
    traced) and its first-use check for this weight shape passed; None otherwise."""
    if weight_t.ndim != 2 or weight_t.dtype != mx.float32:
        return None
    in_dims, out_dims = weight_t.shape
    if not host_eligible(x, in_dims, out_dims):
        return None
    if not _host_serves(in_dims, out_dims):
        return None
    return host_matmul(x, weight_t)


def _host_serves(in_dims: int, out_dims: int) -> bool:
    _limit_blas_threads()
    def probe() -> tuple[mx.array, mx.array]:
        # random rows repeated down a tall weight (a vocabulary's head): drawing 28M random
        # numbers for SmolLM2's took seconds of a 2-core CPU
        key = mx.random.key(in_dims * 100003 + out_dims)
        kx, kw = mx.random.split(key)
        block = mx.random.uniform(-1, 1, (min(out_dims, 1024), in_dims), key=kw)
        weight = mx.tile(block, (-(-out_dims // block.shape[0]), 1))[:out_dims]
        return mx.random.uniform(-1, 1, (3, in_dims), key=kx), weight.T

    # one row (numpy's matrix-vector path) and three (its matrix product)
    return serves("host product", (in_dims, out_dims),
                  lambda p: [host_matmul(p[0][:1], p[1]), host_matmul(p[0], p[1])],
                  lambda p: [p[0][:1] @ p[1], p[0] @ p[1]], probe, HOST_PRODUCT_TOLERANCE,
                  against="MLX's product", label="mlxrunner: host BLAS product")


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
    with _uncompiled():
        want = reference()
    if not outputs_agree(got, want, tolerance):
        log.warning("%s disagrees with %s; using %s", label, against, against)
        return False
    return True


@contextmanager
def _uncompiled() -> Iterator[None]:
    """MLX's operations one at a time, not fused: a compiled reference's fused kernels would
    be built (seconds each on a fresh machine) for this one comparison alone, where MLX's
    single operations come built."""
    if not settings.current().mlx_compile:
        yield
        return
    mx.disable_compile()
    try:
        yield
    finally:
        mx.enable_compile()


_verdicts: dict[tuple[str, Hashable], bool] = {}


def kernel_allowed(name: str) -> bool:
    """Whether the core's fused kernel ``name`` may run at all: on MLX's CUDA backend and
    not turned off (``MLXRUNNER_KERNELS``)."""
    return on_cuda() and settings.current().kernel_allowed(name)


def serves(name: str, case: Hashable, kernel: Callable[[Any], Outputs],
           reference: Callable[[Any], Outputs], probe: Callable[[], Any], tolerance: float,
           against: str = "MLX's operations", label: str | None = None,
           source: str | None = None) -> bool:
    """Whether fused kernel ``name`` may serve ``case``: settled once per case, the first
    time it is asked, by :func:`check_kernel` on ``kernel(probe())`` beside
    ``reference(probe())`` (the probe: random inputs with the case's shapes and dtypes).
    The caller checks :func:`kernel_allowed` first. ``label`` names it in the warning
    (default ``mlxrunner: fused {name} kernel``). ``source`` (the kernel's code, or anything
    that changes with it): a pass is kept on disk for later processes (see the module)."""
    key = (name, case)
    verdict = _verdicts.get(key)
    if verdict is None:
        store = verdict_store() if source is not None else None
        lasting = None if store is None or source is None else \
            lasting_key(name, case, source, tolerance)
        if store is not None and lasting is not None and store.passed(lasting):
            verdict = True
        else:
            inputs = probe()
            verdict = check_kernel(
                label or f"mlxrunner: fused {name} kernel", lambda: kernel(inputs),
                lambda: reference(inputs), tolerance, against)
            if verdict and store is not None and lasting is not None:
                store.record_pass(lasting)
        _verdicts[key] = verdict
    return verdict


#: the keys of ``mx.device_info()`` that name a device
STABLE_DEVICE_FACTS = frozenset({"device_name", "architecture", "total_memory",
                                 "memory_size", "compute_capability"})


def lasting_key(name: str, case: Hashable, source: str, tolerance: float,
                mlx_version: str | None = None, device: str | None = None) -> str:
    """What a kept verdict is filed under: a digest of the kernel's name, case, source and
    tolerance, MLX's version and the device (its description from MLX)."""
    if mlx_version is None:
        mlx_version = str(getattr(mx, "__version__", "?"))
    if device is None:
        # what names the device, not what changes while it runs (free memory)
        info = mx.device_info()
        device = json.dumps({k: info[k] for k in sorted(info) if k in STABLE_DEVICE_FACTS},
                            default=str)
    text = "\0".join([name, repr(case), hashlib.sha256(source.encode()).hexdigest(),
                      repr(float(tolerance)), mlx_version, device])
    return hashlib.sha256(text.encode()).hexdigest()[:32]


class VerdictStore:
    """Kernels that passed their check on this machine: one empty file per verdict in
    ``folder`` (written under a temporary name and renamed, so processes may share it)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def passed(self, key: str) -> bool:
        return (self.folder / key).is_file()

    def record_pass(self, key: str) -> None:
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
            handle, temporary = tempfile.mkstemp(dir=self.folder, suffix=".tmp")
            os.close(handle)
            os.replace(temporary, self.folder / key)
        except OSError as exc:  # a read-only cache costs the next process a check, no more
            log.debug("kernel verdict not kept in %s: %s", self.folder, exc)


@functools.cache
def code_of(module_file: str) -> str | None:
    """A module's own text: the ``source`` of :func:`serves` for the kernels it defines (any
    change to the module, a launch constant's included, checks them again); None where it
    cannot be read (then no verdict is kept)."""
    try:
        return Path(module_file).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def kernel_cache_folder() -> Path:
    """Where the core keeps what it built and learnt of its kernels: ``mlxrunner/`` in MLX's
    kernel cache folder when ``MLX_PTX_CACHE_DIR`` names one, else this user's own cache
    folder (not a shared temporary folder: a cubin found there is run)."""
    chosen = settings.current().kernel_cache
    if chosen:
        return Path(chosen) / "mlxrunner"
    home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(home) / "mlxrunner" / "kernels" / str(getattr(mx, "__version__", "unknown"))


def verdict_store() -> VerdictStore | None:
    """Where kernel verdicts are kept: on a GPU only (the CPU runs no fused kernel)."""
    if not on_cuda():
        return None
    return VerdictStore(kernel_cache_folder() / "verdicts")


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
