"""Decode-step products on CUDA with their neighbours fused in: one launch for ``x @ W.T +
residual``, for a gated MLP's ``act(x @ Wg.T) * (x @ Wu.T)``, and for a post norm's residual
add after a product.

A small model's decode step is bound by host time per launched kernel (MLX's CUDA backend
records each as a graph node every step), not by arithmetic: a layer's residual adds and the
MLP's activation each cost a launch beside the products that write them. These kernels take
a few rows (a decode step, a small batch, a short verify block) and read the weight once: a
block per eight output rows (and their up rows for the gated MLP), each warp a run of 16
bytes a lane of all eight and of ``x``, the eight loads in flight at once (a product of a
few MB is bound by its loads' latency, not by bandwidth). They round where MLX's
operations round: the product before the residual or the activation, each activation step.
Every case (sizes, rows, dtype, what is fused) serves only after its self-check against MLX's
operations (``mlxrunner.nn.kernels.serves``).

The RMS norm before a product stays MLX's own kernel: a product that normalised its input
itself (every block the whole row, before its main loop) cost the GPU two to three times
MLX's norm and product together (``bench/launch_cost.py``, three H100 runs: 13.3, 14.3 and
20.8 us for each of the two operations against 6.2-7.4).

A post norm's residual add after a product (``RMSNorm.add_normed(residual, y)``, Gemma's
layers) needs the product's whole row, which no one block has: the product is launched
again with the add after it, done by the block that finishes last (each block counts
itself out on a counter of that launch's own, which the last one's count wraps to 0), and
the first launch, with no reader left, never runs.

The RMS norm that reads such a launch's row next (the next block's pre-norm, after a
residual product or a post norm's add) is written by that launch's last block the same
way: the launch runs again with the norm after it, and its readers of the row (the next
residual add, taps) take the new launch's row through :func:`current`, so the first
launch has no reader left. A layer's pre-norms then cost no launch of their own.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from typing import Any

import mlx.core as mx

from ..constants import constant
from . import cuda_gated, cuda_norms
from .cuda_build import BLOCK_REDUCE, CudaKernel, TemplateArg, block_counters, kernel_code
from .cuda_gated import GATED_ACTIVATION, GLU
from .kernels import kernel_allowed, serves

#: rows of ``x`` a fused product takes (a decode step of up to this many sequences, or a
#: verify block this long); more rows are a prompt's and run as MLX's products
MAX_ROWS = 4
THREADS = 256
#: product outputs remembered per thread (a gate is read right after its product; each
#: entry holds its weight alive)
NOTED_PRODUCTS = 2
#: rows renamed by a relaunch with a norm after it, remembered per thread until their
#: residual reader comes (a layer's MLP or attention later)
NOTED_RENAMED = 4

# Template constants: T (x, weight and residual dtype), K (inputs per row), N (outputs per
# row), M (rows), NT (threads per block), RES (add res to the rounded product), GLU (0: none;
# 1: silu, 2: gelu_tanh of rows [0, N) times rows [N, 2N) of w, or times up where UPX),
# ADDN (then a post-norm's residual add: h = (pres + rms_norm(y) * pw) * ps where PSCALE, by
# the block that finishes last, counted in cnt, whose count by that block wraps it to 0
# again). A block takes NT / 32 consecutive outputs n; its warp w reads runs w, w + NT / 32,
# ... of 32 * kVec inputs of each of them (and of the up rows where GLU reads them) and the
# same run of x, 16 bytes a lane: the block's rows loaded at once, so that a product waits
# on its loads' latency once or twice, not once for every 512 bytes of a row. The warps'
# sums meet in shared memory.
_PRODUCT_ROWS = r"""
    constexpr int kWarps = NT / 32;
    constexpr int kVec = 16 / sizeof(T);
    constexpr int kRun = 32 * kVec;
    constexpr int kRuns = (K + kRun - 1) / kRun;
    constexpr bool kUpRows = GLU && !UPX;
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    const int n0 = block_id * kWarps;
    __shared__ float sums[(kUpRows ? 2 : 1) * kWarps * kWarps * M];
    float acc[kWarps][M];
    float acc_up[kWarps][M];
    #pragma unroll
    for (int r = 0; r < kWarps; ++r) {
        #pragma unroll
        for (int m = 0; m < M; ++m) { acc[r][m] = 0.f; acc_up[r][m] = 0.f; }
    }
    if (!((reinterpret_cast<size_t>(x) | reinterpret_cast<size_t>(w)) & 15)) {
        #pragma unroll 1
        for (int c = warp; c < kRuns; c += kWarps) {
            const int k = c * kRun + lane * kVec;  // (K is a whole number of kVec)
            if (k < K) {
                uint4 wr[kWarps];
                uint4 ur[kWarps];
                uint4 xr[M];
                #pragma unroll
                for (int r = 0; r < kWarps; ++r) {  // (past N: row N - 1 again, unused; no
                    const T* row = w + (size_t)min(n0 + r, N - 1) * K + k;  // branch between
                    wr[r] = *reinterpret_cast<const uint4*>(row);            // the loads)
                    if (kUpRows) ur[r] = *reinterpret_cast<const uint4*>(row + (size_t)N * K);
                }
                #pragma unroll
                for (int m = 0; m < M; ++m) xr[m] = load_x(x + (size_t)m * K + k);
                #pragma unroll
                for (int m = 0; m < M; ++m) {
                    const T* xv = reinterpret_cast<const T*>(&xr[m]);
                    #pragma unroll
                    for (int r = 0; r < kWarps; ++r) {
                        const T* wv = reinterpret_cast<const T*>(&wr[r]);
                        const T* uv = reinterpret_cast<const T*>(&ur[r]);
                        #pragma unroll
                        for (int j = 0; j < kVec; ++j) {
                            const float xf = static_cast<float>(xv[j]);
                            acc[r][m] += static_cast<float>(wv[j]) * xf;
                            if (kUpRows) acc_up[r][m] += static_cast<float>(uv[j]) * xf;
                        }
                    }
                }
            }
        }
    } else {  // x or a weight view off 16-byte alignment: one entry a load
        #pragma unroll 1
        for (int c = warp; c < kRuns; c += kWarps) {
            #pragma unroll 1
            for (int k = c * kRun + lane * kVec; k < min(K, c * kRun + (lane + 1) * kVec);
                 ++k) {
                #pragma unroll
                for (int m = 0; m < M; ++m) {
                    const float xf = static_cast<float>(load_x1(x + (size_t)m * K + k));
                    #pragma unroll
                    for (int r = 0; r < kWarps; ++r) {
                        if (n0 + r < N) {
                            const T* row = w + (size_t)(n0 + r) * K + k;
                            acc[r][m] += static_cast<float>(row[0]) * xf;
                            if (kUpRows)
                                acc_up[r][m] += static_cast<float>(row[(size_t)N * K]) * xf;
                        }
                    }
                }
            }
        }
    }
    #pragma unroll
    for (int r = 0; r < kWarps; ++r) {
        #pragma unroll
        for (int m = 0; m < M; ++m) {
            for (int o = 16; o > 0; o >>= 1) {
                acc[r][m] += __shfl_xor_sync(0xffffffff, acc[r][m], o);
                if (kUpRows) acc_up[r][m] += __shfl_xor_sync(0xffffffff, acc_up[r][m], o);
            }
        }
    }
    if (lane == 0) {
        #pragma unroll
        for (int r = 0; r < kWarps; ++r) {
            #pragma unroll
            for (int m = 0; m < M; ++m) {
                sums[(warp * kWarps + r) * M + m] = acc[r][m];
                if (kUpRows) sums[((kWarps + warp) * kWarps + r) * M + m] = acc_up[r][m];
            }
        }
    }
    __syncthreads();
    if (tid < kWarps * M && n0 + tid / M < N) {
        const int r = tid / M;
        const int m = tid % M;
        const int n = n0 + r;
        float total = 0.f;
        float total_up = 0.f;
        #pragma unroll 1
        for (int v = 0; v < kWarps; ++v) {
            total += sums[(v * kWarps + r) * M + m];
            if (kUpRows) total_up += sums[((kWarps + v) * kWarps + r) * M + m];
        }
        T out = static_cast<T>(total);  // (the product rounded, then its activation)
        const T u = UPX ? up_x[m * N + n] : static_cast<T>(total_up);
        if (GLU) out = gated(static_cast<float>(out), u);
        if (RES) out = static_cast<T>(static_cast<float>(out) +
                                      static_cast<float>(res[m * N + n]));
        y[m * N + n] = out;
    }
