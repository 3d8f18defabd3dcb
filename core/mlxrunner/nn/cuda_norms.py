"""Norms fused with their neighbours on CUDA: attention's per-head inputs (each head's RMS
norm, RoPE and the ``[B, H, L, D]`` layout, for queries, keys and values in one launch; a
decode step's, a verify block's, one sequence's prompt chunk's), and a post-norm's residual
add (``(residual + norm(x)) * scale``, one launch for what MLX runs as a norm, an add and a
multiply; a block a row, for a step's rows and a prompt's).

A decode step on MLX's CUDA backend is bound by host time per launched kernel (see
:mod:`mlxrunner.nn.cuda_products`): a layer with query and key norms, RoPE and a value
norm spends five launches on its heads before attention, a post-norm layer two on each
residual add. These kernels round where MLX's operations round (the normalised row in
the input's dtype, times the weight in that dtype; each rotated pair; the add; the
scale), and serve a case only after its self-check against those operations
(:func:`mlxrunner.nn.kernels.serves`).
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Hashable, Sequence
from typing import Any

import mlx.core as mx

from ..constants import constant, position_constant
from .cuda_build import BLOCK_REDUCE, CudaKernel, kernel_code, one_entry
from .kernels import kernel_allowed, serves

#: positions per sequence a heads launch of several sequences takes (a batch's decode step,
#: short verify blocks); one sequence's launch takes up to ``MAX_HEAD_ROWS`` (a prompt chunk),
#: its length then not a constant of the kernel (one build, one self-check for every length)
MAX_HEAD_POSITIONS = 4
MAX_HEAD_ROWS = 1 << 16
#: rows (sequences times positions) a fused launch takes: a decode step of a batch
MAX_ROWS = 64
#: rows a post norm's residual add takes (a block a row: a prompt chunk's too)
MAX_ADD_ROWS = 1 << 20
FLOATS = (mx.bfloat16, mx.float16, mx.float32)
HEAD_THREADS = 128
ADD_THREADS = 256
TOLERANCE = {mx.float32: 2e-3, mx.float16: 3e-2, mx.bfloat16: 3e-2}

# 1 / rms(row[0, D)) with eps over the block's NT threads (every thread calls it; the block
# sum is cuda_build.BLOCK_REDUCE's, with its barriers). The loops over a row are unrolled
# (their bounds D and NT are constants; the first entry, the thread's index, is not): their
# loads in flight together, where a loop that waited on each in turn cost a round trip to
# memory an entry.
INVERSE_RMS = BLOCK_REDUCE + r"""
    __shared__ float red[NT / 32];
    const auto inverse_rms = [&](const T* row, float eps_value) {
        float ss = 0.f;
        #pragma unroll
        for (int j = threadIdx.x; j < D; j += NT) {
            const float v = static_cast<float>(row[j]);
            ss += v * v;
        }
        return rsqrtf(block_reduce(ss, false, red) / D + eps_value);
    };
