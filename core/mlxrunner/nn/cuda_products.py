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

A product whose input is the last rows such a launch wrote (its norm's, its post norm's add,
its product's) joins that launch as its next link (a chain, ``MLXRUNNER_KERNELS``'
``chains``), in a function the core traces for ``mx.compile``: one launch runs the products
one after another, each link's blocks waiting for the link before it (see
``_CHAIN_PRELUDE``), so that a layer's products from its attention's output to the next
layer's input products cost one launch. The launch it replaced has no reader left: its
rows are read through :func:`current`.
"""

from __future__ import annotations

import hashlib
import math
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import mlx.core as mx

from ..constants import constant, in_compiled
from . import cuda_gated, cuda_norms
from .cuda_build import (
    BLOCK_REDUCE,
    CudaKernel,
    TemplateArg,
    block_counters,
    kernel_code,
    one_entry,
)
from .cuda_gated import GATED_ACTIVATION, GLU
from .kernels import kernel_allowed, serves

#: rows of ``x`` a fused product takes (a decode step of up to this many sequences, or a
#: verify block this long); more rows are a prompt's and run as MLX's products
MAX_ROWS = 4
THREADS = 256

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


# A chain: products one after another in one launch, each (a link) reading the rows the one
# before it wrote (its norm's, else its post norm's add, else its product), with its own
# residual, activation and tail as a launch of its own has them; link i's names carry the
# suffix _i. Each block draws a ticket as it starts and runs as a block of the link whose
# tickets it drew (link i: the kEnd_{i-1}..kEnd_i range); a block of link i > 0 first waits
# until link i - 1 is done (its blocks counted out on chain[i], or its last block's tail
# written). A block waits only on tickets drawn before its own, by blocks already running:
# none waits for one that cannot run. The last block past the last link's wait (counted on
# chain[n]) sets chain[0..n] back to 0 for the next replay; a link's tail counts its blocks
# out on chain[n + 1 + i], which its last block wraps back to 0. Rows written in the launch
# are read past the L1 cache (__ldcg) where a product reads them as its x. Each input and
# output costs a launch host time: a link's eps are literals of the source, its counters the
# chain's, and every link's rows lie in the launch's one output (a view each outside).
_LINK_NAMES = ("K", "N", "RES", "GLU", "UPX", "ADDN", "PSCALE", "x", "w", "res", "up_x", "y",
               "pw", "pres", "ps", "peps", "cnt", "nw", "neps", "h", "hn")
_CHAIN_PRELUDE = r"""
    const auto load_x = [](const T* p) { return __ldcg(reinterpret_cast<const uint4*>(p)); };
    const auto load_x1 = [](const T* p) { return __ldcg(p); };
    unsigned int* const chain_count = reinterpret_cast<unsigned int*>(const_cast<int*>(chain));
    __shared__ int ticket;
    if (threadIdx.x == 0) ticket = static_cast<int>(atomicAdd(chain_count, 1u));
    __syncthreads();
    constexpr int kEnd_ = 0;