"""
_PRODUCT_BODY = GATED_ACTIVATION + _PRODUCT_ROWS

# A launch of one product: its blocks are the grid's, x read as any input is.
_ALONE = r"""
    const int block_id = blockIdx.x;
    const int grid_count = gridDim.x;
    const auto load_x = [](const T* p) { return *reinterpret_cast<const uint4*>(p); };
    const auto load_x1 = [](const T* p) { return *p; };
"""

PRODUCT_SOURCE = _ALONE + _PRODUCT_BODY

# The last block: every block counts itself out on cnt once its rows of y are written; the
# block whose count reaches the grid (and wraps the counter to 0 again, ready for the
# launch's next replay) finishes the rows (block_reduce: cuda_build.BLOCK_REDUCE).
_LAST_BLOCK = BLOCK_REDUCE + r"""
    __shared__ bool last;
    __shared__ float red[kWarps];
    __threadfence();  // this thread's rows of y, seen by every block before it counts out
    __syncthreads();
    if (tid == 0) {
        const unsigned int grid = grid_count;
        last = atomicInc(reinterpret_cast<unsigned int*>(const_cast<int*>(cnt)), grid - 1)
               == grid - 1;
    }
    __syncthreads();
    if (!last) return;
    __threadfence();
"""

# The last block's rows: each thread holds its kPer entries of row m in fv, and the weights
# and residual entries the row's passes read, all loaded at once before the first sum (a
# loop that waited on each load in turn cost the tail one round trip to L2 an entry, the
# launch's own time several times over; a load after a block-wide sum, one more). With
# next_norm (the launch's next norm), nw's entries too. _ADD_NORM_ROW: h = (pres +
# rms_norm(y) * pw) * ps where PSCALE (add_normed: the add-norm kernel's own entry step),
# fv its rounded entries after.
def _row_entries(next_norm: bool) -> str:
    return r"""
        constexpr int kPer = (N + NT - 1) / NT;
        float fv[kPer];
        T pwv[kPer];
        T presv[kPer];""" + (r"""
        T nwv[kPer];""" if next_norm else "") + r"""
        #pragma unroll
        for (int i = 0; i < kPer; ++i) {
            const int j = tid + i * NT;
            const bool in_row = j < N;
            fv[i] = in_row ? static_cast<float>(__ldcg(y + m * N + j)) : 0.f;
            if (ADDN) {
                pwv[i] = in_row ? pw[j] : T{};
                presv[i] = in_row ? pres[m * N + j] : T{};
            }""" + (r"""
            nwv[i] = in_row ? nw[j] : T{};""" if next_norm else "") + r"""
        }
