"""A fused CUDA kernel for Gemma 4's sandwich norms, with a checked fallback.

Gemma 4 normalises a sublayer's output before adding it to the residual stream
(``h = residual + rms_norm(x) * w``, sometimes times ``layer_scalar``) and then, most
often, normalises the new ``h`` for the next sublayer. Through MLX that is two or three
kernels (the fast RMSNorm is opaque to ``mx.compile``, so the add cannot join it); a
decode step of a small model is bound by its number of kernels, and this pattern comes
three times a layer. ``norm_add`` does it in one launch: one thread block per row.

The kernel runs only on MLX's CUDA backend, for up to ``MAX_ROWS`` rows, and only after
a self-check: on the first use
for a row count, width, dtypes and variant it runs beside the MLX composition on random
inputs; any error or mismatch turns it off for that case (one warning) and the
composition runs instead. ``MLXRUNNER_GEMMA4_CUDA_KERNELS=0`` turns it off. Traced
forwards call :func:`prepare` first, so no self-check runs inside a trace.
"""

from __future__ import annotations

from functools import cache, partial
from typing import Any

import mlx.core as mx

from mlxrunner import check_kernel, on_cuda, switch_allows

ENV_SWITCH = "MLXRUNNER_GEMMA4_CUDA_KERNELS"
KERNELS = ("norm_add", "heads")  # the names ENV_SWITCH takes

# Template constants: H (row width), NT (threads per block), SCALED (multiply h by
# scalar[0]), SECOND (also write rms_norm(h) * w2), EPS_E9 (the epsilon times 1e9); type T
# of the activations. Every value is rounded to T where MLX's composition rounds it (its
# RMSNorm kernel multiplies the weight, as T, by the normalised value rounded to T; the
# add and the scaling round to T), so only the order of the sums of squares differs.
# The sum of one float per thread over the block, for every thread (after the kWarps, red,
# lane and warp declarations of a kernel).
_BLOCK_SUM = r"""
    auto block_sum = [&](float s) -> float {
        for (int o = 16; o > 0; o >>= 1) {
            s += __shfl_xor_sync(0xffffffff, s, o);
        }
        if (lane == 0) {
            red[warp] = s;
        }
        __syncthreads();
        float total = 0.f;
        for (int w = 0; w < kWarps; ++w) {
            total += red[w];
        }
        __syncthreads();
        return total;
    };
"""

NORM_ADD_SOURCE = r"""
    constexpr int kWarps = NT / 32;
    const float eps = EPS_E9 * 1e-9f;
    const int row = blockIdx.x;
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    __shared__ float red[kWarps];
""" + _BLOCK_SUM + r"""
    // as MLX's RMSNorm: the normalised value rounded to T, times the weight (as T), in T
    auto mul = [&](float weight, float normalised) -> T {
        return static_cast<T>(static_cast<float>(static_cast<T>(weight)) *
                              static_cast<float>(static_cast<T>(normalised)));
    };
    const T* xr = x + (size_t)row * H;
    const T* rr = residual + (size_t)row * H;
    T* hr = h_out + (size_t)row * H;
    float ss = 0.f;
    for (int i = tid; i < H; i += NT) {
        const float v = static_cast<float>(xr[i]);
        ss += v * v;
    }
    const float rstd = rsqrtf(block_sum(ss) / H + eps);
    float ss2 = 0.f;
    for (int i = tid; i < H; i += NT) {
        const T y = mul(static_cast<float>(w[i]), static_cast<float>(xr[i]) * rstd);
        T h = static_cast<T>(static_cast<float>(rr[i]) + static_cast<float>(y));
        if (SCALED) {
            h = static_cast<T>(static_cast<float>(h) * static_cast<float>(scalar[0]));
        }
        hr[i] = h;
        const float f = static_cast<float>(h);
        ss2 += f * f;
    }
    if (SECOND) {
        const float rstd2 = rsqrtf(block_sum(ss2) / H + eps);
        T* nr = normed_out + (size_t)row * H;
        for (int i = tid; i < H; i += NT) {
            nr[i] = mul(static_cast<float>(w2[i]), static_cast<float>(hr[i]) * rstd2);
        }
    }
"""

_THREADS = 256
#: The kernel serves decode steps and verify blocks, where launches are the cost; longer
#: forwards (prompts) are bound by their matmuls and keep MLX's operations.
MAX_ROWS = 64
_kernel: Any = None
_verdicts: dict[tuple[Any, ...], bool] = {}