"""


class Ref(NamedTuple):
    """Rows written earlier in the same launch: link ``link``'s ``role`` (``y``: its
    product's, ``h``: its post norm's add, ``hn``: its norm after)."""
    link: int
    role: str


class Link(NamedTuple):
    """One product of a launch with what it fuses: ``x @ weight.T`` (``glu``: gated, with
    ``up`` given or the weight's up rows), ``+ residual``, then ``post``'s residual add
    (residual rows, weight, eps, scale), then ``then``'s norm. ``x``: the first link's
    input; a later link reads the link before it (``x``: what the caller holds for it)."""
    x: mx.array
    weight: mx.array
    glu: int = 0
    up: mx.array | None = None
    residual: mx.array | Ref | None = None
    post: tuple[mx.array | Ref, mx.array, float, mx.array | None] | None = None
    then: NextNorm | None = None

    @property
    def final(self) -> str:
        """The role of the rows a residual reader takes (the stream)."""
        return "h" if self.post is not None else "y"

    @property
    def out(self) -> str:
        """The role of the rows the next link reads."""
        return "hn" if self.then is not None else self.final

    @property
    def N(self) -> int:
        return self.weight.shape[0] // (2 if self.glu and self.up is None else 1)


#: the most links a launch chains
MAX_LINKS = 6


def _row_names(wiring: tuple[tuple[Any, ...], ...]) -> list[tuple[str, int]]:
    """Each row set a chain wired as ``wiring`` writes (``{role}_{link}``) with its link, in
    the order they lie in its one output."""
    names = []
    for i, (_, _, _, post_from, _, then) in enumerate(wiring):
        names += [(f"y_{i}", i)] + ([(f"h_{i}", i)] if post_from is not None else []) + \
            ([(f"hn_{i}", i)] if then is not None else [])
    return names


#: where a chain's row sets start in its one output: a multiple of this many entries (the
#: products load their rows 16 bytes at a time)
ROW_ALIGN = 16


def _chain_source(wiring: tuple[tuple[Any, ...], ...]) -> str:
    """The kernel body of a chain of links wired as ``wiring`` (see :func:`_wiring`); each
    row set ``{role}_{link}`` starts at its template constant ``AT_{role}_{link}`` of the
    launch's one output (:func:`chain_arguments` lays them out)."""
    pointers = [f"    T* const {name} = rows + AT_{name};" for name, _ in _row_names(wiring)]
    parts = [_CHAIN_PRELUDE, "\n".join(pointers) + "\n"]
    last = len(wiring) - 1
    for i, (x_from, res_from, upx, post_from, scaled, then) in enumerate(wiring):
        names = {name: f"{name}_{i}" for name in _LINK_NAMES}
        tail = _NORM_TAIL if then is not None else _ADD_NORM_TAIL if post_from is not None \
            else ""
        body = _renamed(GATED_ACTIVATION + _PRODUCT_ROWS + tail, names)
        defs = [f"const T* const x_{i} = {x_from};" if x_from else ""]
        if res_from != "in":
            defs.append(f"const T* const res_{i} = {res_from or 'nullptr'};")
        if not upx:
            defs.append(f"const T* const up_x_{i} = nullptr;")
        # (eps: a literal of the source; a tail's block counter: the chain's, past its own)
        if post_from is None:
            defs += [f"const T* const {n}_{i} = nullptr;" for n in ("pw", "pres", "ps")]
            defs += [f"const float* const peps_{i} = nullptr;", f"T* const h_{i} = nullptr;"]
        else:
            rows, eps = post_from
            if rows != "in":
                defs.append(f"const T* const pres_{i} = {rows};")
            if not scaled:
                defs.append(f"const T* const ps_{i} = nullptr;")
            defs.append(f"const float peps_{i}[1] = {{{eps.hex()}f}};")
        defs.append(f"const int* const cnt_{i} = " +
                    (f"chain + {last + 2 + i};" if tail else "nullptr;"))
        if then is None:
            defs += [f"const T* const nw_{i} = nullptr;", f"const float* const neps_{i} = nullptr;",
                     f"T* const hn_{i} = nullptr;"]
        else:
            defs.append(f"const float neps_{i}[1] = {{{then.hex()}f}};")
        wait = "" if i == 0 else f"""
        if (threadIdx.x == 0) {{
            while (atomicAdd(chain_count + {i}, 0u) < static_cast<unsigned int>(kDone_{i - 1})) {{
                __nanosleep(64);
            }}
            __threadfence();""" + (f"""
            const unsigned int passed = atomicAdd(chain_count + {last + 1}, 1u);
            if (passed == static_cast<unsigned int>(grid_count - 1)) {{
                for (int c = 0; c <= {last + 1}; ++c) atomicExch(chain_count + c, 0u);
            }}""" if i == last else "") + """
        }
        __syncthreads();"""
        done = "" if i == last else f"""
        __threadfence();
        __syncthreads();
        if (threadIdx.x == 0) atomicAdd(chain_count + {i + 1}, 1u);"""
        parts.append(f"""
    constexpr int kEnd_{i} = kEnd_{i - 1 if i else ''} + (N_{i} + NT / 32 - 1) / (NT / 32);
    constexpr int kDone_{i} = {'1' if tail else f'kEnd_{i} - kEnd_{i - 1 if i else ""}'};
    if (ticket < kEnd_{i}) {{
        const int block_id = ticket - kEnd_{i - 1 if i else ''};
        const int grid_count = kEnd_{i} - kEnd_{i - 1 if i else ''};{wait}
        {chr(10).join('        ' + d for d in defs if d).strip()}
""" + body + done + """
        return;
    }
""")
    return "".join(parts)


def _wiring(links: Sequence[Link]) -> tuple[tuple[Any, ...], ...]:
    """What a chain's source depends on, link by link: where its x, residual and post
    residual come from (a C name of rows written earlier, ``in``: an input), whether it
    reads a given up, its post norm's eps, whether it is scaled, its next norm's eps."""
    def rows(value: Any) -> Any:
        return f"{value.role}_{value.link}" if isinstance(value, Ref) else \
            None if value is None else "in"

    wiring = []
    for i, link in enumerate(links):
        x_from = "" if i == 0 else f"{links[i - 1].out}_{i - 1}"
        post = link.post
        wiring.append((x_from, rows(link.residual), link.up is not None,
                       None if post is None else (rows(post[0]), float(post[2])),
                       post is not None and post[3] is not None,
                       None if link.then is None else float(link.then[1])))
    return tuple(wiring)


_chain_kernels: dict[tuple[tuple[Any, ...], ...], CudaKernel] = {}


def _chain_kernel(wiring: tuple[tuple[Any, ...], ...], input_names: list[str]) -> CudaKernel:
    """The kernel of chains wired as ``wiring``, taking ``input_names`` (the order
    :func:`chain_arguments` passes them in, the same for every chain of a wiring); made
    once a wiring."""
    kernel = _chain_kernels.get(wiring)
    if kernel is None:
        source = _chain_source(wiring)
        digest = hashlib.sha256(source.encode()).hexdigest()[:10]
        kernel = _chain_kernels[wiring] = CudaKernel(
            name=f"mlxrunner_chain_{digest}", input_names=input_names,
            output_names=["rows"], source=source)
    return kernel


def chain_arguments(links: Sequence[Link]) -> tuple[
        CudaKernel, dict[str, mx.array], list[TemplateArg], dict[str, RowSet], int]:
    """A chain's launch: its kernel, inputs by name and template in the order the kernel
    takes them, where each row set (by name, ``{role}_{link}``) lies in its one output
    (``rows``: each set a launch's output would cost the launch host time, and most are
    read only inside it) and blocks."""
    wiring = _wiring(links)
    x = links[0].x
    given: dict[str, mx.array] = {"x_0": x}
    template: list[TemplateArg] = [("T", x.dtype), ("M", _rows(x)), ("NT", THREADS)]
    blocks = 0
    for i, link in enumerate(links):
        post = link.post
        given[f"w_{i}"] = link.weight
        for name, value in ((f"res_{i}", link.residual), (f"up_x_{i}", link.up)):
            if isinstance(value, mx.array):
                given[name] = value
        if post is not None:
            pres, pw, _, scale = post
            given[f"pw_{i}"] = pw
            if isinstance(pres, mx.array):
                given[f"pres_{i}"] = pres
            if scale is not None:
                given[f"ps_{i}"] = one_entry(scale)
        if link.then is not None:
            given[f"nw_{i}"] = link.then[0]
        template += [(f"K_{i}", link.x.shape[-1]), (f"N_{i}", link.N),
                     (f"RES_{i}", link.residual is not None), (f"GLU_{i}", link.glu),
                     (f"UPX_{i}", link.up is not None), (f"ADDN_{i}", post is not None),
                     (f"PSCALE_{i}", post is not None and post[3] is not None)]
        blocks += -(-link.N // (THREADS // 32))
    given["chain"] = block_counters(2 * len(links) + 1)  # (the tails' after the chain's)
    layout: dict[str, RowSet] = {}
    at = 0
    for name, i in _row_names(wiring):
        shape = (*x.shape[:-1], links[i].N)
        layout[name] = RowSet(at, shape)
        template.append((f"AT_{name}", at))
        at += -(-math.prod(shape) // ROW_ALIGN) * ROW_ALIGN
    return _chain_kernel(wiring, list(given)), given, template, layout, blocks


class RowSet(NamedTuple):
    """Where one of a chain's row sets lies in its output: its first entry and its shape."""
    at: int
    shape: Shape


def chain_size(layout: dict[str, RowSet]) -> int:
    """The entries of a chain's one output, for its row sets laid out as ``layout``."""
    return max(-(-(r.at + math.prod(r.shape)) // ROW_ALIGN) * ROW_ALIGN
               for r in layout.values())


def _launch_chain(links: Sequence[Link]) -> list[dict[str, mx.array]]:
    """Each link's rows by role, from one launch of the chain."""
    kernel, inputs, template, layout, blocks = chain_arguments(links)
    flat, = kernel(inputs=list(inputs.values()), template=template,
                   grid=(THREADS * blocks, 1, 1), threadgroup=(THREADS, 1, 1),
                   output_shapes=[(chain_size(layout),)], output_dtypes=[links[0].x.dtype])
    rows: list[dict[str, mx.array]] = [{} for _ in links]
    for name, (at, shape) in layout.items():
        role, index = name.rsplit("_", 1)
        # (one view a set: what a step's replay pays for each set it reads outside)
        strides = [math.prod(shape[d + 1:]) for d in range(len(shape))]
        rows[int(index)][role] = mx.as_strided(flat, shape, strides, at)
    return rows


def _run(links: Sequence[Link]) -> list[dict[str, mx.array]]:
    """Each link's rows by role from one launch: a single product as its own kernel, a
    chain as its wiring's (the seam tests stand in for)."""
    if len(links) > 1:
        return _launch_chain(links)
    link = links[0]
    post: PostNorm | None = None
    if link.post is not None:
        pres, pw, eps, scale = link.post
        assert isinstance(pres, mx.array)  # (a single product reads given rows alone)
        post = (pres, pw, eps, scale)
    residual = link.residual
    assert residual is None or isinstance(residual, mx.array)
    if link.then is not None:
        final, normed = _launch_normed(link.x, link.weight, residual, post, link.then)
        return [{link.final: final, "hn": normed}]
    if post is not None:
        return [{"h": _launch(link.x, link.weight, residual, 0, post=post)}]
    return [{"y": _launch(link.x, link.weight, residual, link.glu, link.up)}]


def _reference_links(links: Sequence[Link]) -> list[dict[str, mx.array]]:
    """What MLX's operations compute for each link's rows (the check's reference)."""
    rows: list[dict[str, mx.array]] = []

    def given(value: Any) -> Any:
        return rows[value.link][value.role] if isinstance(value, Ref) else value

    for i, link in enumerate(links):
        x = link.x if i == 0 else rows[i - 1][links[i - 1].out]
        y = _reference(x, link.weight, given(link.residual), link.glu, link.up)
        out = {"y": y}
        if link.post is not None:
            pres, pw, eps, scale = link.post
            out["h"] = cuda_norms._reference_add_norm(given(pres), y, pw, eps, scale)
        if link.then is not None:
            out["hn"] = mx.fast.rms_norm(out[link.final], *link.then)
        rows.append(out)
    return rows


_TAIL_INPUTS = ["pw", "pres", "ps", "peps", "cnt"]
_kernel = CudaKernel(name="mlxrunner_product",
                     input_names=["x", "w", "res", "up_x"],
                     output_names=["y"], source=PRODUCT_SOURCE)
_add_norm_kernel = CudaKernel(name="mlxrunner_product_add_norm",
                              input_names=["x", "w", "res", "up_x", *_TAIL_INPUTS],
                              output_names=["y", "h"], source=PRODUCT_ADD_NORM_SOURCE)
_norm_kernel = CudaKernel(name="mlxrunner_product_norm",
                         input_names=["x", "w", "res", "up_x", *_TAIL_INPUTS, "nw", "neps"],
                         output_names=["y", "h", "hn"], source=PRODUCT_NORM_SOURCE)
#: a post norm after a product: (residual, norm weight, eps, scale or None)
PostNorm = tuple[mx.array, mx.array, float, "mx.array | None"]
#: a norm after a launch's final rows: (norm weight, eps)
NextNorm = tuple[mx.array, float]
Shape = tuple[int, ...]
#: launches remembered per thread by their last links' rows (a launch holds its inputs
#: alive), and rows a later launch of the same links also wrote (see :func:`current`);
#: while a step is traced, renames for all its layers (each relaunch of a chain renames all
#: its rows, and a tap reads each layer's stream at the step's end): held arrays there are
#: a trace's, without data, where an eager forward's hold theirs
NOTED_ROWS = 64
NOTED_RENAMED = 4096


class _Noted(threading.local):
    # (class defaults: reading a thread-local's missing attribute raises and catches inside)
    rows: OrderedDict[int, tuple[Any, ...]] | None = None
    renamed: OrderedDict[int, tuple[Any, ...]] | None = None


_noted = _Noted()


class _Launched(NamedTuple):
    links: tuple[Link, ...]
    rows: list[dict[str, mx.array]]


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


def _remember(kind: str, key: mx.array, entry: tuple[Any, ...]) -> None:
    noted = getattr(_noted, kind)
    if noted is None:
        noted = OrderedDict()
        setattr(_noted, kind, noted)
    noted[id(key)] = (key, *entry)  # (key held in the entry: its id is not reused meanwhile)
    noted.move_to_end(id(key))
    while len(noted) > (NOTED_RENAMED if kind == "renamed" and in_compiled() else NOTED_ROWS):
        noted.popitem(last=False)


def _recalled(kind: str, key: mx.array) -> tuple[Any, ...] | None:
    noted = getattr(_noted, kind)
    entry = None if noted is None else noted.get(id(key))
    return None if entry is None or entry[0] is not key else entry[1:]


def _launched(x: mx.array) -> tuple[_Launched, int, str] | None:
    """The launch (as it ran last), link and role of rows ``x`` (this thread's recent
    launches), or None."""
    entry = _recalled("rows", x)
    return None if entry is None else (entry[0], entry[1], entry[2])


def _launch_links(links: tuple[Link, ...], before: _Launched | None = None,
                  replaced: bool = False) -> _Launched:
    """Run ``links`` as one launch and note its rows. ``before``: the launch of the same
    links but the last (``replaced``: the last one changed, else one added): its rows are
    renamed to this launch's, which stands for it (see :func:`current`); a changed link's
    rows only where the change leaves them as they were (its product's, its final rows
    where it gains a norm)."""
    launched = _Launched(links, _run(links))
    last = len(links) - 1
    for role, out in launched.rows[last].items():  # (the rows a later launch may extend)
        _remember("rows", out, (launched, last, role))
    if before is not None:
        kept = len(before.links) - (1 if replaced else 0)
        for i, old in enumerate(before.rows):
            same = i < kept or (links[i].glu == before.links[i].glu
                                and links[i].post is before.links[i].post)
            for role, out in old.items():
                new = launched.rows[i].get(role)
                if same and new is not None:
                    _remember("renamed", out, (new,))
    return launched


def _in_launch(launched: _Launched, value: mx.array | None) -> mx.array | Ref | None:
    """``value`` as rows of ``launched`` (a Ref) where it is some, else itself."""
    if value is None:
        return None
    value = current(value)
    for i, rows in enumerate(launched.rows):
        for role, out in rows.items():
            if out is value:
                return Ref(i, role)
    return value


def _chained(x: mx.array) -> _Launched | None:
    """The launch whose last link's output rows ``x`` is (where a product reading ``x``
    may join it as its next link), or None. Only while the core traces a function for
    ``mx.compile``: each relaunch costs Python time that a replay never pays again but an
    eager forward pays at every call (a prompt's last row, an eager step)."""
    if not (kernel_allowed("chains") and in_compiled()):
        return None
    found = _launched(x)
    if found is None:
        return None
    launched, index, role = found
    links = launched.links
    return launched if index == len(links) - 1 and role == links[-1].out \
        and len(links) < MAX_LINKS else None


def fused_product(x: mx.array, weight: mx.array, residual: mx.array | None = None, *,
                  activation: str | None = None) -> mx.array | None:
    """``x @ weight.T`` (``+ residual``) for float rows ``x [..., K]`` and a row-major
    ``weight [N, K]`` of the same dtype, as one fused kernel; ``activation`` (``silu``,
    ``gelu_tanh``): ``weight`` is gate rows then up rows and the result ``act(gate) * up``.
    Where ``x`` is the output of a fused launch's last product (noted as it ran), this
    product joins that launch as its next link (a chain: one launch, which stands for the
    one before it; see :func:`current`). None where no fused kernel serves this case: the
    caller runs MLX's operations."""
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
    x = current(x)
    before = _chained(x)
    if before is not None:
        links = (*before.links, Link(x, weight, glu, None, _in_launch(before, residual)))
        if _serves_links(links):
            return _launch_links(links, before).rows[-1]["y"]
    return _launch_links((Link(x, weight, glu, None, residual),)).rows[-1]["y"]


def _last_link(out: mx.array, role: str | None) -> _Launched | None:
    """The launch whose last link wrote ``out`` as its ``role`` rows (None: its final
    rows, the stream), or None."""
    found = _launched(out)
    if found is None or _recalled("renamed", out) is not None:
        return None
    launched, index, found_role = found
    last = launched.links[-1]
    return launched if index == len(launched.links) - 1 \
        and found_role == (last.final if role is None else role) else None


def _relaunch(before: _Launched, link: Link, alone: Callable[[], bool]) -> _Launched | None:
    """``before``'s links with its last one now ``link``, launched (None where no kernel
    serves that case: ``alone`` asks where it is a launch of one product, the chain's
    own check where it is a chain)."""
    links = (*before.links[:-1], link)
    if not (_serves_links(links) if len(links) > 1 else alone()):
        return None
    return _launch_links(links, before, replaced=True)


def fused_gated(gate: mx.array, up: mx.array, activation: str) -> mx.array | None:
    """``act(gate) * up`` in the launch of the fused product that made ``gate`` (its last
    link, relaunched with the activation after it: the first launch's product is read by
    no one); None where ``gate`` is no such output or no kernel serves the case."""
    glu = GLU.get(activation, 0)
    before = _last_link(gate, "y")
    if before is None or not glu or up.shape != gate.shape or up.dtype != gate.dtype:
        return None
    link = before.links[-1]
    if link.glu or link.residual is not None or link.post is not None or link.then is not None:
        return None
    launched = _relaunch(before, link._replace(glu=glu, up=up),
                         lambda: _serves(link.x, link.weight, False, glu, upx=True))
    return None if launched is None else launched.rows[-1]["y"]


def fused_add_normed(residual: mx.array, x: mx.array, weight: mx.array, eps: float,
                     scale: mx.array | None) -> mx.array | None:
    """``(residual + rms_norm(x, weight, eps)) * scale`` in the launch of the fused product
    that made ``x`` (its last link, relaunched with the add after it, as
    :func:`fused_gated` does); None where ``x`` is no such output or no kernel serves the
    case."""
    before = _last_link(x, "y")
    if before is None or residual.shape != x.shape \
            or residual.dtype != x.dtype or weight.shape != x.shape[-1:] \
            or weight.dtype != x.dtype \
            or (scale is not None and (scale.size != 1 or scale.dtype != x.dtype)) \
            or not kernel_allowed("norms"):
        return None
    link = before.links[-1]
    if link.glu or link.residual is not None or link.post is not None or link.then is not None:
        return None
    rows = current(residual) if len(before.links) == 1 else _in_launch(before, residual)
    # (rows of the link itself, replaced by this launch, are none it could read)
    if rows is None or (isinstance(rows, Ref) and rows.link == len(before.links) - 1):
        return None
    launched = _relaunch(
        before, link._replace(post=(rows, weight, eps, scale)),
        lambda: _serves(link.x, link.weight, False, 0, post=1 if scale is None else 2))
    return None if launched is None else launched.rows[-1]["h"]


def fused_norm(x: mx.array, weight: mx.array, eps: float) -> mx.array | None:
    """``rms_norm(x, weight, eps)`` by the last block of the launch that made ``x`` (a fused
    product's residual sum, or a post norm's add after one: its last link's). That launch
    runs again with the norm after it, and :func:`current` gives its ``x`` to the readers
    that come after (the next residual add), so the first launch has no reader left. None
    where ``x`` is no such output or no kernel serves the case."""
    if weight.dtype != x.dtype or weight.shape != x.shape[-1:] \
            or not (kernel_allowed("prenorms") and kernel_allowed("norms")):
        return None
    # (a final normed again, as a second norm of one stream, or a stream a later link
    # reads: MLX's norm of the rows the last launch wrote)
    before = _last_link(x, None)
    if before is None:
        return None
    link = before.links[-1]
    if (link.residual is None and link.post is None) or link.then is not None:
        return None
    post = link.post
    kind = 0 if post is None else 1 + (post[3] is not None)
    launched = _relaunch(
        before, link._replace(then=(weight, eps)),
        lambda: _serves(link.x, link.weight, link.residual is not None, 0, post=kind,
                        then=True))
    return None if launched is None else launched.rows[-1]["hn"]


def current(x: mx.array) -> mx.array:
    """What stands for ``x`` now: the same rows from the launch that also wrote more after
    them (a norm, a chained product: see :func:`fused_norm` and :func:`fused_product`),
    or ``x`` itself. A reader of a residual stream asks this, so that the launch it
    replaced runs for no one (public as ``mlxrunner.nn.residual_stream``: an architecture
    that adds to its stream itself reads it through it)."""
    for _ in range(NOTED_RENAMED):  # (each rename leads to a later launch)
        entry = _recalled("renamed", x)
        if entry is None:
            return x
        x = entry[0]
    return x


def _serves_links(links: Sequence[Link]) -> bool:
    """Whether a chain of links like these serves (checked once a case against MLX's
    operations on random rows of the same shapes)."""
    dtype, M = links[0].x.dtype, _rows(links[0].x)
    wiring = _wiring(links)
    case = ("chain", dtype, M, wiring) + tuple(
        (link.x.shape[-1], link.weight.shape[0], link.glu) for link in links)

    def probe() -> list[Link]:
        key = iter(mx.random.split(mx.random.key(4713), 8 * len(links) + 1))

        def normal(shape: tuple[int, ...], scale: float = 1.0, shift: float = 0.0
                   ) -> mx.array:
            return (shift + scale * mx.random.normal(shape, key=next(key))).astype(dtype)

        made: list[Link] = []
        for link in links:
            K, N = link.x.shape[-1], link.N
            x = normal((M, K))
            weight = normal(link.weight.shape, K ** -0.5)
            up = None if link.up is None else normal((M, N), 2.0)
            residual = link.residual if isinstance(link.residual, Ref) or \
                link.residual is None else normal((M, N))
            post = None
            if link.post is not None:
                pres, _, eps, scale = link.post
                post = (pres if isinstance(pres, Ref) else normal((M, N)),
                        normal((N,), 0.1, 1.0), 1e-6,
                        None if scale is None else normal((1,), 0.2, 0.8))
            then = None if link.then is None else (normal((N,), 0.2, 1.0), 1e-5)
            made.append(Link(x, weight, link.glu, up, residual, post, then))
        return made

    def outputs(rows: list[dict[str, mx.array]]) -> list[mx.array]:
        return [rows[i][role] for i in range(len(rows)) for role in sorted(rows[i])]

    return serves("products", case, lambda p: outputs(_run(p)),
                  lambda p: outputs(_reference_links(p)), probe,
                  2e-3 if dtype == mx.float32 else 3e-2,
                  source=kernel_code(__file__, cuda_norms.__file__, cuda_gated.__file__))


def _launch(x: mx.array, weight: mx.array, residual: mx.array | None, glu: int,
            up: mx.array | None = None, post: PostNorm | None = None) -> mx.array:
    """The product's output, or with ``post`` the post norm's residual add after it."""
    inputs, template, shape = _arguments(x, weight, residual, glu, up, post)
    if post is None:
        return _kernel(inputs=inputs, template=template, grid=_grid(shape[-1]),
                       threadgroup=(THREADS, 1, 1), output_shapes=[shape],
                       output_dtypes=[x.dtype])[0]
    return _add_norm_kernel(inputs=inputs, template=template, grid=_grid(shape[-1]),
                            threadgroup=(THREADS, 1, 1), output_shapes=[shape, shape],
                            output_dtypes=[x.dtype] * 2)[1]


def _launch_normed(x: mx.array, weight: mx.array, residual: mx.array | None,
                   post: PostNorm | None, then: NextNorm) -> tuple[mx.array, mx.array]:
    """The launch's final rows (the product plus ``residual``, or ``post``'s add after it)
    and ``then``'s norm of them, written by its last block."""
    inputs, template, shape = _arguments(x, weight, residual, 0, None, post, tail=True)
    then_weight, then_eps = then
    inputs += [then_weight, constant((float(then_eps),), mx.float32)]
    outputs = _norm_kernel(
        inputs=inputs, template=template, grid=_grid(shape[-1]),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[shape, shape if post is not None else None, shape],  # (h: post's)
        output_dtypes=[x.dtype] * 3)
    return outputs[-2], outputs[-1]  # (h where post, else y; the norm)


def _grid(N: int) -> tuple[int, int, int]:
    return (THREADS * -(-N // (THREADS // 32)), 1, 1)


def _arguments(x: mx.array, weight: mx.array, residual: mx.array | None, glu: int,
               up: mx.array | None, post: PostNorm | None, tail: bool = False
               ) -> tuple[list[mx.array | mx.Dtype], list[TemplateArg], Shape]:
    """A product launch's inputs, template and output shape; with ``post`` or ``tail`` (a
    launch whose last block finishes its rows) also those of a post norm's add (absent
    without ``post``) and a block counter."""
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
        inputs += [post_weight, post_residual, absent if scale is None else one_entry(scale),
                   mx.float32 if post is None else constant((float(post_eps),), mx.float32),
                   block_counters(1)]
        template.append(("PSCALE", scale is not None))
    return inputs, template, (*x.shape[:-1], N)


def _reference(x: mx.array, weight: mx.array, residual: mx.array | None, glu: int,
               up: mx.array | None = None, post: PostNorm | None = None) -> mx.array:
    """What MLX's operations compute for the same case (the check's reference)."""
    # (mlp imports linear, which imports this); the compiled chains themselves, which no
    # product output noted here can turn into a kernel
    from .mlp import _gelu_tanh_mul, _silu_mul

    y = x @ weight.T
    if glu:
        gate, up = mx.split(y, 2, axis=-1) if up is None else (y, up)
        y = (_silu_mul if glu == 1 else _gelu_tanh_mul)(gate, up)
    y = y if residual is None else residual + y
    return y if post is None else \
        cuda_norms._reference_add_norm(post[0], y, post[1], post[2], post[3])


def _serves(x: mx.array, weight: mx.array, res: bool, glu: int, upx: bool = False,
            post: int = 0, then: bool = False) -> bool:
    """Whether the kernel serves this case (``post``: 0, or 1 / 2 for a post norm's
    residual add after it without / with a scale; ``then``: a norm of the final rows after
    it)."""
    K, M, dtype = x.shape[-1], _rows(x), x.dtype
    rows = weight.shape[0]
    case = (K, rows, M, dtype, res, glu) + ((True,) if upx else ()) + \
        (("post", post) if post else ()) + (("then",) if then else ())

    def probe() -> tuple[Any, ...]:
        keys = [mx.random.key(4711 + i) for i in range(8)]  # no gather (see deltanet's)
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
        return px, pw, pr, pu, pp, pn

    def kernel(p: tuple[Any, ...]) -> Any:
        return _launch_normed(p[0], p[1], p[2], p[4], p[5]) if then else \
            _launch(p[0], p[1], p[2], glu, p[3], p[4])

    def reference(p: tuple[Any, ...]) -> Any:
        y = _reference(p[0], p[1], p[2], glu, p[3], p[4])
        return (y, mx.fast.rms_norm(y, *p[5])) if then else y

    return serves("products", case, kernel, reference, probe,
                  2e-3 if dtype == mx.float32 else 3e-2,
                  # (cuda_norms' add_normed and cuda_gated's activation are in its source)
                  source=kernel_code(__file__, cuda_norms.__file__, cuda_gated.__file__))