"""


# The tail's scalars, loaded as it starts (before the block counts out).
def _tail_scalars(next_norm: bool) -> str:
    return r"""
    const float post_eps = ADDN ? peps[0] : 0.f;
    const T post_scale = PSCALE ? ps[0] : T{};""" + (r"""
    const float next_eps = neps[0];""" if next_norm else "") + "\n"


_ADD_NORM_ROW = r"""
        {
            float ss = 0.f;
            #pragma unroll
            for (int i = 0; i < kPer; ++i) ss += fv[i] * fv[i];
            const float r = rsqrtf(block_reduce(ss, false, red) / N + post_eps);
            #pragma unroll
            for (int i = 0; i < kPer; ++i) {
                const int j = tid + i * NT;
                if (j < N) {
                    const T hv = add_normed(fv[i], r, pwv[i], presv[i], PSCALE, post_scale);
                    h[m * N + j] = hv;
                    fv[i] = static_cast<float>(hv);
                }
            }
        }
"""

# The post-norm residual add after the product (ADDN, see above): the product kernel with
# pw, pres, ps, peps and cnt more inputs and h another output.
_ADD_NORM_TAIL = (cuda_norms.ADD_NORMED + _tail_scalars(False) + _LAST_BLOCK + r"""
    #pragma unroll 1
    for (int m = 0; m < M; ++m) {""" + _row_entries(False) + _ADD_NORM_ROW + "    }\n")

# The norm of the launch's final rows after it: hn = rms_norm(f) * nw with eps neps, f the
# post norm's h where ADDN, else y (a residual product's sum). The add-norm kernel's inputs
# with nw and neps more, and hn another output (h unused without ADDN).
_NORM_TAIL = (cuda_norms.ADD_NORMED + _tail_scalars(True) + _LAST_BLOCK + r"""
    #pragma unroll 1
    for (int m = 0; m < M; ++m) {""" + _row_entries(True) + r"""
        if (ADDN) {""" + _ADD_NORM_ROW + r"""
        }
        float ss = 0.f;
        #pragma unroll
        for (int i = 0; i < kPer; ++i) ss += fv[i] * fv[i];
        const float r = rsqrtf(block_reduce(ss, false, red) / N + next_eps);
        #pragma unroll
        for (int i = 0; i < kPer; ++i) {  // rounded as MLX's rms_norm rounds
            const int j = tid + i * NT;
            if (j < N) {
                const T xn = static_cast<T>(fv[i] * r);
                hn[m * N + j] = static_cast<T>(static_cast<float>(nwv[i]) *
                                               static_cast<float>(xn));
            }
        }
    }
""")

PRODUCT_ADD_NORM_SOURCE = PRODUCT_SOURCE + _ADD_NORM_TAIL
PRODUCT_NORM_SOURCE = PRODUCT_SOURCE + _NORM_TAIL


def _renamed(source: str, names: dict[str, str]) -> str:
    """``source`` with each identifier in ``names`` (not a member: ``.x``) renamed."""
    pattern = r"(?<![\w.])(" + "|".join(map(re.escape, names)) + r")(?!\w)"
    return re.sub(pattern, lambda match: names[match.group(1)], source)


# A chain: the gated product that makes x (gate rows of w0, with up rows or up0: template
# constants K0, N0, GLU0, UPX0) ahead of the product that reads it, in one launch. Each
# block draws a ticket as it starts: the first kFirst tickets run the gated product (its
# rows into glu_y, counted out on chain[1]); a later block waits until all of them have
# counted out, then runs as block ticket - kFirst of the product (and its tail) over
# grid_count blocks. A block waits only on tickets drawn before its own, by blocks already
# running that wait on nothing: no block waits for one that cannot run. The last block
# past the wait (counted on chain[2]) sets the counters back to 0 for the next replay.
# glu_y, written in this launch, is read past the L1 cache (__ldcg).
_FIRST_PHASE = _renamed(GATED_ACTIVATION + _PRODUCT_ROWS, {
    "K": "K0", "N": "N0", "GLU": "GLU0", "UPX": "UPX0", "RES": "RES0", "x": "x0",
    "w": "w0", "res": "res0", "up_x": "up0", "y": "glu_y"})
_CHAINED = r"""
    const auto load_x = [](const T* p) { return __ldcg(reinterpret_cast<const uint4*>(p)); };
    const auto load_x1 = [](const T* p) { return __ldcg(p); };
    constexpr int kFirst = (N0 + NT / 32 - 1) / (NT / 32);
    unsigned int* const chain_count = reinterpret_cast<unsigned int*>(const_cast<int*>(chain));
    __shared__ int ticket;
    if (threadIdx.x == 0) ticket = static_cast<int>(atomicAdd(chain_count, 1u));
    __syncthreads();
    if (ticket < kFirst) {
        constexpr bool RES0 = false;
        const T* const res0 = nullptr;
        const int block_id = ticket;
""" + _FIRST_PHASE + r"""
        __threadfence();  // this block's rows of glu_y, seen before it counts out
        __syncthreads();
        if (threadIdx.x == 0) atomicAdd(chain_count + 1, 1u);
        return;
    }
    const int block_id = ticket - kFirst;
    const int grid_count = static_cast<int>(gridDim.x) - kFirst;
    if (threadIdx.x == 0) {
        while (atomicAdd(chain_count + 1, 0u) < static_cast<unsigned int>(kFirst)) {
            __nanosleep(64);
        }
        __threadfence();
        if (atomicAdd(chain_count + 2, 1u) == static_cast<unsigned int>(grid_count - 1)) {
            atomicExch(chain_count, 0u);
            atomicExch(chain_count + 1, 0u);
            atomicExch(chain_count + 2, 0u);
        }
    }
    __syncthreads();
    const T* const x = glu_y;
"""
CHAINED_PRODUCT_SOURCE = _CHAINED + _PRODUCT_BODY
CHAINED_ADD_NORM_SOURCE = CHAINED_PRODUCT_SOURCE + _ADD_NORM_TAIL
CHAINED_NORM_SOURCE = CHAINED_PRODUCT_SOURCE + _NORM_TAIL

_TAIL_INPUTS = ["pw", "pres", "ps", "peps", "cnt"]
_CHAIN_INPUTS = ["x0", "w0", "up0", "chain"]
_kernel = CudaKernel(name="mlxrunner_product",
                     input_names=["x", "w", "res", "up_x"],
                     output_names=["y"], source=PRODUCT_SOURCE)
_add_norm_kernel = CudaKernel(name="mlxrunner_product_add_norm",
                              input_names=["x", "w", "res", "up_x", *_TAIL_INPUTS],
                              output_names=["y", "h"], source=PRODUCT_ADD_NORM_SOURCE)
_norm_kernel = CudaKernel(name="mlxrunner_product_norm",
                         input_names=["x", "w", "res", "up_x", *_TAIL_INPUTS, "nw", "neps"],
                         output_names=["y", "h", "hn"], source=PRODUCT_NORM_SOURCE)
# (a chain's x is its own output glu_y: the inputs from w on, the chain's after them)
_chained_kernel = CudaKernel(name="mlxrunner_chain",
                             input_names=["w", "res", "up_x", *_CHAIN_INPUTS],
                             output_names=["y", "glu_y"], source=CHAINED_PRODUCT_SOURCE)
_chained_add_norm_kernel = CudaKernel(
    name="mlxrunner_chain_add_norm",
    input_names=["w", "res", "up_x", *_TAIL_INPUTS, *_CHAIN_INPUTS],
    output_names=["y", "h", "glu_y"], source=CHAINED_ADD_NORM_SOURCE)
_chained_norm_kernel = CudaKernel(
    name="mlxrunner_chain_norm",
    input_names=["w", "res", "up_x", *_TAIL_INPUTS, "nw", "neps", *_CHAIN_INPUTS],
    output_names=["y", "h", "hn", "glu_y"], source=CHAINED_NORM_SOURCE)
#: a post norm after a product: (residual, norm weight, eps, scale or None)
PostNorm = tuple[mx.array, mx.array, float, "mx.array | None"]
#: a norm after a launch's final rows: (norm weight, eps)
NextNorm = tuple[mx.array, float]
#: the gated product that made a product's input, run ahead of it in its launch (a chain):
#: (its input, its weight, its GLU number, its given up rows or None)
Prior = tuple[mx.array, mx.array, int, "mx.array | None"]
Shape = tuple[int, ...]
_noted = threading.local()


def _rows(x: mx.array) -> int:
    return x.size // x.shape[-1] if x.ndim and x.shape[-1] else 0


def short_rows(x: mx.array) -> bool:
    """Whether ``x`` has few enough rows for a fused product (``MAX_ROWS``: a decode step's,
    a verify block's; a prompt's have more)."""
    return x.ndim > 0 and x.size <= MAX_ROWS * x.shape[-1]


def _fits(x: mx.array, in_dims: int) -> bool:
    """Whether rows like ``x`` may reach a fused product at all (cheap: asked per call)."""
    rows = _rows(x)
    return (0 < rows <= MAX_ROWS and x.dtype in (mx.bfloat16, mx.float16, mx.float32)
            and x.shape[-1] == in_dims and (in_dims * x.dtype.size) % 16 == 0
            and kernel_allowed("products"))


def _note(where: threading.local, kind: str, out: mx.array, entry: tuple[Any, ...],
          kept: int) -> None:
    noted = getattr(where, kind, None)
    if noted is None:
        noted = OrderedDict()
        setattr(where, kind, noted)
    noted[id(out)] = entry  # (out held in the entry: its id is not reused meanwhile)
    while len(noted) > kept:
        noted.popitem(last=False)


def _noted_entry(kind: str, out: mx.array) -> tuple[Any, ...] | None:
    """What :func:`_note` kept of ``out`` (this thread), without ``out`` itself; None."""
    noted = getattr(_noted, kind, None)
    entry = None if noted is None else noted.get(id(out))
    return None if entry is None or entry[0] is not out else entry[1:]


def _launch(x: mx.array, weight: mx.array, residual: mx.array | None, glu: int,
            up: mx.array | None = None, post: PostNorm | None = None,
            prior: Prior | None = None) -> mx.array:
    """The product's output, or with ``post`` the post norm's residual add after it
    (``prior``: the gated product that made ``x``, run first in the same launch)."""
    inputs, template, shapes = _arguments(x, weight, residual, glu, up, post, prior=prior)
    if post is None:
        kernel = _kernel if prior is None else _chained_kernel
        out = 0
    else:
        kernel = _add_norm_kernel if prior is None else _chained_add_norm_kernel
        shapes.insert(1, shapes[0])
        out = 1
    assert shapes[0] is not None
    grid = _grid(shapes[0][-1], 0 if prior is None else x.shape[-1])
    return kernel(inputs=inputs, template=template, grid=grid,
                  threadgroup=(THREADS, 1, 1), output_shapes=shapes,
                  output_dtypes=[x.dtype] * len(shapes))[out]


def _launch_normed(x: mx.array, weight: mx.array, residual: mx.array | None,
                   post: PostNorm | None, then: NextNorm, prior: Prior | None = None
                   ) -> tuple[mx.array, mx.array]:
    """The launch's final rows (the product plus ``residual``, or ``post``'s add after it)
    and ``then``'s norm of them, written by its last block (``prior``: as for
    :func:`_launch`)."""
    inputs, template, shapes = _arguments(x, weight, residual, 0, None, post, tail=True,
                                          prior=prior)
    then_weight, then_eps = then
    at = len(inputs) - (len(_CHAIN_INPUTS) if prior is not None else 0)
    inputs[at:at] = [then_weight, constant((float(then_eps),), mx.float32)]
    shape = shapes[0]
    assert shape is not None
    # (h: post's; a chain's gated rows last)
    shapes[1:1] = [shape if post is not None else None, shape]
    outputs = (_norm_kernel if prior is None else _chained_norm_kernel)(
        inputs=inputs, template=template,
        grid=_grid(weight.shape[0], 0 if prior is None else x.shape[-1]),
        threadgroup=(THREADS, 1, 1), output_shapes=shapes,
        output_dtypes=[x.dtype] * len(shapes))
    if prior is not None:
        outputs = outputs[:-1]
    return outputs[-2], outputs[-1]  # (h where post, else y; the norm)


def _grid(N: int, first: int = 0) -> tuple[int, int, int]:
    """A launch's grid: a block per NT / 32 of its ``N`` outputs (a chain's: and of the
    ``first`` of its gated product)."""
    per_block = THREADS // 32
    return (THREADS * (-(-N // per_block) + -(-first // per_block)), 1, 1)


def _arguments(x: mx.array, weight: mx.array, residual: mx.array | None, glu: int,
               up: mx.array | None, post: PostNorm | None, tail: bool = False,
               prior: Prior | None = None
               ) -> tuple[list[mx.array | mx.Dtype], list[TemplateArg], list[Shape | None]]:
    """A product launch's inputs, template and output shapes; with ``post`` or ``tail`` (a
    launch whose last block finishes its rows) also those of a post norm's add (absent
    without ``post``) and a block counter; with ``prior`` (a chain: see above) those of the
    gated product that makes ``x``, whose rows are the chain's last output."""
    K = x.shape[-1]
    N = weight.shape[0] // (2 if glu and up is None else 1)
    absent = x.dtype  # (an input the case does not read: not passed, see CudaKernel)
    inputs: list[mx.array | mx.Dtype] = [x, weight, absent if residual is None else residual,
                                         absent if up is None else up]
    template: list[TemplateArg] = [
        ("T", x.dtype), ("K", K), ("N", N), ("M", _rows(x)), ("NT", THREADS),
        ("RES", residual is not None), ("GLU", glu), ("UPX", up is not None),
        ("ADDN", post is not None)]
    if post is not None or tail:
        post_residual, post_weight, post_eps, scale = post or (absent, absent, 0.0, None)
        inputs += [post_weight, post_residual, absent if scale is None else scale.reshape(1),
                   mx.float32 if post is None else constant((float(post_eps),), mx.float32),
                   block_counters(1)]
        template.append(("PSCALE", scale is not None))
    shapes: list[Shape | None] = [(*x.shape[:-1], N)]
    if prior is not None:
        x0, w0, glu0, up0 = prior
        inputs = inputs[1:] + [x0, w0, absent if up0 is None else up0, block_counters(3)]
        template += [("K0", x0.shape[-1]), ("N0", K), ("GLU0", glu0), ("UPX0", up0 is not None)]
        shapes.append(tuple(x.shape))
    return inputs, template, shapes