@partial(mx.compile, shapeless=True)
def _residual_scaled(h: mx.array, x: mx.array, scalar: mx.array) -> mx.array:
    return (h + x) * scalar


def reference(x: mx.array, residual: mx.array, weight: mx.array, eps: float,
              scalar: mx.array | None = None, second: mx.array | None = None,
              eps2: float | None = None) -> tuple[mx.array, mx.array | None]:
    """The MLX composition the kernel replaces: ``h = residual + rms_norm(x) * weight``
    (times ``scalar``), and ``rms_norm(h) * second`` where a second weight is given."""
    y = mx.fast.rms_norm(x, weight, eps)
    h = residual + y if scalar is None else _residual_scaled(residual, y, scalar)
    normed = None if second is None else mx.fast.rms_norm(
        h, second, eps if eps2 is None else eps2)
    return h, normed


cuda_backend = on_cuda  # (tests stand in for it here)


def kernel_on(name: str) -> bool:
    """Whether this plugin's fused kernel ``name`` ('norm_add', 'heads') may run: on
    the CUDA backend and not switched off by ``ENV_SWITCH`` ("0": none; a comma-separated
    list of names: only those; unset or "1": all)."""
    return cuda_backend() and switch_allows(ENV_SWITCH, name, KERNELS)


def _launch(x: mx.array, residual: mx.array, weight: mx.array, eps: float,
            scalar: mx.array | None, second: mx.array | None) -> tuple[mx.array, mx.array | None]:
    global _kernel
    if _kernel is None:
        _kernel = mx.fast.cuda_kernel(
            name="gemma4_norm_add", input_names=["x", "residual", "w", "scalar", "w2"],
            output_names=["h_out", "normed_out"], source=NORM_ADD_SOURCE)
    width = x.shape[-1]
    rows = x.size // width
    h, normed = _kernel(
        inputs=[x, residual, weight, weight[:1] if scalar is None else scalar,
                weight if second is None else second],
        template=[("T", x.dtype), ("H", width), ("NT", _THREADS),
                  ("SCALED", scalar is not None), ("SECOND", second is not None),
                  ("EPS_E9", round(eps * 1e9))],
        grid=(_THREADS * rows, 1, 1), threadgroup=(_THREADS, 1, 1),
        output_shapes=[x.shape, x.shape if second is not None else (1,)],
        output_dtypes=[x.dtype, x.dtype])
    return h, (normed if second is not None else None)


def _key(x: mx.array, residual: mx.array, weight: mx.array, scalar: mx.array | None,
         second: mx.array | None, eps: float, eps2: float | None) -> tuple[Any, ...] | None:
    """The case a verdict is kept for, or None where the kernel cannot apply."""
    if not kernel_on("norm_add"):
        return None
    if eps2 is not None and eps2 != eps:
        return None
    if x.shape != residual.shape or x.dtype != residual.dtype or x.ndim < 1:
        return None
    if x.dtype not in (mx.float32, mx.float16, mx.bfloat16):
        return None
    if scalar is not None and (scalar.size != 1 or scalar.dtype != x.dtype):
        return None
    width = x.shape[-1]
    if weight.shape != (width,) or (second is not None and second.shape != (width,)):
        return None
    if x.size // width > MAX_ROWS:
        return None
    return (x.size // width, width, x.dtype, weight.dtype,
            None if second is None else second.dtype, scalar is not None, eps)


def _tolerance(dtype: mx.Dtype) -> float:
    return 1e-4 if dtype == mx.float32 else 5e-2


def _self_check(x: mx.array, residual: mx.array, weight: mx.array, eps: float,
                scalar: mx.array | None, second: mx.array | None) -> bool:
    keys = mx.random.split(mx.random.key(4321), 2)
    px = (4 * mx.random.normal(x.shape, key=keys[0])).astype(x.dtype)
    pr = mx.random.normal(x.shape, key=keys[1]).astype(x.dtype)
    return check_kernel("mlxrunner-gemma4: fused norm kernel",
                        lambda: _launch(px, pr, weight, eps, scalar, second),
                        lambda: reference(px, pr, weight, eps, scalar, second),
                        _tolerance(x.dtype))