"""

# Template constants: T (dtype), D (head size), H0..H2 (heads of each part; 0: no part),
# W0..W2 (each part's row per head: D, or wider where a part takes D of them), C0..C2 (the
# first entry each part takes),
# NORM0..2 (0: none, 1: without weight, 2: with weight), ROT0..2 (rotate), RD (rotated
# dims), TRAD (rotate interleaved pairs), FREQS (periods from freqs, else from the base),
# L (positions per sequence; 0: one sequence, a position a row), PERB (an offset per
# sequence), NT (threads). A block per (part, row, head); rows are (sequence, position)
# pairs, B * L of them. rf: log2(base),
# position scale; eps: each part's.
HEADS_SOURCE = INVERSE_RMS + r"""
    __shared__ __align__(16) T xs[D];
    const int tid = threadIdx.x;
    const int rows = gridDim.x / (H0 + H1 + H2);
    int blk = blockIdx.x, part = 0, H = H0;
    if (blk >= rows * H0) { blk -= rows * H0; part = 1; H = H1;
        if (blk >= rows * H1) { blk -= rows * H1; part = 2; H = H2; } }
    const T* x = part == 0 ? x0 : (part == 1 ? x1 : x2);
    const int W = part == 0 ? W0 : (part == 1 ? W1 : W2);
    const int C = part == 0 ? C0 : (part == 1 ? C1 : C2);
    const T* w = part == 0 ? w0 : (part == 1 ? w1 : w2);
    T* y = part == 0 ? y0 : (part == 1 ? y1 : y2);
    const int norm = part == 0 ? NORM0 : (part == 1 ? NORM1 : NORM2);
    const bool rot = part == 0 ? ROT0 : (part == 1 ? ROT1 : ROT2);
    const int m = blk / H, h = blk - m * H;
    const int positions = L ? L : rows;
    const int b = m / positions, l = m - b * positions;
    x += (size_t)blk * W + C;
    y += ((size_t)(b * H + h) * positions + l) * D;

    // what the block reads after its barriers, loaded first (a load after a block-wide sum
    // waits a round trip to memory that nothing hides): the norm's weights, the position,
    // the rotation's periods
    constexpr int kPer = (D + NT - 1) / NT;
    constexpr int half = RD / 2;
    constexpr int kHalfPer = (half + NT - 1) / NT;
    T wv[kPer];
    if (norm == 2) {
        #pragma unroll
        for (int i = 0; i < kPer; ++i) {
            const int j = tid + i * NT;
            wv[i] = j < D ? w[j] : T{};
        }
    }
    const float pos = rot ? rf[1] * static_cast<float>(offset[PERB ? b : 0] + l) : 0.f;
    float inv_freqs[kHalfPer];
    if (rot) {
        #pragma unroll
        for (int k = 0; k < kHalfPer; ++k) {
            const int i = tid + k * NT;
            if (FREQS) inv_freqs[k] = i < half ? static_cast<float>(
                1.0 / static_cast<double>(freqs[i])) : 0.f;
            else inv_freqs[k] = exp2f(-(static_cast<float>(i) / static_cast<float>(half))
                                      * rf[0]);
        }
    }

    if (norm) {
        const float inv = inverse_rms(x, eps[part]);
        #pragma unroll
        for (int i = 0; i < kPer; ++i) {
            const int j = tid + i * NT;
            if (j < D) {
                const T xn = static_cast<T>(static_cast<float>(x[j]) * inv);
                xs[j] = norm == 2 ? static_cast<T>(static_cast<float>(wv[i]) *
                                                   static_cast<float>(xn))
                                  : xn;
            }
        }
    } else {
        #pragma unroll
        for (int j = tid; j < D; j += NT) xs[j] = x[j];
    }
    __syncthreads();
    if (!rot) {
        #pragma unroll
        for (int j = tid; j < D; j += NT) y[j] = xs[j];
        return;
    }
    #pragma unroll
    for (int k = 0; k < kHalfPer; ++k) {
        const int i = tid + k * NT;
        if (i >= half) break;
        const float theta = pos * inv_freqs[k];
        float s, c;
        sincosf(theta, &s, &c);
        const int i1 = TRAD ? 2 * i : i;
        const int i2 = TRAD ? 2 * i + 1 : i + half;
        const float a = static_cast<float>(xs[i1]), e = static_cast<float>(xs[i2]);
        y[i1] = static_cast<T>(a * c - e * s);
        y[i2] = static_cast<T>(a * s + e * c);
    }
    #pragma unroll
    for (int j = RD + tid; j < D; j += NT) y[j] = xs[j];