def _reference(x: mx.array, weight: mx.array, residual: mx.array | None, glu: int,
               up: mx.array | None = None, post: PostNorm | None = None,
               prior: Prior | None = None) -> mx.array:
    """What MLX's operations compute for the same case (the check's reference; with
    ``prior``, ``x`` is that gated product's output)."""
    # (mlp imports linear, which imports this); the compiled chains themselves, which no
    # product output noted here can turn into a kernel
    from .mlp import _gelu_tanh_mul, _silu_mul

    if prior is not None:
        x = _reference(prior[0], prior[1], None, prior[2], prior[3])
    y = x @ weight.T
    if glu:
        gate, up = mx.split(y, 2, axis=-1) if up is None else (y, up)
        y = (_silu_mul if glu == 1 else _gelu_tanh_mul)(gate, up)
    y = y if residual is None else residual + y
    return y if post is None else \
        cuda_norms._reference_add_norm(post[0], y, post[1], post[2], post[3])


def fused_product(x: mx.array, weight: mx.array, residual: mx.array | None = None, *,
                  activation: str | None = None) -> mx.array | None:
    """``x @ weight.T`` (``+ residual``) for float rows ``x [..., K]`` and a row-major
    ``weight [N, K]`` of the same dtype, as one fused kernel; ``activation`` (``silu``,
    ``gelu_tanh``): ``weight`` is gate rows then up rows and the result ``act(gate) * up``.
    Where ``x`` is a gated product's output (noted as it ran), that product runs first in
    this one's launch (a chain), and its own launch has no reader left. None where no fused
    kernel serves this case: the caller runs MLX's operations."""
    if not short_rows(x):  # (a prompt's rows: asked first, it saves the other questions)
        return None
    glu = GLU.get(activation or "", 0)
    if (activation is not None and not glu) or weight.ndim != 2 or weight.dtype != x.dtype \
            or not _fits(x, weight.shape[1]) or (glu and weight.shape[0] % 2):
        return None
    N = weight.shape[0] // (2 if glu else 1)
    if residual is not None and (residual.dtype != x.dtype
                                 or residual.shape != (*x.shape[:-1], N)):
        return None
    if not _serves(x, weight, residual is not None, glu):
        return None
    found = None if glu else _prior(x)
    y = _launch(x, weight, residual, glu,
                prior=_chain(x, weight, found, residual is not None))
    # (each relaunch below asks whether the chain serves its own case)
    if glu:
        _note(_noted, "gated", y, (y, x, weight, glu, None), NOTED_PRODUCTS)
    elif residual is None:
        _note(_noted, "products", y, (y, x, weight, found), NOTED_PRODUCTS)
    else:
        _note(_noted, "finals", y, (y, x, weight, residual, None, found), NOTED_PRODUCTS)
    return y