def _usable(x: mx.array, residual: mx.array, weight: mx.array, eps: float,
            scalar: mx.array | None, second: mx.array | None, eps2: float | None) -> bool:
    key = _key(x, residual, weight, scalar, second, eps, eps2)
    if key is None:
        return False
    verdict = _verdicts.get(key)
    if verdict is None:
        verdict = _verdicts[key] = _self_check(x, residual, weight, eps, scalar, second)
    return verdict


def prepare(x: mx.array, residual: mx.array, weight: mx.array, eps: float,
            scalar: mx.array | None = None, second: mx.array | None = None,
            eps2: float | None = None) -> bool:
    """Settle the verdict for arrays of these shapes and dtypes now (eagerly: a traced
    forward must not run the self-check, an evaluation, while it is being traced)."""
    return _usable(x, residual, weight, eps, scalar, second, eps2)


def norm_add(x: mx.array, residual: mx.array, weight: mx.array, eps: float,
             scalar: mx.array | None = None, second: mx.array | None = None,
             eps2: float | None = None) -> tuple[mx.array, mx.array | None]:
    """``h = residual + rms_norm(x) * weight`` (times ``scalar``, one value) and, with a
    ``second`` weight, ``rms_norm(h) * second``: one fused kernel where it applies and has
    passed its self-check, else :func:`reference`."""
    if _usable(x, residual, weight, eps, scalar, second, eps2):
        return _launch(x, residual, weight, eps, scalar, second)
    return reference(x, residual, weight, eps, scalar, second, eps2)


# -- attention heads: norms and RoPE in one launch ----------------------------------------------

# One block per (row, head) of a layer's projection rows ``[B * L, P]`` holding HQ query, HK
# key and HV value heads of D values, in that order. Every head is normalised over D without
# a weight (rounded to T, as MLX's RMSNorm); query and key heads are then multiplied by their
# norm weight (in T) and rotated (MLX's non-traditional RoPE over all D dims: pairs
# (i, i + D/2) at angle (position + l) * inv_freq[i]; a zero frequency leaves the pair as
# is), value heads are written as they are. KV_FROM_K: the values are the key heads'
# weightless norms (Gemma's K=V layers). Outputs ``[B, heads, L, D]``; the block length L is
# an input (``seq``), not a template constant.
HEADS_SOURCE = r"""
    constexpr int kWarps = NT / 32;
    const int L = seq[0];  // an input, so one build serves every block length
    constexpr int kHeads = HQ + HK + HV;
    constexpr int kHalf = D / 2;
    const float eps = EPS_E9 * 1e-9f;
    const int block = blockIdx.x;
    const int head = block % kHeads;
    const int bl = block / kHeads;  // b * L + l
    const int b = bl / L;
    const int l = bl % L;
    const int t = threadIdx.x;
    const int lane = t & 31;
    const int warp = t >> 5;
    __shared__ float red[kWarps];
    __shared__ float weighted[D];
""" + _BLOCK_SUM + r"""
    const T* src = rows + (size_t)bl * P + (size_t)head * D;
    const float x = t < D ? static_cast<float>(src[t]) : 0.f;
    const float total = block_sum(x * x);
    const float plain = static_cast<float>(static_cast<T>(x * rsqrtf(total / D + eps)));
    const bool rotated = head < HQ + HK;
    float n = plain;
    if (rotated && t < D) {
        const float weight = static_cast<float>(static_cast<T>(
            static_cast<float>(head < HQ ? q_weight[t] : k_weight[t])));
        n = static_cast<float>(static_cast<T>(weight * plain));
        weighted[t] = n;
    }
    __syncthreads();
    if (t < D) {
        if (rotated) {
            const int i = t < kHalf ? t : t - kHalf;
            const float angle = static_cast<float>(position[0] + l) * inv_freq[i];
            const float c = cosf(angle);
            const float sn = sinf(angle);
            const T out = static_cast<T>(t < kHalf ? n * c - weighted[t + kHalf] * sn
                                                   : weighted[t - kHalf] * sn + n * c);
            if (head < HQ) {
                q_out[(((size_t)b * HQ + head) * L + l) * D + t] = out;
            } else {
                const size_t at = (((size_t)b * HK + (head - HQ)) * L + l) * D + t;
                k_out[at] = out;
                if (KV_FROM_K) {
                    v_out[at] = static_cast<T>(plain);
                }
            }
        } else {
            v_out[(((size_t)b * HV + (head - HQ - HK)) * L + l) * D + t] = static_cast<T>(plain);
        }
    }
"""

