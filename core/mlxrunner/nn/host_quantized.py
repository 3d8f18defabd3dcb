"""Products with quantized weights on the host, read as they lie in MLX's arrays.

Where products run on the host (:func:`mlxrunner.nn.kernels.host_products`), a 4- or 8-bit
affine-quantized layer's products of a few rows (a decode step, a verify block, a small
batch) run through ``host_kernels.c``: float32 activations against the quantized words, so
a step reads the weights' bytes (the default model: 98 MB) rather than float32 copies (540
MB) through numpy's BLAS; longer products (a prompt) dequantize the weight, a block of
output rows at a time, for the BLAS. MLX's own CPU loops for these products are several
times slower than either (bench/cpu_products.py).

The C source is built once per machine with the system's C compiler (``CC``, else ``cc``,
``gcc`` or ``clang``) into the core's kernel cache folder and loaded with ctypes; where no
compiler is found or the build fails, one line at info level says so and quantized layers
keep the float32 copies. Like every kernel of the core, the first product of a case is
checked against MLX's (:func:`mlxrunner.nn.kernels.serves`).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

from .host_ops import host_active
from .kernels import HOST_PRODUCT_TOLERANCE, code_of, kernel_cache_folder, note_declined, serves

log = logging.getLogger("mlxrunner.nn")

SOURCE = Path(__file__).with_name("host_kernels.c")
#: what the built library must answer to ``mlxr_abi_version``
ABI_VERSION = 1
#: products of up to this many rows run as rows against the quantized words; longer ones
#: through a dequantized block and the BLAS (whose blocked product wins once enough rows
#: share each weight read)
KERNEL_MAX_ROWS = 16
#: output rows dequantized at a time for a longer product (bounds the float32 scratch)
DEQUANTIZE_BLOCK_ELEMENTS = 1 << 21
#: a product of at least this many weights is split between the calling thread and a
#: helper thread (on a machine of two cores or more)
SPLIT_MIN_WEIGHTS = 1 << 18
#: how long the helper spins for the next product before it sleeps
HELPER_SPIN_NS = 1_000_000
#: a compile that takes longer than this is given up (the float32 copies serve)
BUILD_TIMEOUT_S = 120

_P = ctypes.c_void_p
_L = ctypes.c_long
_I = ctypes.c_int


class HostKernels:
    """The loaded library (see the module)."""

    def __init__(self, path: Path) -> None:
        self.lib = ctypes.CDLL(str(path))
        if self.lib.mlxr_abi_version() != ABI_VERSION:
            raise RuntimeError(f"{path.name}: another version of host_kernels.c")
        self.lib.mlxr_quantized_product.argtypes = [_P, _L, _L, _P, _P, _P, _L, _L, _I, _L,
                                                    _P]
        self.lib.mlxr_dequantize.argtypes = [_P, _P, _P, _L, _L, _L, _I, _L, _L, _P]
        self.lib.mlxr_start_helper.argtypes = [_L]
        self.path = int(self.lib.mlxr_path())
        self.split = (os.cpu_count() or 1) > 1 and self.lib.mlxr_start_helper(HELPER_SPIN_NS) == 0

    def product(self, x: np.ndarray, weight: np.ndarray, scales: np.ndarray,
                biases: np.ndarray, group_size: int, bits: int) -> np.ndarray:
        """``x [rows, in] @ dequantize(weight).T`` as float32 (arrays C-contiguous; scales and
        biases float32)."""
        rows, in_dims = x.shape
        out_dims = weight.shape[0]
        y = np.empty((rows, out_dims), np.float32)
        if rows <= KERNEL_MAX_ROWS:
            code = self.lib.mlxr_quantized_product(
                x.ctypes.data, rows, in_dims, weight.ctypes.data, scales.ctypes.data,
                biases.ctypes.data, out_dims, group_size, bits, SPLIT_MIN_WEIGHTS,
                y.ctypes.data)
            _raise_for(code)
            return y
        block = max(1, DEQUANTIZE_BLOCK_ELEMENTS // in_dims)
        scratch = np.empty((min(block, out_dims), in_dims), np.float32)
        for begin in range(0, out_dims, block):
            end = min(out_dims, begin + block)
            dense = scratch[:end - begin]
            _raise_for(self.lib.mlxr_dequantize(
                weight.ctypes.data, scales.ctypes.data, biases.ctypes.data, out_dims, in_dims,
                group_size, bits, begin, end, dense.ctypes.data))
            np.matmul(x, dense.T, out=y[:, begin:end])
        return y


def _raise_for(code: int) -> None:
    if code == -2:
        raise MemoryError("host quantized product: out of memory")
    if code:
        raise ValueError(f"host quantized product: a case it does not take ({code})")


def _compiler() -> str | None:
    chosen = os.environ.get("CC")
    if chosen:
        return shutil.which(chosen)
    for name in ("cc", "gcc", "clang"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _build_key(source: str, compiler: str) -> str:
    """What a built library is filed under: the source, the compiler (its path, size and
    modification time: a changed compiler builds again) and the machine."""
    facts = [source, compiler, platform.machine(), platform.system()]
    try:
        stat = os.stat(compiler)
        facts += [str(stat.st_size), str(stat.st_mtime_ns)]
    except OSError:
        pass
    return hashlib.sha256("\0".join(facts).encode()).hexdigest()[:24]


_build_lock = threading.Lock()


@functools.cache
def host_kernels() -> HostKernels | None:
    """The library, built or found in the cache on first use; None where it cannot be (see
    the module)."""
    with _build_lock:
        try:
            return _load()
        except Exception as exc:  # no compiler, a failed build: the float32 copies serve
            first = (str(exc).strip() or "?").splitlines()[0]
            log.info("mlxrunner: host quantized products unavailable (%s: %s); quantized "
                     "layers run from float32 copies", type(exc).__name__, first)
            return None


def _load() -> HostKernels:
    source = code_of(str(SOURCE))
    if source is None:
        raise FileNotFoundError(f"{SOURCE.name} is missing from the installed core")
    compiler = _compiler()
    if compiler is None:
        raise FileNotFoundError("no C compiler (set CC, or install cc, gcc or clang)")
    folder = kernel_cache_folder() / "host"
    built = folder / f"host_kernels-{_build_key(source, compiler)}.so"
    if not built.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        handle, temporary = tempfile.mkstemp(dir=folder, suffix=".so.tmp")
        os.close(handle)
        try:
            done = subprocess.run(
                [compiler, "-O3", "-std=c11", "-shared", "-fPIC", "-pthread", "-o", temporary,
                 str(SOURCE)],
                capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)
            if done.returncode:
                lines = (done.stderr or done.stdout or "").strip().splitlines()
                raise RuntimeError(f"{Path(compiler).name} exited {done.returncode}"
                                   + (f": {lines[0]}" if lines else ""))
            os.replace(temporary, built)
        finally:
            if os.path.exists(temporary):
                os.unlink(temporary)
        log.debug("mlxrunner: built %s", built)
    return HostKernels(built)


#: the attribute a quantized layer holds its host arrays under: (MLX sources, numpy views)
_HELD = "_mlxrunner_host_quantized"


def host_quantized_product(layer: Any, x: mx.array) -> mx.array | None:
    """``x`` times the transposed weights of quantized layer ``layer`` (no bias) on the host,
    or None where this does not apply: not a host product (the caller checked
    :func:`mlxrunner.nn.kernels.host_eligible`), outside :func:`mlxrunner.nn.host_ops.hosting`
    (no gradient flows through it), a mode or width the kernel does not take, traced
    arrays, no library, or its check failed for this case."""
    bits, group = int(layer.bits), int(layer.group_size)
    if (not host_active() or getattr(layer, "mode", "affine") != "affine"
            or bits not in (4, 8) or group % 32 or "biases" not in layer):
        return None
    weight = layer["weight"]
    in_dims = weight.shape[1] * 32 // bits
    if in_dims % group:
        return None
    kernels = host_kernels()
    if kernels is None:
        return None
    rows = x.size // in_dims
    try:
        x_host = np.ascontiguousarray(np.asarray(x, dtype=np.float32).reshape(rows, in_dims))
        arrays = _host_arrays(layer)
    except ValueError:  # "[eval] ... not allowed" while tracing
        note_declined(rows * in_dims * weight.shape[0])
        return None
    if not _serves(kernels, bits, group, in_dims):
        return None
    y = kernels.product(x_host, *arrays, group_size=group, bits=bits)
    # shaped before it becomes an MLX array: a reshape there is an operation to wait for
    return mx.array(y.reshape(*x.shape[:-1], weight.shape[0]))


def _host_arrays(layer: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Numpy views of the layer's words and float32 copies of its scales and biases, kept
    on the layer while its arrays are the same objects."""
    sources = (layer["weight"], layer["scales"], layer["biases"])
    held = layer.__dict__.get(_HELD)
    if held is not None and all(a is b for a, b in zip(held[0], sources)):
        return held[1]
    weight = np.ascontiguousarray(np.asarray(sources[0]))
    scales = np.ascontiguousarray(np.asarray(sources[1].astype(mx.float32)))
    biases = np.ascontiguousarray(np.asarray(sources[2].astype(mx.float32)))
    arrays = (weight, scales, biases)
    object.__setattr__(layer, _HELD, (sources, arrays))
    return arrays