def _prior(x: mx.array) -> Prior | None:
    """The gated product that made ``x`` (noted as it ran), where chains may run; None."""
    if not kernel_allowed("chains"):
        return None
    entry = _noted_entry("gated", x)
    return None if entry is None else (entry[0], entry[1], entry[2], entry[3])


def _chain(x: mx.array, weight: mx.array, prior: Prior | None, res: bool, post: int = 0,
           then: bool = False) -> Prior | None:
    """``prior`` where its chain serves this launch's case (else the launch runs alone)."""
    if prior is None or not _serves(x, weight, res, 0, post=post, then=then, prior=prior):
        return None
    return prior


def fused_gated(gate: mx.array, up: mx.array, activation: str) -> mx.array | None:
    """``act(gate) * up`` as one kernel with the product that made ``gate`` (a fused
    product's output, noted as it ran: that product's operation then never runs); None
    where ``gate`` is no such output or no kernel serves the case."""
    entry = _noted_entry("products", gate)
    glu = GLU.get(activation, 0)
    if entry is None or not glu or up.shape != gate.shape or up.dtype != gate.dtype \
            or not kernel_allowed("products"):
        return None
    x, weight, prior = entry
    if not _serves(x, weight, False, glu, upx=True):
        return None
    # (a gated product after a chain's would chain three: the product runs alone)
    y = _launch(x, weight, None, glu, up)
    _note(_noted, "gated", y, (y, x, weight, glu, up), NOTED_PRODUCTS)
    return y