"""

# Template constants: T, D (row size), NT, SCALE (times s[0]). A block per row:
# y = (res + rms_norm(x) * w) * s, rounding as MLX's norm, add and multiply do.
# One entry of a post norm's residual add, ``(r + rms_norm(x) * w) * s`` (``x`` times its
# row's inverse RMS ``inv``; ``s`` where ``scaled``), rounded to T where MLX's norm, add
# and multiply round; the product kernel's post-norm tail (cuda_products) uses it too.
ADD_NORMED = r"""
    const auto add_normed = [](float x_value, float inv, T w_value, T r_value, bool scaled,
                               T s_value) {
        const T xn = static_cast<T>(x_value * inv);
        const T n = static_cast<T>(static_cast<float>(w_value) * static_cast<float>(xn));
        const T out = static_cast<T>(static_cast<float>(r_value) + static_cast<float>(n));
        return scaled ? static_cast<T>(static_cast<float>(out) * static_cast<float>(s_value))
                      : out;
    };
"""

ADD_NORM_SOURCE = INVERSE_RMS + ADD_NORMED + r"""
    const int tid = threadIdx.x;
    const size_t base = (size_t)blockIdx.x * D;
    const float inv = inverse_rms(x + base, eps[0]);
    #pragma unroll
    for (int j = tid; j < D; j += NT) {
        y[base + j] = add_normed(static_cast<float>(x[base + j]), inv, w[j], res[base + j],
                                 SCALE, SCALE ? s[0] : T{});
    }
