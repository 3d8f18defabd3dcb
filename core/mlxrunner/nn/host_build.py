"""The core's C loops for the host (``host_kernels.c``), built once per machine.

Quantized products (:mod:`mlxrunner.nn.host_quantized`) and the layers between products
(:mod:`mlxrunner.nn.host_ops`) call them through ctypes, which lets go of Python's lock
while they run. The source is built with the system's C compiler (``CC``, else ``cc``,
``gcc`` or ``clang``) into the core's kernel cache folder, under a name that changes with the
source and the compiler, and loaded from there by later processes; where no compiler is
found or the build fails, one line at info level says so and the callers keep numpy and
float32 copies.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shlex
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np

from .kernels import code_of, kernel_cache_folder

log = logging.getLogger("mlxrunner.nn")

SOURCE = Path(__file__).with_name("host_kernels.c")
#: what the built library must answer to ``mlxr_abi_version``
ABI_VERSION = 2
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
        self.lib.mlxr_rms_norm.argtypes = [_P, _P, _L, _L, ctypes.c_float, _P]
        self.lib.mlxr_rope.argtypes = [_P, _L, _L, _L, _L, _L, _I, _P, _L, _P, _P]
        self.lib.mlxr_silu_mul.argtypes = [_P, _P, _L, _P]
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


    def rms_norm(self, x: np.ndarray, weight: np.ndarray | None, eps: float) -> np.ndarray:
        """``x / sqrt(mean(x * x, -1) + eps) * weight`` (C-contiguous float32)."""
        y = np.empty_like(x)
        dims = x.shape[-1]
        self.lib.mlxr_rms_norm(x.ctypes.data, None if weight is None else weight.ctypes.data,
                               x.size // dims, dims, eps, y.ctypes.data)
        return y

    def rope(self, x: np.ndarray, dims: int, traditional: bool, positions: np.ndarray,
             inv: np.ndarray) -> np.ndarray:
        """RoPE of ``x [B, H, L, D]`` (or ``[..., L, D]``) over its first ``dims`` at
        ``positions [B or 1, L]`` (offset and scaled), frequencies ``inv [dims / 2]``."""
        y = np.empty_like(x)
        L, D = x.shape[-2], x.shape[-1]
        outer = x.size // (L * D)
        rows = positions.shape[0]
        per_row = outer // rows if rows > 1 else outer
        self.lib.mlxr_rope(x.ctypes.data, outer, per_row, L, D, dims, int(traditional),
                           positions.ctypes.data, rows, inv.ctypes.data, y.ctypes.data)
        return y

    def silu_mul(self, gate: np.ndarray, up: np.ndarray) -> np.ndarray:
        """``silu(gate) * up`` (one shape, C-contiguous float32)."""
        y = np.empty_like(gate)
        self.lib.mlxr_silu_mul(gate.ctypes.data, up.ctypes.data, gate.size, y.ctypes.data)
        return y


def _raise_for(code: int) -> None:
    if code == -2:
        raise MemoryError("host quantized product: out of memory")
    if code:
        raise ValueError(f"host quantized product: a case it does not take ({code})")


def _compiler() -> list[str] | None:
    """The compiler's command: ``CC`` (words, as make splits it: ``ccache gcc``), else the
    first of cc, gcc and clang found."""
    chosen = shlex.split(os.environ.get("CC", ""))
    if chosen:
        found = shutil.which(chosen[0])
        return None if found is None else [found, *chosen[1:]]
    for name in ("cc", "gcc", "clang"):
        found = shutil.which(name)
        if found:
            return [found]
    return None


def _build_key(source: str, compiler: list[str]) -> str:
    """What a built library is filed under: the source, the compiler (its command, and its
    program's size and modification time: a changed compiler builds again) and the
    machine."""
    facts = [source, *compiler, platform.machine(), platform.system()]
    try:
        stat = os.stat(compiler[0])
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
            log.info("mlxrunner: the host's C loops are unavailable (%s: %s); quantized "
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
                [*compiler, "-O3", "-std=c11", "-shared", "-fPIC", "-pthread", "-o", temporary,
                 str(SOURCE), "-lm"],
                capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)
            if done.returncode:
                lines = (done.stderr or done.stdout or "").strip().splitlines()
                raise RuntimeError(f"{Path(compiler[0]).name} exited {done.returncode}"
                                   + (f": {lines[0]}" if lines else ""))
            os.replace(temporary, built)
        finally:
            if os.path.exists(temporary):
                os.unlink(temporary)
        log.debug("mlxrunner: built %s", built)
    return HostKernels(built)