def fused_add_normed(residual: mx.array, x: mx.array, weight: mx.array, eps: float,
                     scale: mx.array | None) -> mx.array | None:
    """``(residual + rms_norm(x, weight, eps)) * scale`` in the launch of the fused product
    that made ``x`` (a product's output noted as it ran, as :func:`fused_gated` takes one:
    that product's operation then never runs); None where ``x`` is no such output or no
    kernel serves the case."""
    entry = _noted_entry("products", x)
    if entry is None or residual.shape != x.shape \
            or residual.dtype != x.dtype or weight.shape != x.shape[-1:] \
            or weight.dtype != x.dtype \
            or (scale is not None and (scale.size != 1 or scale.dtype != x.dtype)) \
            or not (kernel_allowed("products") and kernel_allowed("norms")):
        return None
    source, product_weight, prior = entry
    kind = 1 if scale is None else 2
    if not _serves(source, product_weight, False, 0, post=kind):
        return None
    post = (residual, weight, eps, scale)
    prior = _chain(source, product_weight, prior, False, post=kind)
    h = _launch(source, product_weight, None, 0, post=post, prior=prior)
    _note(_noted, "finals", h, (h, source, product_weight, None, post, prior), NOTED_PRODUCTS)
    return h


def fused_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array | None:
    """``rms_norm(x, weight, eps)`` by the last block of the launch that made ``x`` (a fused
    product's residual sum, or a post norm's add after one: noted as it ran). That launch
    runs again with the norm after it, and :func:`current` gives its ``x`` to the readers
    that come after (the next residual add), so the first launch has no reader left. None
    where ``x`` is no such output or no kernel serves the case."""
    entry = _noted_entry("finals", x)
    # (a final normed again, as a second norm of one stream, is MLX's norm of the rows
    # the first relaunch wrote: a second relaunch would read the weight once more)
    if entry is None or _noted_entry("renamed", x) is not None \
            or weight.shape != x.shape[-1:] or weight.dtype != x.dtype \
            or not (kernel_allowed("prenorms") and kernel_allowed("products")
                    and kernel_allowed("norms")):
        return None
    source, product_weight, residual, post, prior = entry
    kind = 0 if post is None else 1 + (post[3] is not None)
    if not _serves(source, product_weight, residual is not None, 0, post=kind, then=True):
        return None
    prior = _chain(source, product_weight, prior, residual is not None, post=kind, then=True)
    final, normed = _launch_normed(source, product_weight, residual, post, (weight, eps),
                                   prior=prior)
    _note(_noted, "renamed", x, (x, final), NOTED_RENAMED)
    return normed