"""

_heads = CudaKernel(name="mlxrunner_heads",
                    input_names=["x0", "x1", "x2", "w0", "w1", "w2", "eps", "offset", "freqs",
                                 "rf"],
                    output_names=["y0", "y1", "y2"], source=HEADS_SOURCE)
_add_norm = CudaKernel(name="mlxrunner_add_norm", input_names=["x", "w", "res", "s", "eps"],
                       output_names=["y"], source=ADD_NORM_SOURCE)


# ---------------------------------------------------------------------------------------
# attention's heads
# ---------------------------------------------------------------------------------------

#: a part as the kernel takes it: heads ``[B, L, H, W]`` (``D`` entries of each read), the
#: norm weight (None: no weight), eps (None: no norm), rotate
HeadPart = tuple[mx.array, "mx.array | None", "float | None", bool]
#: the rotation: dims, traditional, log2(base) or None (periods from freqs), scale, freqs
Rotation = tuple[int, bool, "float | None", float, "mx.array | None"]
#: how a fused heads launch made one of its outputs: the part, its rotation (absent where
#: the part is not rotated: its dims then unused), the positions' offsets (int32, one or
#: one per sequence) and the first entry it took of each head
HeadSource = tuple[HeadPart, Rotation, mx.array, int]
#: heads outputs remembered per thread (a layer's query, keys and values, until its
#: attention reads the query; each entry holds its output alive)
NOTED_HEADS = 6


class _Sources(threading.local):
    noted: OrderedDict[int, Any] | None = None


_sources = _Sources()


def head_source(out: mx.array) -> HeadSource | None:
    """How :func:`fused_heads` made ``out`` (this thread, among its last few), or None: a
    reader may do that work itself from the raw heads (the attention kernel does, so that a
    layer whose keys come from another spends no launch on its query)."""
    noted = _sources.noted
    entry = None if noted is None else noted.get(id(out))
    return None if entry is None or entry[0] is not out else entry[1]


def _note_source(out: mx.array, source: HeadSource) -> None:
    noted = _sources.noted
    if noted is None:
        noted = _sources.noted = OrderedDict()
    noted[id(out)] = (out, source)  # (out held: its id is not reused meanwhile)
    while len(noted) > NOTED_HEADS:
        noted.popitem(last=False)


def _offsets(offset: int | mx.array) -> mx.array:
    return offset.reshape(-1) if isinstance(offset, mx.array) else position_constant(offset)


def fused_heads(parts: Sequence[HeadPart], rotation: Rotation | None,
                offset: int | mx.array, size: int | None = None,
                starts: Sequence[int] | None = None) -> list[mx.array] | None:
    """Each part's heads (``size`` entries of each from its entry in ``starts``; default:
    all of the first part's) normalised, laid out ``[B, H, L, size]`` and rotated (see the
    module), in one launch; None where the kernel does not serve this case (the caller runs
    MLX's)."""
    if not 0 < len(parts) <= 3 or not kernel_allowed("norms"):
        return None
    x = parts[0][0]
    if x.ndim != 4 or x.dtype not in FLOATS:
        return None
    B, L = x.shape[:2]
    D = x.shape[3] if size is None else size
    if HEAD_THREADS * B * L * sum(p[0].shape[2] for p in parts) >= 1 << 31:
        return None  # (MLX takes the grid, in threads, as a 32-bit int)
    if B == 1 and MAX_HEAD_POSITIONS < L <= MAX_HEAD_ROWS:
        positions = 0  # (any length: the launch's rows)
    elif 0 < L <= MAX_HEAD_POSITIONS and 0 < B * L <= MAX_ROWS:
        positions = L
    else:
        return None
    if D % 2 or D < 2:
        return None
    starts = [0] * len(parts) if starts is None else list(starts)
    if len(starts) != len(parts):
        return None
    for (p, weight, _eps, _rot), start in zip(parts, starts):
        if p.ndim != 4 or p.dtype != x.dtype or p.shape[:2] != (B, L) \
                or not 0 <= start <= p.shape[3] - D \
                or (weight is not None and (weight.shape != (D,) or weight.dtype != x.dtype)):
            return None
    if isinstance(offset, mx.array):
        if offset.dtype != mx.int32 or offset.size not in (1, B) or offset.ndim > 1:
            return None
    elif not isinstance(offset, int):
        return None
    if any(p[3] for p in parts) and (rotation is None or not 0 < rotation[0] <= D
                                     or rotation[0] % 2):
        return None
    rot = rotation or (D, False, 0.0, 1.0, None)
    per_sequence = isinstance(offset, mx.array) and offset.size > 1
    case = (x.dtype, D, positions, per_sequence,
            tuple((p.shape[2], p.shape[3] - D, start, w is not None, e is not None, r)
                  for (p, w, e, r), start in zip(parts, starts)),
            rot[0], rot[1], rot[2] is None, rot[3])
    if not _heads_serve(case):
        return None
    offsets = _offsets(offset)
    outputs = _launch_heads(parts, rot, offsets, D, starts, positions, case)
    if positions:  # (the attention kernel makes queries from their raw heads up to
        #            MAX_HEAD_POSITIONS positions: longer blocks' outputs are not held for it)
        for out, part, start in zip(outputs, parts, starts):
            _note_source(out, (part, rot, offsets, start))
    return outputs


def _launch_heads(parts: Sequence[HeadPart], rot: Rotation, offsets: mx.array, D: int,
                  starts: Sequence[int], positions: int, case: Hashable) -> list[mx.array]:
    """The parts' heads from one launch: ``positions`` a sequence (the kernel's ``L``), or
    0: one sequence, its length the launch's rows; ``offsets`` one position or one a
    sequence, ``[1]`` or ``[B]``. ``case``: :func:`fused_heads`' key of this case, which
    settles the kernel's source but for the dtype of the rotation's frequencies (the
    template is made once a case)."""
    x = parts[0][0]
    B, L = x.shape[:2]
    dims, traditional, log2_base, scale, freqs = rot
    absent = x.dtype  # (an input the case does not read: not passed, see CudaKernel)
    missing = 3 - len(parts)
    heads = [p[0].shape[2] for p in parts] + [0] * missing
    case = (case, None if freqs is None else freqs.dtype)
    template = _heads_templates.get(case)
    if template is None:
        template = _heads_templates[case] = _heads_template(parts, rot, D, starts, positions,
                                                            offsets, heads)
    weights: list[mx.array | mx.Dtype] = [
        absent if p[1] is None or p[2] is None else p[1] for p in parts]
    return _heads(
        inputs=[*(p[0] for p in parts), *[absent] * missing, *weights, *[absent] * missing,
                constant(tuple(0.0 if p[2] is None else p[2] for p in parts)
                         + (0.0,) * missing, mx.float32),
                offsets, mx.float32 if freqs is None else freqs,
                constant((log2_base or 0.0, scale), mx.float32)],
        template=template, grid=(HEAD_THREADS * B * L * sum(heads), 1, 1),
        threadgroup=(HEAD_THREADS, 1, 1),
        output_shapes=[(B, heads[i], L, D) if i < len(parts) else None for i in range(3)],
        output_dtypes=[x.dtype] * 3, case=case)


#: each heads case's template, made once (:func:`_launch_heads`)
_heads_templates: dict[Hashable, list[tuple[str, Any]]] = {}


def _heads_template(parts: Sequence[HeadPart], rot: Rotation, D: int, starts: Sequence[int],
                    positions: int, offsets: mx.array, heads: Sequence[int]
                    ) -> list[tuple[str, Any]]:
    """The heads kernel's template (``heads``: each of its three parts' count, 0 absent)."""
    x = parts[0][0]
    dims, traditional, log2_base, _, _ = rot
    missing = 3 - len(parts)
    template: list[tuple[str, Any]] = [("T", x.dtype), ("D", D)]
    template += [(f"H{i}", heads[i]) for i in range(3)]
    template += [(f"W{i}", w) for i, w in enumerate([p[0].shape[3] for p in parts]
                                                     + [D] * missing)]
    template += [(f"C{i}", c) for i, c in enumerate(list(starts[:len(parts)]) + [0] * missing)]
    template += [(f"NORM{i}", n) for i, n in enumerate(
        [0 if p[2] is None else (2 if p[1] is not None else 1) for p in parts] + [0] * missing)]
    template += [(f"ROT{i}", r) for i, r in enumerate([bool(p[3]) for p in parts]
                                                       + [False] * missing)]
    template += [("RD", dims), ("TRAD", bool(traditional)), ("FREQS", log2_base is None),
                 ("L", positions), ("PERB", bool(offsets.size > 1)),
                 ("NT", HEAD_THREADS)]
    return template


def _reference_heads(parts: Sequence[HeadPart], rot: Rotation, offset: int | mx.array,
                     D: int, starts: Sequence[int]) -> list[mx.array]:
    """What MLX's operations compute for the parts (the check's reference)."""
    dims, traditional, log2_base, scale, freqs = rot
    out = []
    for (x, weight, eps, rotate), start in zip(parts, starts):
        x = x[..., start:start + D]
        if eps is not None:
            x = mx.fast.rms_norm(x, weight, eps)
        x = x.transpose(0, 2, 1, 3)
        if rotate:
            x = mx.fast.rope(x, dims, traditional=traditional,
                             base=None if log2_base is None else 2.0 ** log2_base,
                             scale=scale, offset=offset, freqs=freqs)
        out.append(x)
    return out


def probe_part(shape: tuple[int, ...], D: int, dtype: mx.Dtype, weighted: bool, normed: bool,
               rotate: bool, key: mx.array, weight_key: mx.array) -> HeadPart:
    """A self-check's part: random heads of ``shape`` (``[B, L, H, W]``), a norm weight of
    ``D`` near 1 where ``weighted``, eps 1e-6 where ``normed``."""
    x = (3.0 * mx.random.normal(shape, key=key)).astype(dtype)
    w = (1.0 + 0.1 * mx.random.normal((D,), key=weight_key)).astype(dtype) if weighted \
        else None
    return x, w, 1e-6 if normed else None, rotate


def probe_rotation(dims: int, traditional: bool, by_freqs: bool, scale: float) -> Rotation:
    """A self-check's rotation: base 10000, as periods (``by_freqs``) or as its log2."""
    freqs = 10000.0 ** (mx.arange(0, dims, 2, dtype=mx.float32) / dims) if by_freqs else None
    return dims, traditional, None if by_freqs else math.log2(10000.0), scale, freqs


def probe_offsets(batch: int) -> mx.array:
    """A self-check's positions: one offset, or one a sequence (at most two)."""
    return mx.array([37, 1000][:batch], dtype=mx.int32)


def _heads_serve(case: tuple[Any, ...]) -> bool:
    dtype, D, positions, per_sequence, shapes, dims, traditional, by_freqs, scale = case
    B = 2 if per_sequence else 1
    L = positions or MAX_HEAD_POSITIONS + 3  # (a length past the constant ones: a prompt's)

    def probe() -> tuple[list[HeadPart], Rotation, mx.array]:
        keys = [mx.random.key(4811 + i) for i in range(2 * len(shapes) + 1)]
        parts = [probe_part((B, L, heads, D + extra), D, dtype, weighted, normed, rotate,
                            keys[2 * i], keys[2 * i + 1])
                 for i, (heads, extra, _start, weighted, normed, rotate) in enumerate(shapes)]
        return parts, probe_rotation(dims, traditional, by_freqs, scale), probe_offsets(B)

    starts = [shape[2] for shape in shapes]
    return serves("norms", ("heads", *case),
                  lambda p: _launch_heads(p[0], p[1], p[2], D, starts, positions, case),
                  lambda p: _reference_heads(p[0], p[1], p[2], D, starts), probe,
                  TOLERANCE[dtype],
                  source=kernel_code(__file__))


# ---------------------------------------------------------------------------------------
# a post-norm's residual add
# ---------------------------------------------------------------------------------------

def fused_add_norm(residual: mx.array, x: mx.array, weight: mx.array, eps: float,
                   scale: mx.array | None) -> mx.array | None:
    """``(residual + rms_norm(x, weight, eps)) * scale`` in one launch; None where the
    kernel does not serve this case."""
    if x.ndim == 0 or x.size > MAX_ADD_ROWS * x.shape[-1] or not kernel_allowed("norms") \
            or x.dtype not in FLOATS:
        return None
    D = x.shape[-1]
    rows = x.size // D if D else 0
    if residual.shape != x.shape or residual.dtype != x.dtype or weight.shape != (D,) \
            or weight.dtype != x.dtype or rows == 0 \
            or (scale is not None and (scale.size != 1 or scale.dtype != x.dtype)):
        return None
    if not _add_norm_serves(x.dtype, D, scale is not None):
        return None
    return _launch_add_norm(residual, x, weight, eps, scale)


def _launch_add_norm(residual: mx.array, x: mx.array, weight: mx.array, eps: float,
                     scale: mx.array | None) -> mx.array:
    D = x.shape[-1]
    return _add_norm(
        inputs=[x, weight, residual,
                x.dtype if scale is None else one_entry(scale),  # (absent: CudaKernel)
                constant((eps,), mx.float32)],
        template=[("T", x.dtype), ("D", D), ("NT", ADD_THREADS), ("SCALE", scale is not None)],
        grid=(ADD_THREADS * (x.size // D), 1, 1), threadgroup=(ADD_THREADS, 1, 1),
        output_shapes=[x.shape], output_dtypes=[x.dtype])[0]


def _reference_add_norm(residual: mx.array, x: mx.array, weight: mx.array, eps: float,
                       scale: mx.array | None) -> mx.array:
    out = residual + mx.fast.rms_norm(x, weight, eps)
    return out if scale is None else out * scale


def _add_norm_serves(dtype: mx.Dtype, D: int, scaled: bool) -> bool:
    def probe() -> tuple[mx.array, mx.array, mx.array, float, mx.array | None]:
        keys = [mx.random.key(4911 + i) for i in range(4)]
        x = (4.0 * mx.random.normal((3, D), key=keys[0])).astype(dtype)
        r = mx.random.normal((3, D), key=keys[1]).astype(dtype)
        w = (1.0 + 0.1 * mx.random.normal((D,), key=keys[2])).astype(dtype)
        s = (0.5 + mx.random.uniform(shape=(1,), key=keys[3])).astype(dtype) if scaled else None
        return r, x, w, 1e-6, s

    return serves("norms", ("add", dtype, D, scaled), lambda p: _launch_add_norm(*p),
                  lambda p: _reference_add_norm(*p), probe, TOLERANCE[dtype],
                  source=kernel_code(__file__))
