"""Exact top-k indices: the first k places of a stable descending sort.

``topk_indices(x, k)`` returns, over the last axis, the indices of the k largest
values in descending order, ties to the lower index, NaN after every number
(``-inf`` included), NaNs among themselves by index. ``-0.0`` and ``0.0`` are
equal. It is what ``np.argsort(-x, kind="stable")[..., :k]`` gives.

How: every value becomes one int64 sort key, ``(order_key << 32) | index``,
where ``order_key`` is an int32 that orders float32 values descending with NaN
last. Keys are unique, so any sort or partition of them gives the one exact
answer, whatever the backend's sort stability or NaN handling; the index is
read back from the low 32 bits.

Strategies (same answer, chosen by ``mx.default_device()``):

- GPU: sort each 2048-key chunk (one block), keep each chunk's first k, sort
  only those ``chunks * k`` candidates (chunked again while more than 2048). A
  full-row sort of a 150k-260k vocabulary is a multi-pass merge sort; 2048-key
  chunks sort within a block. ``GPU_CHUNK_SELECT`` picks how a chunk's k are
  found: a fused CUDA kernel (the default where CUDA is available; checked
  against the sort on first use, with one warning and the sort if it fails),
  MLX's sort (the default elsewhere), or MLX's partition. Where the rows alone
  keep the GPU busy (batch 64), each kernel block walks several chunks and keeps
  their first k, so one sort of at most 2048 candidates is left.
- CPU: partition the keys (a linear-time selection over contiguous int64),
  then sort the k selected.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

import mlx.core as mx

from .. import settings
from ..nn.cuda_build import CudaKernel, kernel_code
from ..nn.kernels import kernel_allowed, on_cuda, serves

CHUNK = 2048
"""Keys per chunk sorted inside one GPU block (MLX's CUDA block sort holds 2048 int64)."""

_PAD_KEY = (1 << 63) - 1  # after every real key: real keys have index < 2**32 - 1
_NAN = float("nan")


def _order_keys(x: mx.array) -> mx.array:
    """int32 keys whose ascending order is x's descending order, NaN last."""
    # Integer operations only: no float arithmetic that flush-to-zero or fast
    # math could change (subnormals stay distinct from 0).
    bits = mx.view(x.astype(mx.float32), mx.int32)  # exact upcast
    bits = mx.where(bits == -(2**31), 0, bits)  # -0.0 is 0.0
    # IEEE floats order like sign-magnitude integers: flip the magnitude bits of
    # negatives to get two's-complement order, then invert for descending order.
    descending = ~(bits ^ ((bits >> 31) & 0x7FFFFFFF))
    is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
    return mx.where(is_nan, mx.array(0x7FFFFFFF, mx.int32), descending)


def _unique_keys(x: mx.array, index: mx.array) -> mx.array:
    """int64 keys (order_key << 32) | index, unique within a row."""
    return (_order_keys(x).astype(mx.int64) << 32) | index


def _chunked_keys(x: mx.array, index: mx.array) -> mx.array:
    """Unique keys of x padded with NaN to whole chunks: [..., chunks, CHUNK].

    A padded NaN sits at an index past the row, so it sorts after every real entry.
    """
    pad = index.shape[-1] - x.shape[-1]
    if pad:
        widths = [(0, 0)] * (x.ndim - 1) + [(0, pad)]
        x = mx.pad(x.astype(mx.float32), widths, constant_values=_NAN)
    keys = _unique_keys(x, index)
    return keys.reshape(*keys.shape[:-1], keys.shape[-1] // CHUNK, CHUNK)


_order_keys_compiled = mx.compile(_order_keys)
_unique_keys_compiled = mx.compile(_unique_keys)
_chunked_keys_compiled = mx.compile(_chunked_keys)
_index_cache: dict[int, mx.array] = {}


def _index(n: int) -> mx.array:
    """arange(n) as int64, made once per length (cheaper than inside every call)."""
    index = _index_cache.get(n)
    if index is None:
        if len(_index_cache) > 16:
            _index_cache.clear()
        # Evaluated now: a lazy array belongs to its thread's stream, and another engine's
        # thread would have to compute it there.
        index = _index_cache[n] = mx.arange(n, dtype=mx.int64)
        mx.eval(index)
    return index


def _keys(x: mx.array) -> mx.array:
    return _unique_keys_compiled(x, _index(x.shape[-1]))


def _index_of(keys: mx.array) -> mx.array:
    return (keys & 0xFFFFFFFF).astype(mx.int32)


def _first_k_of_row(x: mx.array, k: int) -> mx.array:
    keys = _keys(x)
    if k < x.shape[-1]:
        keys = mx.partition(keys, k - 1, axis=-1)[..., :k]
    return _index_of(mx.sort(keys, axis=-1))


_CPU_ROWS_TOGETHER = 1 << 16  # values; beyond this, rows go one at a time


def _topk_cpu(x: mx.array, k: int) -> mx.array:
    # Select the k smallest unique keys (linear time), then sort only those.
    # Row by row: big temporaries (8 bytes a value) cost more in fresh memory
    # than the work itself once several rows share one allocation.
    lead = x.shape[:-1]
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    if rows.shape[0] <= 1 or rows.shape[0] * n <= _CPU_ROWS_TOGETHER:
        return _first_k_of_row(rows, k).reshape(*lead, k)
    out = [_first_k_of_row(rows[r : r + 1], k) for r in range(rows.shape[0])]
    return mx.concatenate(out, axis=0).reshape(*lead, k)


# A value's unsigned 64-bit key for the CUDA kernels below: the order key of
# :func:`_order_keys` offset by 2**31 (NaN after every number, -0.0 as 0.0) in the high
# half, the index in the low half: ascending keys are a stable descending sort.
_CUDA_ENTRY_KEY = r"""
    const auto entry_key = [](float v, int index) {
        unsigned int b = __float_as_uint(v);
        unsigned int ord = 0xFFFFFFFFu;  // NaN: after every number
        if ((b & 0x7FFFFFFFu) <= 0x7F800000u) {
            if (b == 0x80000000u) {
                b = 0u;  // -0.0 is 0.0
            }
            ord = ~((b & 0x80000000u) ? ~b : (b | 0x80000000u));
        }
        return ((unsigned long long)ord << 32) | (unsigned int)index;
    };
"""


# One block per span of M sub-chunks: build the unsigned 64-bit keys (same order
# as the int64 keys above, offset by 2**63) of 2048 values in shared memory,
# bitonic-sort runs of P (k rounded up to a power of two), then halve: each pair
# of sorted runs keeps the P smallest of their union (min against the reversed
# partner: a bitonic sequence) and bitonic-merges it, until one sorted run of P
# is left in slots 0..P-1. With M > 1 the block goes on: slots P.. take the next
# 2048 - P values and the same network runs again over all 2048, the best P so
# far among them, so a block's span is 2048 + (M - 1) * (2048 - P) values. Fewer,
# longer spans leave fewer candidates to sort after the kernel (used where rows
# give the GPU enough blocks anyway).
_CUDA_CHUNK_TOPK = _CUDA_ENTRY_KEY + r"""
    constexpr int CH = 2048;
    constexpr int THREADS = 256;
    __shared__ unsigned long long keys[CH];
    constexpr int SPAN = CH + (M - 1) * (CH - P);
    const int chunk = blockIdx.x;
    const int row = blockIdx.y;
    const int tid = threadIdx.x;
    const auto* in = x + (size_t)row * N;
    for (int sub = 0; sub < M; ++sub) {
    const int kept = sub == 0 ? 0 : P;  // slots 0..P-1 hold the best P so far
    const int first = chunk * SPAN + (sub == 0 ? 0 : CH + (sub - 1) * (CH - P));
    if (first >= N) {
      break;  // the same for every thread of the block
    }
    for (int i = tid; i < CH - kept; i += THREADS) {
      int idx = first + i;
      keys[kept + i] = idx < N ? entry_key(static_cast<float>(in[idx]), idx) : ~0ull;
    }
    __syncthreads();
    for (int size = 2; size <= P; size <<= 1) {
      for (int stride = size >> 1; stride > 0; stride >>= 1) {
        for (int t = tid; t < CH / 2; t += THREADS) {
          int lo = 2 * t - (t & (stride - 1));
          int hi = lo + stride;
          bool up = (size == P) || ((lo & size) == 0);
          unsigned long long a = keys[lo];
          unsigned long long b = keys[hi];
          if ((a > b) == up) {
            keys[lo] = b;
            keys[hi] = a;
          }
        }
        __syncthreads();
      }
    }
    for (int s = P; s < CH; s <<= 1) {
      int pairs = CH / (2 * s);
      for (int t = tid; t < pairs * P; t += THREADS) {
        int g = t / P;
        int i = t % P;
        int a = g * 2 * s + i;
        int b = g * 2 * s + s + (P - 1 - i);
        unsigned long long vb = keys[b];
        if (vb < keys[a]) {
          keys[a] = vb;
        }
      }
      __syncthreads();
      for (int stride = P >> 1; stride > 0; stride >>= 1) {
        for (int t = tid; t < pairs * (P / 2); t += THREADS) {
          int g = t / (P / 2);
          int u = t % (P / 2);
          int lo = g * 2 * s + 2 * u - (u & (stride - 1));
          int hi = lo + stride;
          unsigned long long a = keys[lo];
          unsigned long long b = keys[hi];
          if (a > b) {
            keys[lo] = b;
            keys[hi] = a;
          }
        }
        __syncthreads();
      }
    }
    }  // sub-chunks
    auto* dst = out + ((size_t)row * gridDim.x + chunk) * K;
    for (int i = tid; i < K; i += THREADS) {
      dst[i] = keys[i];
    }
"""
_cuda_kernel: Any = None  # mx.fast.cuda_kernel's kernel, made on first use
_KERNEL_DTYPES = (mx.float32, mx.float16, mx.bfloat16)
_MAX_GRID_ROWS = 65535  # gridDim.y limit
#: (N, K, dtype, M) cases of the chunk kernel that failed their check (sorted instead)
_kernel_refused: set[tuple[int, int, str, int]] = set()


KERNEL_MIN_BLOCKS = 1024
"""Spans grow past one chunk only while the launch keeps at least this many blocks (an
H200 runs about 1000 of these blocks at once): batch 1 keeps one chunk per block."""

_MAX_SUBCHUNKS = 16


@lru_cache(maxsize=256)  # asked on every call (the check, then the launch): a few shapes
def kernel_launch(rows: int, n: int, k: int, subchunks: int | None = None) -> dict:
    """The kernel's launch geometry for ``rows`` rows of ``n`` values: CUDA-free, testable.

    MLX's ``grid`` counts threads (blocks = grid / threadgroup, rounded up), so one
    256-thread block per span needs ``spans * 256`` threads along x. ``subchunks`` (M)
    defaults to the fewest that leave one sort of at most CHUNK candidates after the
    kernel, where ``rows`` keep :data:`KERNEL_MIN_BLOCKS` blocks busy; else 1.
    """
    power = 1 << (k - 1).bit_length()  # runs of P >= k keys, P a power of two

    def spans(m: int) -> int:
        return -(-n // (CHUNK + (m - 1) * (CHUNK - power)))

    if subchunks is None:
        subchunks = 1
        while spans(subchunks) * k > CHUNK and subchunks < _MAX_SUBCHUNKS:
            subchunks += 1
        if spans(subchunks) * k > CHUNK or rows * spans(subchunks) < KERNEL_MIN_BLOCKS:
            subchunks = 1
    chunks = spans(subchunks)
    return {
        "template": [("N", n), ("K", k), ("P", power), ("M", subchunks)],
        "grid": (chunks * 256, rows, 1),
        "threadgroup": (256, 1, 1),
        "output_shape": (rows, chunks, k),
        "chunks": chunks,
        "span": CHUNK + (subchunks - 1) * (CHUNK - power),
    }


def _cuda_first_k_per_chunk(x: mx.array, k: int, subchunks: int | None = None) -> mx.array:
    """The first k uint64 keys of every span of each row, sorted: [rows, spans, k]
    (spans of one chunk, or more: :func:`kernel_launch`)."""
    global _cuda_kernel
    if _cuda_kernel is None:
        _cuda_kernel = CudaKernel(
            name="mlxrunner_chunk_topk", input_names=["x"], output_names=["out"],
            source=_CUDA_CHUNK_TOPK)
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    if rows.dtype not in _KERNEL_DTYPES:
        rows = rows.astype(mx.float32)
    launch = kernel_launch(rows.shape[0], n, k, subchunks)
    (keys,) = _cuda_kernel(
        inputs=[rows], template=launch["template"], grid=launch["grid"],
        threadgroup=launch["threadgroup"], output_shapes=[launch["output_shape"]],
        output_dtypes=[mx.uint64])
    return keys


def check_rows(rows: int, n: int) -> mx.array:
    """float32 rows that exercise every ordering rule: ties, NaN, +-inf, -0.0, padding."""
    special = (0.5, -1.0, 2.0, _NAN, -math.inf, math.inf, -0.0, 0.0)
    index = mx.arange(rows * n).reshape(rows, n)
    noise = mx.random.normal((rows, n), key=mx.random.key(7)) * 4
    # one value in three from the small set (ties across chunks), the rest distinct; picked
    # by selects, not by indexing an array of them: that is a gather, a kernel MLX's CUDA
    # backend builds on first use (8 s before a fresh run's first token on an H100)
    which = (index // 3) % len(special)
    small = noise
    for i, value in enumerate(special):
        small = mx.where(which == i, mx.array(value, mx.float32), small)
    return mx.where(index % 3 == 0, small, noise)


def _kernel_usable(x: mx.array, k: int) -> bool:
    """Whether the fused kernel may run for this input: CUDA present, not turned off
    (``MLXRUNNER_KERNELS``), and its (N, K, dtype, M) case agreed with the chunked sort on
    check rows once (:func:`mlxrunner.nn.kernels.serves`: a pass kept on disk for later
    processes; the sort's reference run uncompiled, building nothing). A case that fails
    (a build error, a launch refused, a wrong answer) logs one warning and is sorted."""
    if not _cuda_ready() or not settings.current().kernel_allowed("topk"):
        return False
    rows = 1
    for size in x.shape[:-1]:
        rows *= size
    if rows > _MAX_GRID_ROWS:
        return False  # one launch cannot hold that many rows: sort instead (no warning)
    n = x.shape[-1]
    dtype = x.dtype if x.dtype in _KERNEL_DTYPES else mx.float32
    subchunks = dict(kernel_launch(rows, n, k)["template"])["M"]
    case = (n, k, str(dtype), subchunks)

    def kernel(probe: mx.array) -> mx.array:
        return _topk_from_chunk_keys(_cuda_first_k_per_chunk(probe, k, subchunks),
                                     probe.shape[:-1], k, _U64_PAD)

    usable = serves("topk", ("chunk", *case), kernel,
                    lambda probe: _topk_gpu(probe, k, select="sort"),
                    lambda: check_rows(2, n).astype(dtype), 0.0, against="the chunked sort",
                    label="topk_indices: the CUDA chunk kernel", source=kernel_code(__file__))
    if not usable:
        _kernel_refused.add(case)
    return usable


_cuda_ready = on_cuda  # the kernel runs on the GPU stream (tests stand in for it here)


def kernel_status() -> str:
    """'on' (the CUDA kernel is the GPU default), or why it is off (for some cases: those
    whose check failed, each named in its warning)."""
    if not _cuda_ready():
        return "off: no CUDA GPU as the default device"
    if not settings.current().kernel_allowed("topk"):
        return "off: turned off (MLXRUNNER_KERNELS)"
    if _kernel_refused:
        n, k, dtype, _ = min(_kernel_refused)
        return (f"off for {len(_kernel_refused)} case(s) that failed their check "
                f"(first: N={n}, K={k}, {dtype})")
    return "on"


GPU_CHUNK_SELECT: str | None = None
"""How the GPU strategy picks each chunk's k: "sort" (MLX sort of the int64 keys),
"partition" (MLX partition), "kernel" (the fused CUDA kernel above), or None: the
kernel where CUDA is available (self-checked on first use, else the sort)."""


def _first_k_per_chunk(keys: mx.array, k: int, select: str) -> mx.array:
    """The k smallest keys of each CHUNK-key chunk (last axis): sorted, or as a set."""
    if select == "partition":
        # Keys are unique, so a partition's first k are exactly the k smallest.
        return mx.partition(keys, k - 1, axis=-1)[..., :k]
    return mx.sort(keys, axis=-1)[..., :k]


_U64_PAD = mx.array(-1, dtype=mx.int64).view(mx.uint64)  # 2**64 - 1: after every key


def _topk_from_chunk_keys(keys: mx.array, lead: tuple[int, ...], k: int,
                          pad_key: mx.array, select: str = "sort") -> mx.array:
    """From each chunk's first k keys ([rows, chunks, k]) to the row's first k indices."""
    keys = keys.reshape(*lead, -1)
    # Each further level keeps the first k of every CHUNK-key chunk (one block each).
    while keys.shape[-1] > CHUNK:
        pad = -keys.shape[-1] % CHUNK
        if pad:
            filler = mx.broadcast_to(pad_key, (*lead, pad))
            keys = mx.concatenate([keys, filler], axis=-1)
        keys = keys.reshape(*lead, -1, CHUNK)
        keys = _first_k_per_chunk(keys, k, select).reshape(*lead, -1)
    return _index_of(mx.sort(keys, axis=-1)[..., :k])


def _topk_gpu(x: mx.array, k: int, select: str | None = None) -> mx.array:
    n = x.shape[-1]
    if k > CHUNK // 4 or n <= CHUNK:
        # Chunking would shrink the row by less than 4x per level: sort it whole.
        return _index_of(mx.sort(_keys(x), axis=-1)[..., :k])
    select = select or GPU_CHUNK_SELECT
    if select is None:
        select = "kernel" if _kernel_usable(x, k) else "sort"
    lead = x.shape[:-1]
    if select == "kernel":
        return _topk_from_chunk_keys(_cuda_first_k_per_chunk(x, k), lead, k, _U64_PAD)
    keys = _chunked_keys_compiled(x, _index(-(-n // CHUNK) * CHUNK))
    keys = _first_k_per_chunk(keys, k, select)
    return _topk_from_chunk_keys(keys, lead, k, mx.array(_PAD_KEY, dtype=mx.int64), select)


# One block per row of x [rows, N]: the index of the row's largest entry as the order keys
# rank it (NaN below every number, -0.0 equal to 0.0, the first index among equals): each
# thread's least entry key, then the block's least of them in shared memory, 16 bytes a
# load where the row allows. On CUDA in place of MLX's fused order keys and argmin, whose
# build by MLX costs a first run on an empty kernel cache 5.1 s before its first token (an
# H100, bench/startup.py); NVRTC builds this one in a fraction of a second.
_CUDA_GREEDY = _CUDA_ENTRY_KEY + r"""
    const int row = blockIdx.x;
    const int tid = threadIdx.x;
    const T* xr = x + (size_t)row * N;
    __shared__ unsigned long long best[NT];
    unsigned long long mine = ~0ull;
    constexpr int kVec = 16 / sizeof(T);
    if (N % kVec == 0 && !(reinterpret_cast<size_t>(xr) & 15)) {
        #pragma unroll 4
        for (int j = tid * kVec; j < N; j += NT * kVec) {
            const uint4 p = *reinterpret_cast<const uint4*>(xr + j);
            const T* v = reinterpret_cast<const T*>(&p);
            #pragma unroll
            for (int e = 0; e < kVec; ++e) {
                const unsigned long long c = entry_key(static_cast<float>(v[e]), j + e);
                mine = c < mine ? c : mine;
            }
        }
    } else {
        #pragma unroll 4
        for (int j = tid; j < N; j += NT) {
            const unsigned long long c = entry_key(static_cast<float>(xr[j]), j);
            mine = c < mine ? c : mine;
        }
    }
    best[tid] = mine;
    __syncthreads();
    for (int s = NT / 2; s > 0; s >>= 1) {
        if (tid < s && best[tid + s] < best[tid]) best[tid] = best[tid + s];
        __syncthreads();
    }
    if (tid == 0) out[row] = (int)(best[0] & 0xFFFFFFFFull);
"""
GREEDY_THREADS = 1024
_greedy_kernel: Any = None


def _greedy_mlx(x: mx.array) -> mx.array:
    # argmin returns the first minimum: ties to the lower index, like the sort.
    return mx.argmin(_order_keys_compiled(x), axis=-1, keepdims=True).astype(mx.int32)


def _greedy_launch(x: mx.array) -> mx.array:
    global _greedy_kernel
    if _greedy_kernel is None:
        _greedy_kernel = CudaKernel(name="mlxrunner_greedy", input_names=["x"],
                                    output_names=["out"], source=_CUDA_GREEDY)
    n = x.shape[-1]
    rows = x.size // n
    (out,) = _greedy_kernel(
        inputs=[x], template=[("T", x.dtype), ("N", n), ("NT", GREEDY_THREADS)],
        grid=(GREEDY_THREADS * rows, 1, 1), threadgroup=(GREEDY_THREADS, 1, 1),
        output_shapes=[(*x.shape[:-1], 1)], output_dtypes=[mx.int32])
    return out


def _greedy_serves(x: mx.array) -> bool:
    """Whether the greedy kernel serves rows like ``x``: on CUDA, not turned off
    (``MLXRUNNER_KERNELS``), and its (N, dtype) case agreed with MLX's order keys and argmin
    on rows of every ordering rule (ties, NaN, infinities, -0.0) once."""
    n = x.shape[-1]
    if x.dtype not in _KERNEL_DTYPES or not 0 < n < 2 ** 31 or x.size // n > _MAX_GRID_ROWS \
            or not kernel_allowed("topk"):
        return False
    return serves("topk", ("greedy", n, x.dtype),
                  lambda probe: _greedy_launch(probe), _greedy_mlx,
                  lambda: check_rows(3, n).astype(x.dtype), 0.0,
                  source=kernel_code(__file__))


def _greedy(x: mx.array) -> mx.array:
    return _greedy_launch(x) if _greedy_serves(x) else _greedy_mlx(x)


def prepare_topk_indices(rows: int, n: int, k: int, dtype: mx.Dtype = mx.float32) -> None:
    """Settle eagerly what :func:`topk_indices` decides on its first call for ``rows`` rows
    of ``n`` values and this ``k`` (on CUDA: the fused kernel's one-off check, which
    evaluates arrays). Call it before tracing (``mx.compile``) a function that calls
    ``topk_indices``; elsewhere it does nothing."""
    if 1 < k <= n and mx.default_device() != mx.cpu:
        _kernel_usable(mx.zeros((rows, n), dtype=dtype), k)


def topk_indices(x: mx.array, k: int, *, strategy: str | None = None) -> mx.array:
    """Indices of the k largest values over the last axis: a stable descending sort's first k.

    Args:
        x: a float array (float32, bfloat16, float16) with at least one axis; any
            leading shape.
        k: 1 .. row length.
        strategy: ``"gpu"`` or ``"cpu"`` to force one (tests, benchmarks); by
            default chosen from ``mx.default_device()``. Both give the same answer.

    Returns:
        int32 array of shape ``x.shape[:-1] + (k,)``.
    """
    if x.ndim == 0:
        raise ValueError("topk_indices needs an array with at least one axis")
    n = x.shape[-1]
    if not 1 <= k <= n:
        raise ValueError(f"topk_indices: k must be between 1 and the row length {n}, got {k}")
    if strategy is None:
        strategy = "cpu" if mx.default_device() == mx.cpu else "gpu"
    elif strategy not in ("cpu", "gpu"):
        raise ValueError(f"topk_indices: unknown strategy {strategy!r} (use 'cpu' or 'gpu')")
    if x.size == 0:
        return mx.zeros((*x.shape[:-1], k), dtype=mx.int32)
    if k == 1:
        return _greedy(x)  # one reduction, on any device
    if strategy == "gpu":
        return _topk_gpu(x, k)
    return _topk_cpu(x, k)