@cache
def _length(L: int) -> mx.array:
    """A block length as the head kernel's ``seq`` input (made once per length)."""
    length = mx.array([L], dtype=mx.int32)
    mx.eval(length)
    return length


_heads_kernel: Any = None
_heads_verdicts: dict[tuple[Any, ...], bool] = {}


def _heads_launch(rows: mx.array, q_weight: mx.array, k_weight: mx.array | None,
                  inv_freq: mx.array, position: mx.array, counts: tuple[int, int, int, bool],
                  head_dim: int, eps: float, B: int, L: int) -> tuple[mx.array | None, ...]:
    global _heads_kernel
    if _heads_kernel is None:
        _heads_kernel = mx.fast.cuda_kernel(
            name="gemma4_heads_norm_rope",
            input_names=["rows", "q_weight", "k_weight", "inv_freq", "position", "seq"],
            output_names=["q_out", "k_out", "v_out"], source=HEADS_SOURCE)
    hq, hk, hv, kv_from_k = counts
    values = hk if kv_from_k else hv
    threads = 32 * -(-head_dim // 32)

    def shape(heads: int) -> tuple[int, ...]:
        return (B, heads, L, head_dim) if heads else (1,)

    q, k, v = _heads_kernel(
        inputs=[rows, q_weight, q_weight if k_weight is None else k_weight, inv_freq,
                position, _length(L)],
        template=[("T", rows.dtype), ("HQ", hq), ("HK", hk), ("HV", hv),
                  ("KV_FROM_K", kv_from_k), ("D", head_dim), ("P", rows.shape[-1]),
                  ("NT", threads), ("EPS_E9", round(eps * 1e9))],
        grid=(threads * B * L * (hq + hk + hv), 1, 1), threadgroup=(threads, 1, 1),
        output_shapes=[shape(hq), shape(hk), shape(values)],
        output_dtypes=[rows.dtype] * 3)
    return q, (k if hk else None), (v if values else None)


def heads_usable(rows: mx.array, q_weight: mx.array, k_weight: mx.array | None,
                 inv_freq: mx.array, counts: tuple[int, int, int, bool], head_dim: int,
                 eps: float, B: int, L: int, reference: Any) -> bool:
    """Whether :func:`heads_norm_rope` runs the kernel for arrays like these: it applies
    (CUDA, up to ``MAX_ROWS`` rows) and passed its self-check against
    ``reference(rows, position) -> (q, k, v)`` (MLX's operations), run eagerly on the first
    call per shape, dtypes and layout; call it before tracing."""
    if not kernel_on("heads"):
        return False
    hq, hk, hv, _ = counts
    if (rows.ndim != 2 or rows.shape[0] != B * L or B * L > MAX_ROWS or head_dim % 2
            or not 0 < head_dim <= 1024 or rows.shape[1] != (hq + hk + hv) * head_dim
            or rows.dtype not in (mx.float32, mx.float16, mx.bfloat16)):
        return False
    key = (rows.shape, rows.dtype, q_weight.dtype, None if k_weight is None else k_weight.dtype,
           counts, head_dim, eps, B, L)
    verdict = _heads_verdicts.get(key)
    if verdict is None:
        probe = mx.random.normal(rows.shape, key=mx.random.key(77)).astype(rows.dtype)
        # a 0-d position for MLX's rope: a (1,)-shaped one reads as one offset per batch row
        # on CUDA (Qwen's q/k check saw rows past the first rotate by garbage at B = 4)
        position = mx.array(1234, dtype=mx.int32)
        verdict = _heads_verdicts[key] = check_kernel(
            "mlxrunner-gemma4: fused attention-head kernel",
            lambda: _heads_launch(probe, q_weight, k_weight, inv_freq, position.reshape(1),
                                  counts, head_dim, eps, B, L),
            lambda: reference(probe, position), _tolerance(rows.dtype))
    return verdict


def heads_norm_rope(rows: mx.array, q_weight: mx.array, k_weight: mx.array | None,
                    inv_freq: mx.array, position: mx.array,
                    counts: tuple[int, int, int, bool], head_dim: int, eps: float, B: int,
                    L: int) -> tuple[mx.array | None, ...]:
    """q, k, v ``[B, heads, L, D]`` (k and v None where the layer has none) from projection
    rows ``[B * L, (HQ + HK + HV) * D]`` (only where :func:`heads_usable` said yes)."""
    return _heads_launch(rows, q_weight, k_weight, inv_freq, position, counts, head_dim, eps,
                         B, L)