#: output rows of a check's probe weight (the kernel's work per output row does not depend
#: on their number)
_PROBE_OUT = 96


def _serves(kernels: HostKernels, bits: int, group: int, in_dims: int) -> bool:
    def probe() -> tuple[mx.array, mx.array, mx.array, mx.array]:
        key = mx.random.key(in_dims * 131 + group * 7 + bits)
        kx, kw = mx.random.split(key)
        w = mx.random.uniform(-1, 1, (_PROBE_OUT, in_dims), key=kw)
        q, s, b = mx.quantize(w, group_size=group, bits=bits)
        # one row, a row block and a row past it, and a prompt's length (the BLAS route)
        return mx.random.uniform(-1, 1, (KERNEL_MAX_ROWS + 4, in_dims), key=kx), q, s, b

    def ours(p: tuple[mx.array, ...]) -> list[mx.array]:
        x, q, s, b = (np.asarray(a) for a in p)
        arrays = (np.ascontiguousarray(q), np.ascontiguousarray(s), np.ascontiguousarray(b))
        return [mx.array(kernels.product(np.ascontiguousarray(x[:n]), *arrays,
                                         group_size=group, bits=bits))
                for n in (1, 5, KERNEL_MAX_ROWS + 4)]

    def reference(p: tuple[mx.array, ...]) -> list[mx.array]:
        x, q, s, b = p
        w = mx.dequantize(q, s, b, group_size=group, bits=bits)
        return [x[:n] @ w.T for n in (1, 5, KERNEL_MAX_ROWS + 4)]

    return serves("host quantized product", (bits, group, in_dims, kernels.path), ours,
                  reference, probe, HOST_PRODUCT_TOLERANCE, against="MLX's product",
                  label="mlxrunner: host quantized product", source=code_of(str(SOURCE)))