def current(x: mx.array) -> mx.array:
    """What stands for ``x`` now: the same rows from the launch that also wrote their norm
    (see :func:`fused_norm`), or ``x`` itself. A reader of a residual stream asks this, so
    that the launch it replaced runs for no one (public as ``mlxrunner.nn.residual_stream``:
    an architecture that adds to its stream itself reads it through it)."""
    entry = _noted_entry("renamed", x)
    return x if entry is None else entry[0]


def _serves(x: mx.array, weight: mx.array, res: bool, glu: int, upx: bool = False,
            post: int = 0, then: bool = False, prior: Prior | None = None) -> bool:
    """Whether the kernel serves this case (``post``: 0, or 1 / 2 for a post norm's
    residual add after it without / with a scale; ``then``: a norm of the final rows after
    it; ``prior``: the gated product run first in the launch, making ``x``)."""
    K, M, dtype = x.shape[-1], _rows(x), x.dtype
    rows = weight.shape[0]
    case = (K, rows, M, dtype, res, glu) + ((True,) if upx else ()) + \
        (("post", post) if post else ()) + (("then",) if then else ())
    if prior is not None:
        K0, rows0, glu0, upx0 = prior[0].shape[-1], prior[1].shape[0], prior[2], \
            prior[3] is not None
        case += ("after", K0, rows0, glu0, upx0)

    def probe() -> tuple[Any, ...]:
        keys = [mx.random.key(4711 + i) for i in range(11)]  # no gather (see deltanet's)
        px = mx.random.normal((M, K), key=keys[0]).astype(dtype)
        pw = (mx.random.normal((rows, K), key=keys[1]) * K ** -0.5).astype(dtype)
        n_out = rows // (2 if glu and not upx else 1)
        pr = mx.random.normal((M, n_out), key=keys[2]).astype(dtype) if res else None
        pu = mx.random.normal((M, n_out), key=keys[3]).astype(dtype) if upx else None
        pp = None if not post else (
            mx.random.normal((M, n_out), key=keys[4]).astype(dtype),
            (1.0 + 0.1 * mx.random.normal((n_out,), key=keys[5])).astype(dtype), 1e-6,
            (0.5 + mx.random.uniform(shape=(1,), key=keys[6])).astype(dtype)
            if post == 2 else None)
        pn = ((0.5 + mx.random.uniform(shape=(n_out,), key=keys[7])).astype(dtype), 1e-5) \
            if then else None
        pg = None if prior is None else (
            mx.random.normal((M, K0), key=keys[8]).astype(dtype),
            (mx.random.normal((rows0, K0), key=keys[9]) * K0 ** -0.5).astype(dtype), glu0,
            (2 * mx.random.normal((M, K), key=keys[10])).astype(dtype) if upx0 else None)
        return px, pw, pr, pu, pp, pn, pg

    def kernel(p: tuple[Any, ...]) -> Any:
        # (in a chain p[0] only gives x's shape: the launch makes x itself)
        return _launch_normed(p[0], p[1], p[2], p[4], p[5], prior=p[6]) if then else \
            _launch(p[0], p[1], p[2], glu, p[3], p[4], prior=p[6])

    def reference(p: tuple[Any, ...]) -> Any:
        y = _reference(p[0], p[1], p[2], glu, p[3], p[4], p[6])
        return (y, mx.fast.rms_norm(y, *p[5])) if then else y

    return serves("products", case, kernel, reference, probe,
                  2e-3 if dtype == mx.float32 else 3e-2,
                  # (cuda_norms' add_normed and cuda_gated's activation are in its source)
                  source=kernel_code(__file__, cuda_norms.__file__, cuda_gated.__file__))
