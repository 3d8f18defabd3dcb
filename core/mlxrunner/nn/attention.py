"""Attention of a short block of queries (decode steps, verify blocks, draft blocks) over
cache buffers, for architecture and draft plugins.

MLX's fused attention (``mx.fast.scaled_dot_product_attention``) has no kernel on MLX
0.32's CUDA backend for these shapes (one or a few queries, grouped-query heads, a
boolean mask, head dims 256 and 512: checked with ``force_fused=True``), so it falls back
to operations that broadcast the keys over each group's query heads in a batched matmul
(query heads ``[B, Hk, rep, L, D]`` against keys ``[B, Hk, 1, S, D]``). On CUDA,
:func:`attend` instead folds a group's query heads into the rows of one plain batched
matmul (``[B, Hk, rep * L, D]`` against ``[B, Hk, S, D]``): the same arithmetic (the
query scaled first, a float32 softmax, the products in the inputs' type) with no
broadcast batch; or, where it passed its self-check (:func:`prepare_attend`, called
before tracing), as one fused kernel: a thread block per query row and run of its keys
(split so that a decode step's few rows fill the GPU), its warps taking keys in turn with
an online softmax, the runs merged by the block that finishes a row last. A longer block
(a prompt's) is MLX's function where MLX has a fused kernel for it, else folded too (MLX's
own operations would build a causal mask and scale the queries at every layer). Off CUDA,
it is MLX's function. ``MLXRUNNER_ATTENTION``
(:mod:`mlxrunner.settings`): ``kernel`` (the default), ``folded`` (never the kernel) or
``mlx`` (always MLX's function), to compare.

:func:`store` files a layer's new keys and values in its cache and returns what the layer's
queries attend over, with the mask that goes with it: the one way an architecture reaches
its cache, whatever the cache kind, and inside a traced forward too.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import mlx.core as mx

from .. import settings
from ..cache.frame import active_frame
from ..constants import constant, window_mask
from . import cuda_norms
from .cuda_build import BLOCK_REDUCE, CudaKernel, block_counters, kernel_code
from .cuda_norms import HeadSource
from .host_ops import host_attention
from .kernels import kernel_allowed, on_cuda, serves

#: MLX's function, as imported (while a thread traces a forward, the core routes calls of
#: ``mx.fast.scaled_dot_product_attention`` from that thread through :func:`attend`)
mlx_attention = mx.fast.scaled_dot_product_attention
#: the longest query block :func:`attend` folds or fuses whatever its head size (longer
#: ones are prompts)
FOLD_MAX_QUERIES = 16
#: the widest query and value heads MLX's CUDA backend attends over with a fused kernel
#: (cuDNN's, for a prompt); past it MLX runs its own operations, which :func:`attend`
#: folds instead (one launch a prompt for its causal mask, not three a layer; no scaling
#: where the scale is 1)
MLX_FUSED_HEAD_DIM = 128


def mode() -> str:
    """How short blocks attend on CUDA: ``kernel``, ``folded`` or ``mlx``."""
    return settings.current().attention


class KV(NamedTuple):
    """What a layer's queries attend over: keys ``[B, Hk, S, D]``, values ``[B, Hk, S, Dv]``
    and the mask for :func:`attend` (None, "causal", a boolean ``[L, S]`` array, or
    ``[B, 1, L, S]`` from a batch of sequences: mlxrunner.cache.batched). A layer
    that shares another layer's keys and values reuses that layer's ``KV``."""

    keys: mx.array
    values: mx.array
    mask: mx.array | str | None


class AttentionCache(Protocol):
    """What :func:`store` needs of a cache: a :class:`KVCache` or a :class:`RingCache` (or
    their stand-ins in a traced forward)."""

    def mask(self, n: int) -> mx.array | str | None: ...

    def update_and_fetch(self, keys: mx.array,
                         values: mx.array) -> tuple[mx.array, mx.array]: ...


def store(cache: AttentionCache | None, keys: mx.array, values: mx.array,
          window: int | None = None) -> KV:
    """File new keys and values ``[B, Hk, L, D]`` in ``cache`` (a KV cache or a ring) and
    return all its keys and values with the causal mask of the ``L`` new queries over
    them. Without a cache the block attends over itself (``window``: a sliding window,
    which a ring otherwise knows)."""
    n = keys.shape[2]
    if cache is None:
        return KV(keys, values, _causal(n, window))
    mask = cache.mask(n)  # before the write: a ring's mask depends on what it held
    fresh = getattr(cache, "fresh_length", None)
    length = None if fresh is None or n == 1 else fresh(n)
    buffers = None if length is None else fresh_buffers(keys, values, length)
    if buffers is not None:
        keys, values = cache.adopt_fresh(*buffers, n)  # type: ignore[attr-defined]
    else:
        keys, values = cache.update_and_fetch(keys, values)
    return KV(keys, values, mask)


# A first write's buffers: keys (blockIdx.y 0) and values (1) ``[B, H, n, W]`` into
# ``[B, H, S, W]``, zero past position n (dims: B, n, S at run time; one build a layer
# shape for every prompt length). A thread an entry, the blocks striding over them.
FRESH_SOURCE = r"""
    const int B = dims[0], n = dims[1], S = dims[2];
    const bool value_part = blockIdx.y == 1;
    const T* const x = value_part ? v : k;
    T* const y = value_part ? v_out : k_out;
    const int W = value_part ? WV : WK;
    const size_t total = (size_t)B * (value_part ? HV : HK) * S * W;
    for (size_t i = (size_t)blockIdx.x * NT + threadIdx.x; i < total;
         i += (size_t)gridDim.x * NT) {
        const size_t row = i / W;  // (b * H + h) * S + s
        const int s = static_cast<int>(row % S);
        y[i] = s < n ? x[((row / S) * n + s) * W + i % W] : T{};
    }
"""
FRESH_THREADS = 256
FRESH_MAX_BLOCKS = 1024
_fresh_kernel = CudaKernel(name="mlxrunner_fresh_kv", input_names=["k", "v", "dims"],
                           output_names=["k_out", "v_out"], source=FRESH_SOURCE)


def fresh_buffers(keys: mx.array, values: mx.array, length: int
                  ) -> tuple[mx.array, mx.array] | None:
    """``keys`` and ``values`` ``[B, H, n, W]`` in buffers of ``length`` positions, zero
    past ``n``: a cache's first write (a prompt's first chunk) in one launch on CUDA where
    MLX's operations take four (two zero fills, two writes); None where the kernel does
    not serve the case (the cache then writes them itself)."""
    if not kernel_allowed("attention"):
        return None
    if keys.ndim != 4 or values.ndim != 4 or keys.shape[:1] + keys.shape[2:3] \
            != values.shape[:1] + values.shape[2:3] or keys.dtype != values.dtype \
            or keys.dtype not in (mx.float32, mx.float16, mx.bfloat16) \
            or not 0 < keys.shape[2] <= length:
        return None
    case = (keys.dtype, keys.shape[1], keys.shape[3], values.shape[1], values.shape[3])
    if not _fresh_serves(case):
        return None
    return _launch_fresh(keys, values, length)


def _launch_fresh(keys: mx.array, values: mx.array, length: int
                  ) -> tuple[mx.array, mx.array]:
    B, Hk, n, Wk = keys.shape
    Hv, Wv = values.shape[1], values.shape[3]
    total = B * max(Hk * Wk, Hv * Wv) * length
    blocks = min(FRESH_MAX_BLOCKS, -(-total // FRESH_THREADS))
    k_out, v_out = _fresh_kernel(
        inputs=[keys, values, constant((B, n, length), mx.int32)],
        template=[("T", keys.dtype), ("HK", Hk), ("WK", Wk), ("HV", Hv), ("WV", Wv),
                  ("NT", FRESH_THREADS)],
        grid=(FRESH_THREADS * blocks, 2, 1), threadgroup=(FRESH_THREADS, 1, 1),
        output_shapes=[(B, Hk, length, Wk), (B, Hv, length, Wv)],
        output_dtypes=[keys.dtype, keys.dtype])
    return k_out, v_out


def _reference_fresh(keys: mx.array, values: mx.array, length: int
                     ) -> tuple[mx.array, mx.array]:
    """What MLX's operations make of a first write (the check's reference)."""
    def padded(x: mx.array) -> mx.array:
        B, H, n, W = x.shape
        return mx.concatenate([x, mx.zeros((B, H, length - n, W), x.dtype)], axis=2)
    return padded(keys), padded(values)


def _fresh_serves(case: tuple[Any, ...]) -> bool:
    dtype, Hk, Wk, Hv, Wv = case

    def probe() -> tuple[mx.array, mx.array, int]:
        # (two sequences, a length past a block's entries and a buffer not a multiple of it)
        parts = [mx.random.key(3301 + i) for i in range(2)]
        return (mx.random.normal((2, Hk, 37, Wk), key=parts[0]).astype(dtype),
                mx.random.normal((2, Hv, 37, Wv), key=parts[1]).astype(dtype), 67)

    return serves("attention", ("fresh", *case), lambda p: _launch_fresh(*p),
                  lambda p: _reference_fresh(*p), probe, 0.0, source=kernel_code(__file__))


def _causal(n: int, window: int | None) -> mx.array | str | None:
    if n == 1:
        return None
    if window is None or n <= window:
        return "causal"
    return window_mask(0, n, window)


_cuda_default = on_cuda  # (tests stand in for it here)


def _short_block_on_cuda(q: mx.array, keys: mx.array, mask: mx.array | str | None) -> bool:
    """Whether :func:`attend` may take this case off MLX's function: CUDA, a short query
    block, whole groups of query heads, no mask or a boolean one of at most two dims or
    one per batch row (``[B, 1, L, S]``: a batch of sequences of their own lengths)."""
    return (_cuda_default() and q.ndim == 4 and q.shape[2] <= FOLD_MAX_QUERIES
            and keys.ndim == 4 and q.shape[1] % keys.shape[1] == 0
            and (mask is None or (isinstance(mask, mx.array) and mask.dtype == mx.bool_
                                  and (mask.ndim <= 2 or _per_row(mask)))))


def _per_row(mask: mx.array) -> bool:
    return mask.ndim == 4 and mask.shape[1] == 1


def _long_block_unfused_on_cuda(q: mx.array, keys: mx.array, values: mx.array,
                                mask: mx.array | str | None) -> bool:
    """Whether a longer block (a prompt's) is one MLX's CUDA backend has no fused kernel for
    (heads wider than ``MLX_FUSED_HEAD_DIM``), which :func:`attend` folds: whole groups of
    query heads, no mask, ``causal`` or a boolean mask as the short blocks take."""
    return (_cuda_default() and q.ndim == 4 and keys.ndim == 4 and values.ndim == 4
            and q.shape[2] > FOLD_MAX_QUERIES and q.shape[1] % keys.shape[1] == 0
            and max(q.shape[3], values.shape[3]) > MLX_FUSED_HEAD_DIM
            and (mask is None
                 or (isinstance(mask, str) and mask == "causal" and keys.shape[2] >= q.shape[2])
                 or (isinstance(mask, mx.array) and mask.dtype == mx.bool_
                     and (mask.ndim <= 2 or _per_row(mask)))))


def folded_attention(q: mx.array, keys: mx.array, values: mx.array, *, scale: float,
                     mask: mx.array | None = None) -> mx.array:
    """``softmax(q keys^T * scale, masked) values`` with each key/value head's query heads
    folded into the rows of one batched matmul (see the module). ``mask``: None, a
    boolean array broadcastable to ``[L, S]`` or one per batch row ``[B, 1, L, S]`` (True:
    attend); every query row must keep at least one key."""
    B, Hq, L, D = q.shape
    Hk, S = keys.shape[1], keys.shape[2]
    rep = Hq // Hk
    scaled = q if scale == 1.0 else q * mx.array(scale, dtype=q.dtype)  # (times 1: q)
    rows = scaled.reshape(B, Hk, rep * L, D)
    scores = rows @ keys.swapaxes(-1, -2)  # [B, Hk, rep * L, S]
    if mask is not None:
        # row r * L + l of a group is query head r at position l: the mask's row l
        grouped = scores.reshape(B, Hk, rep, L, S)
        if mask.ndim == 4:  # [B, 1, L, S]: the same for every head of a row
            mask = mask[:, :, None]
        scores = mx.where(mask, grouped, mx.array(-mx.inf, dtype=scores.dtype)).reshape(
            B, Hk, rep * L, S)
    probs = mx.softmax(scores, axis=-1, precise=True)
    return (probs @ values).reshape(B, Hq, L, values.shape[-1])


def attend(q: mx.array, keys: mx.array, values: mx.array, mask: mx.array | str | None = None,
           *, scale: float, gate: mx.array | None = None) -> mx.array:
    """Attention of queries ``q [B, Hq, L, D]`` over ``keys [B, Hk, S, D]`` and ``values
    [B, Hk, S, Dv]`` (query head ``h`` reads key/value head ``h // (Hq // Hk)``), as
    ``mx.fast.scaled_dot_product_attention`` with the same arguments; ``[B, Hq, L, Dv]``.
    ``attend(q, *store(cache, k, v), scale=...)`` attends over a layer's cache. ``gate``
    (``[B, Hq, L, Dv]``): the output times ``sigmoid(gate)``, a gated attention's output
    gate (in the fused kernel where it runs).

    Inside a traced forward the keys a cache stand-in handed out are a whole buffer: the
    mask becomes the one that makes attention over it what ``mask`` meant over the eager
    forward's keys (:meth:`mlxrunner.cache.TraceFrame.mask_for`)."""
    frame = active_frame()
    if frame is not None:
        mask = frame.mask_for(keys, mask)
    chosen = mode()
    if chosen != "mlx" and not isinstance(mask, str) and _short_block_on_cuda(q, keys, mask):
        fused_gate = gate is not None and gate.shape == (*q.shape[:3], values.shape[3]) \
            and gate.dtype == q.dtype
        heads = _query_heads(q, cuda_norms.head_source(q)) if chosen == "kernel" else None
        if heads is not None and not _kernel_serves(q, keys, values, mask, fused_gate, heads):
            heads = None
        if chosen == "kernel" and (heads is not None
                                   or _kernel_serves(q, keys, values, mask, fused_gate)):
            # (with heads: the queries made in the kernel, the launch that made q unread)
            out = _launch(q, keys, values, scale, mask, gate=gate if fused_gate else None,
                          heads=heads)
            if fused_gate:
                return out
        else:
            out = folded_attention(q, keys, values, scale=scale, mask=mask)
    elif chosen != "mlx" and _long_block_unfused_on_cuda(q, keys, values, mask):
        if isinstance(mask, str):  # causal: the queries are the keys' last L
            L, S = q.shape[2], keys.shape[2]
            mask = window_mask(S - L, L, S)  # (a window of all the keys: made once a shape)
        out = folded_attention(q, keys, values, scale=scale, mask=mask)
    else:
        hosted = host_attention(q, keys, values, mask, scale) if frame is None else None
        out = hosted if hosted is not None else \
            mlx_attention(q, keys, values, scale=scale, mask=mask)
    return out if gate is None else out * mx.sigmoid(gate)


# -- the fused kernel ---------------------------------------------------------------------

# One thread block per query row (b, h, l) of q [B, HQ, L, D] and run of its keys (all of
# them, or where SPLIT the p-th of P, see ATTEND_SOURCE); its warps take the run's keys of
# the row's key/value head in runs of U (warp w: keys w*U .. w*U+U-1, then kWarps*U further
# on), loading a run's key and value rows together so that U rows are in flight at once
# (a warp per key, one key at a time, left the loads' latency exposed: few blocks run a
# decode step, so the GPU time is that latency), each score the warp's dot product, kept as
# an online softmax (running maximum, sum, weighted values); the warps' partial results
# are merged at the end. Rounded as MLX's operations round (the scaled query and each score
# to T), except that the probabilities are not rounded to T before they weight the values.
# Template constants: HQ, HK, D, DV, NT (threads), U (keys a warp loads at once), MASK (0:
# none, 1: one row [S] for every query, 2: [L, S]), GATE (the output, rounded to T, times
# sigmoid(gate) computed in float32 and rounded to T, the product rounded: within a unit in
# the last place of MLX's sigmoid and multiply), SPLIT (P > 1), PMAX (the most splits); type
# T. ``dims`` = [L, S, P] (P: key splits). QH: q is the raw heads [B, L, HQ, QW] that a
# fused heads launch would have made the queries of (see :func:`_query_heads`), taking D
# entries of each from QC, with QNORM (0: none, 1: without weight, 2: with qw) of eps
# qeps[0], QROT (rotate QRD dims, interleaved pairs where QTRAD; periods 1 / qfreqs where
# QFREQS, else from log2(base) qrf[0]; position scale qrf[1]; offsets qoff, one a
# sequence where QPERB).
_ATTEND_BODY = r"""
    constexpr int kWarps = NT / 32;
    constexpr int QPL = (D + 31) / 32;
    constexpr int VPL = (DV + 31) / 32;
    const int L = dims[0];
    const int S = dims[1];
    const int P = dims[2];
    const int row = blockIdx.x;  // (b * HQ + h) * L + l
    const int chunk = (S + P - 1) / P;
    const int j_begin = P == 1 ? 0 : blockIdx.y * chunk;
    const int j_end = P == 1 ? S : min(S, j_begin + chunk);
    const int l = row % L;
    const int h = (row / L) % HQ;
    const int b = row / (L * HQ);
    const int hk = h / (HQ / HK);
    const int t = threadIdx.x;
    const int lane = t & 31;
    const int warp = t >> 5;
    __shared__ float part_m[kWarps];
    __shared__ float part_l[kWarps];
    __shared__ float part_acc[kWarps * DV];
    const float sc = static_cast<float>(static_cast<T>(scale[0]));
    float qv[QPL];
    if (!QH) {
        const T* qr = q + (size_t)row * D;
        for (int i = 0; i < QPL; ++i) {
            const int d = lane + 32 * i;
            qv[i] = d < D ? static_cast<float>(static_cast<T>(static_cast<float>(qr[d]) * sc))
                          : 0.f;
        }
    } else {
        // q holds the raw heads [B, L, HQ, QW]; the row's D entries from QC normalised and
        // rotated here as the heads kernel does them (cuda_norms.HEADS_SOURCE), by each
        // warp in its registers: a rotated pair's entries lie QRD / 2 apart, in one lane
        // (QRD / 2 a multiple of 32), or in neighbouring lanes (QTRAD)
        const T* xr = q + ((size_t)(b * L + l) * HQ + h) * QW + QC;
        constexpr int kHalf = QRD / 2;
        constexpr int kHalfRegs = kHalf / 32;
        float xv[QPL];
        T wq[QPL];
        float inv_freq[QPL];
        #pragma unroll
        for (int i = 0; i < QPL; ++i) {  // the row, its weights and periods loaded at once
            const int d = lane + 32 * i;
            xv[i] = d < D ? static_cast<float>(xr[d]) : 0.f;
            if (QNORM == 2) wq[i] = d < D ? qw[d] : T{};
            if (QROT) {
                const int pair = QTRAD ? d / 2 : (d < kHalf ? d : d - kHalf);
                inv_freq[i] = d >= QRD ? 0.f : (QFREQS
                    ? static_cast<float>(1.0 / static_cast<double>(qfreqs[pair]))
                    : exp2f(-(static_cast<float>(pair) / static_cast<float>(kHalf)) * qrf[0]));
            }
        }
        const float pos = QROT ? qrf[1] * static_cast<float>(qoff[QPERB ? b : 0] + l) : 0.f;
        if (QNORM) {
            float ss = 0.f;
            #pragma unroll
            for (int i = 0; i < QPL; ++i) ss += xv[i] * xv[i];
            for (int o = 16; o > 0; o >>= 1) ss += __shfl_xor_sync(0xffffffff, ss, o);
            const float inv = rsqrtf(ss / D + qeps[0]);
            #pragma unroll
            for (int i = 0; i < QPL; ++i) {
                const T xn = static_cast<T>(xv[i] * inv);
                xv[i] = QNORM == 2 ? static_cast<float>(static_cast<T>(
                            static_cast<float>(wq[i]) * static_cast<float>(xn)))
                                   : static_cast<float>(xn);
            }
        }
        #pragma unroll
        for (int i = 0; i < QPL; ++i) {
            const int d = lane + 32 * i;
            float r = xv[i];
            if (QROT) {
                float sn, cs;
                sincosf(pos * inv_freq[i], &sn, &cs);
                if (QTRAD) {
                    const float other = __shfl_xor_sync(0xffffffff, xv[i], 1);
                    if (d < QRD) {
                        r = static_cast<float>(static_cast<T>(
                            (d & 1) ? other * sn + xv[i] * cs : xv[i] * cs - other * sn));
                    }
                } else if (d < QRD) {
                    r = static_cast<float>(static_cast<T>(
                        i < kHalfRegs ? xv[i] * cs - xv[min(i + kHalfRegs, QPL - 1)] * sn
                                      : xv[max(i - kHalfRegs, 0)] * sn + xv[i] * cs));
                }
            }
            qv[i] = d < D ? static_cast<float>(static_cast<T>(r * sc)) : 0.f;
        }
    }
    const T* kb = keys + ((size_t)b * HK + hk) * S * D;
    const T* vb = values + ((size_t)b * HK + hk) * S * DV;
    float m = -3.0e38f;  // below any score: its weight underflows to 0
    float lsum = 0.f;
    float acc[VPL];
    for (int i = 0; i < VPL; ++i) {
        acc[i] = 0.f;
    }
    for (int j0 = j_begin + warp * U; j0 < j_end; j0 += kWarps * U) {
        bool live[U];
        float kx[U][QPL];
        float vx[U][VPL];
        // every key of the run loaded, masked or not, with its mask entry: a load that
        // waited on the mask's would cost the run a second round trip; a masked key's
        // values are selected away (its buffer rows may hold anything)
        for (int u = 0; u < U; ++u) {
            const int j = j0 + u;
            const int jr = min(j, j_end - 1);  // (a row of the buffer: past the run, unused)
            // the same for every lane of the warp
            live[u] = j < j_end && (MASK != 1 || mask[jr]) &&
                      (MASK != 2 || mask[(size_t)l * S + jr]);
            const T* kr = kb + (size_t)jr * D;
            const T* vr = vb + (size_t)jr * DV;
            for (int i = 0; i < QPL; ++i) {
                const int d = lane + 32 * i;
                kx[u][i] = d < D ? static_cast<float>(kr[d]) : 0.f;
            }
            for (int i = 0; i < VPL; ++i) {
                const int d = lane + 32 * i;
                vx[u][i] = d < DV ? static_cast<float>(vr[d]) : 0.f;
            }
        }
        for (int u = 0; u < U; ++u) {
            for (int i = 0; i < VPL; ++i) {
                vx[u][i] = live[u] ? vx[u][i] : 0.f;
            }
        }
        float s[U];
        float mn = m;
        for (int u = 0; u < U; ++u) {
            float x = 0.f;
            for (int i = 0; i < QPL; ++i) {
                x += qv[i] * kx[u][i];
            }
            for (int o = 16; o > 0; o >>= 1) {
                x += __shfl_xor_sync(0xffffffff, x, o);
            }
            s[u] = static_cast<float>(static_cast<T>(x));
            if (live[u]) {
                mn = fmaxf(mn, s[u]);
            }
        }
        const float corr = expf(m - mn);
        lsum *= corr;
        for (int i = 0; i < VPL; ++i) {
            acc[i] *= corr;
        }
        for (int u = 0; u < U; ++u) {
            const float p = live[u] ? expf(s[u] - mn) : 0.f;
            lsum += p;
            for (int i = 0; i < VPL; ++i) {
                acc[i] += p * vx[u][i];
            }
        }
        m = mn;
    }
    if (lane == 0) {
        part_m[warp] = m;
        part_l[warp] = lsum;
    }
    for (int i = 0; i < VPL; ++i) {
        const int d = lane + 32 * i;
        if (d < DV) {
            part_acc[warp * DV + d] = acc[i];
        }
    }
"""

# The warps' partial results merged: the block's maximum ``big``, sum ``total`` and, per
# value column d, weighted sum ``block_output(d)`` (its caller divides it by ``total``).
_BLOCK_MERGE = r"""    __syncthreads();
    float big = -3.0e38f;
    #pragma unroll 1
    for (int w = 0; w < kWarps; ++w) {
        big = fmaxf(big, part_m[w]);
    }
    float total = 0.f;
    #pragma unroll 1
    for (int w = 0; w < kWarps; ++w) {
        total += part_l[w] * expf(part_m[w] - big);
    }
    const auto block_output = [&](int d) {
        float o = 0.f;
        #pragma unroll 1
        for (int w = 0; w < kWarps; ++w) {
            o += part_acc[w * DV + d] * expf(part_m[w] - big);
        }
        return o;
    };
    // the row's output column d from its weighted sum (divided by the softmax's sum),
    // times sigmoid(gate) where GATE
    const auto write_out = [&](int d, float o) {
        const T a = static_cast<T>(o);
        if (GATE) {
            const float g = static_cast<float>(gate[(size_t)row * DV + d]);
            const T sig = static_cast<T>(1.f / (1.f + expf(-g)));
            out[(size_t)row * DV + d] = static_cast<T>(static_cast<float>(a) *
                                                       static_cast<float>(sig));
        } else {
            out[(size_t)row * DV + d] = a;
        }
    };
"""

# SPLIT (P > 1 runs of keys, block (row, p) the p-th): each block writes its normalised
# partial output, maximum and sum (float32, a run without a live key a zero sum), then
# counts itself out on the row's counter cnt[row]; the row's last block (whose count wraps
# the counter to 0 again, ready for the launch's next replay) merges the P partials,
# weighted by their share of the softmax's sum, into the row's output. A decode step has
# only B * heads rows: unsplit, a few blocks each walk the whole buffer, their loads'
# latency the step's time.
# A split launch's partials lie in its one float32 output ``parts`` (each output of a
# launch costs it host time): every (row, split)'s output rows, then its maxima, then its
# sums; gridDim.x rows, gridDim.y splits.
_PARTS = r"""
    float* const part_o = parts;
    float* const part_max = SPLIT ? parts + (size_t)gridDim.x * gridDim.y * DV : nullptr;
    float* const part_sum = SPLIT ? part_max + (size_t)gridDim.x * gridDim.y : nullptr;
"""
ATTEND_SOURCE = _PARTS + _ATTEND_BODY + _BLOCK_MERGE + BLOCK_REDUCE + r"""
    if (!SPLIT) {
        #pragma unroll 1
        for (int d = t; d < DV; d += NT) {
            write_out(d, block_output(d) / total);
        }
        return;
    }
    const size_t at = (size_t)row * P + blockIdx.y;
    #pragma unroll 1
    for (int d = t; d < DV; d += NT) {
        part_o[at * DV + d] = total > 0.f ? block_output(d) / total : 0.f;
    }
    if (t == 0) {
        part_max[at] = big;
        part_sum[at] = total;
    }
    __shared__ bool last;
    __threadfence();  // this block's partials, seen by the row's last block
    __syncthreads();
    if (t == 0) {
        unsigned int* count = (unsigned int*)cnt + row;  // (int32 counters)
        last = atomicInc(count, P - 1) == P - 1;
    }
    __syncthreads();
    if (!last) {
        return;
    }
    __threadfence();
    // the row's P partials, each weighted by its share of the softmax's sum: the weights
    // in shared memory (each partial's maximum and sum loaded by a thread, at once), then
    // the output columns' weighted partials, four columns a 16-byte load where DV allows,
    // the partials dealt over the block's threads in kSubsets interleaved subsets (P = 64
    // partials of 512 columns: 32 loads a thread, not 128) whose sums meet in part_acc
    const size_t first = (size_t)row * P;
    __shared__ float weight[PMAX];
    __shared__ float share[PMAX];
    float top = -3.0e38f;
    for (int p = t; p < P; p += NT) {
        weight[p] = __ldcg(part_max + first + p);
        share[p] = __ldcg(part_sum + first + p);
        top = fmaxf(top, weight[p]);
    }
    top = block_reduce(top, true, part_m);  // (part_m free: read before the count)
    float weights = 0.f;
    for (int p = t; p < P; p += NT) {
        weight[p] = share[p] * expf(weight[p] - top);
        weights += weight[p];
    }
    weights = block_reduce(weights, false, part_m);  // (its barriers: every weight written)
    if (DV % 4 == 0 && DV <= 4 * NT) {
        constexpr int kGroups = DV >= 4 ? DV / 4 : 1;  // (a constant for every DV)
        constexpr int kSubsets = NT / kGroups < kWarps ? NT / kGroups : kWarps;
        const int g = t % kGroups;
        const int sub = t / kGroups;
        if (sub < kSubsets) {  // (part_acc free: read before the count)
            float4 o = make_float4(0.f, 0.f, 0.f, 0.f);
            #pragma unroll 8
            for (int p = sub; p < P; p += kSubsets) {
                const float4 v = __ldcg(reinterpret_cast<const float4*>(
                    part_o + (first + p) * DV) + g);
                const float wp = weight[p];
                o.x += wp * v.x;
                o.y += wp * v.y;
                o.z += wp * v.z;
                o.w += wp * v.w;
            }
            float* sums = part_acc + sub * DV + 4 * g;
            sums[0] = o.x;
            sums[1] = o.y;
            sums[2] = o.z;
            sums[3] = o.w;
        }
        __syncthreads();
        #pragma unroll 1
        for (int d = t; d < DV; d += NT) {
            float o = 0.f;
            for (int u = 0; u < kSubsets; ++u) {
                o += part_acc[u * DV + d];
            }
            write_out(d, o / weights);
        }
        return;
    }
    #pragma unroll 1
    for (int d = t; d < DV; d += NT) {
        float o = 0.f;
        #pragma unroll 8
        for (int p = 0; p < P; ++p) {
            o += weight[p] * __ldcg(part_o + (first + p) * DV + d);
        }
        write_out(d, o / weights);
    }
"""

#: threads a block: one query row's whole buffer, or (split) one run of its keys
ATTEND_THREADS = 512
SPLIT_THREADS = 256


def keys_at_once(head_dim: int, value_dim: int) -> int:
    """The kernel's U: keys a warp loads together, as many as keep a lane's loaded rows
    within 64 floats (registers: 512 threads leave a thread 128)."""
    per_key = (head_dim + 31) // 32 + (value_dim + 31) // 32
    return max(1, min(8, 64 // per_key))


_kernel: Any = None

#: splits aim at no more than this many blocks in all, each run at least MIN_SPLIT_KEYS
#: keys long (a run of that many takes a split block's warps one or two loads each)
SPLIT_BLOCKS = 512
MIN_SPLIT_KEYS = 32


def key_splits(rows: int, keys: int) -> int:
    """How many runs of keys each query row's attention splits into (1: no split): as many
    as fill the GPU with blocks, none shorter than ``MIN_SPLIT_KEYS``."""
    splits = max(1, min(SPLIT_BLOCKS // max(rows, 1), keys // MIN_SPLIT_KEYS))
    run = -(-keys // splits)  # the kernel's run length: as few runs as cover the keys
    return -(-keys // run) if keys else 1


def _mask_kind(mask: mx.array | None) -> int:
    return 0 if mask is None else mask.ndim


def _case(q: mx.array, keys: mx.array, values: mx.array, mask: mx.array | None,
          gated: bool = False, heads: HeadSource | None = None) -> tuple[Any, ...]:
    """What a verdict is kept for: head counts and sizes, the dtype, the mask's kind, the
    block length, whether keys are split (any batch and buffer length), whether an output
    gate is fused and what of the query's heads work the kernel does (``heads``)."""
    rows = q.shape[0] * q.shape[1] * q.shape[2]
    split = key_splits(rows, keys.shape[2]) > 1
    return (q.shape[1], keys.shape[1], q.shape[3], values.shape[3], q.dtype,
            _mask_kind(mask), q.shape[2], split, gated) + \
        (() if heads is None else (_heads_case(heads),))


def _heads_case(heads: HeadSource) -> tuple[Any, ...]:
    """The template a query's heads work takes: (QW, QC, QNORM, QROT, QRD, QTRAD, QFREQS,
    QPERB) as :func:`_launch` sets them."""
    (x, weight, eps, rotate), (dims, traditional, log2_base, _scale, _freqs), offsets, start \
        = heads
    return (x.shape[3], start, 0 if eps is None else (1 if weight is None else 2),
            bool(rotate), dims if rotate else 2, bool(rotate and traditional),
            bool(rotate and log2_base is None), offsets.size > 1)


def _query_heads(q: mx.array, heads: HeadSource | None) -> HeadSource | None:
    """``heads`` (how a fused heads launch made ``q``) where the kernel can do that work
    itself from the raw heads: their layout ``[B, L, H, W]`` to ``q``'s ``[B, H, L, D]``,
    one dtype, a rotated pair's entries in one lane (half the rotated dims a multiple of
    32) or neighbouring ones (interleaved)."""
    if heads is None:
        return None
    (x, _w, _eps, rotate), (dims, traditional, *_), _offsets, start = heads
    B, H, L, D = q.shape
    if x.ndim != 4 or x.shape[:3] != (B, L, H) or x.dtype != q.dtype \
            or not 0 <= start <= x.shape[3] - D:
        return None
    if rotate and not (0 < dims <= D and dims % 2 == 0
                       and (traditional or (dims // 2) % 32 == 0)):
        return None
    return heads


def _launch(q: mx.array, keys: mx.array, values: mx.array, scale: float,
            mask: mx.array | None, splits: int | None = None,
            gate: mx.array | None = None, heads: HeadSource | None = None) -> mx.array:
    """The fused kernel's output ``[B, Hq, L, Dv]``; with ``heads``, the queries (shape
    and dtype of ``q``, which is not read) are made from their raw heads in the kernel."""
    global _kernel
    B, Hq, L, D = q.shape
    Hk, S, Dv = keys.shape[1], keys.shape[2], values.shape[3]
    rows = B * Hq * L
    P = key_splits(rows, S) if splits is None else splits
    if not 0 < P <= SPLIT_BLOCKS:
        raise ValueError(f"attention kernel: {P} key splits (1 to {SPLIT_BLOCKS})")
    split = P > 1
    if _kernel is None:
        _kernel = CudaKernel(
            name="mlxrunner_attend",
            input_names=["q", "keys", "values", "scale", "mask", "dims", "gate", "cnt",
                         "qw", "qeps", "qoff", "qfreqs", "qrf"],
            output_names=["out", "parts"], source=ATTEND_SOURCE)
    if mask is not None and mask.ndim == 2 and mask.shape != (L, S):
        mask = mx.broadcast_to(mask, (L, S))
    threads = SPLIT_THREADS if split else ATTEND_THREADS
    absent = q.dtype  # (an input the case does not read: not passed, see CudaKernel)
    query: list[mx.array | mx.Dtype] = [q, absent, mx.float32, mx.int32, mx.float32,
                                        mx.float32]
    query_template: tuple[Any, ...] = (D, 0, 0, False, 2, False, False, False)
    if heads is not None:
        (x, weight, eps, rotate), (_dims, _trad, log2_base, rope_scale, freqs), offsets, _ \
            = heads
        query = [x, absent if weight is None or eps is None else weight,
                 constant((0.0 if eps is None else float(eps),), mx.float32), offsets,
                 freqs if rotate and freqs is not None else mx.float32,
                 constant((log2_base or 0.0, rope_scale), mx.float32)]
        query_template = _heads_case(heads)
    return _kernel(  # (absent: a dtype for an input, None for an output's shape)
        inputs=[query[0], keys, values, constant((float(scale),), mx.float32),
                mask if mask is not None else mx.bool_, constant((L, S, P), mx.int32),
                gate if gate is not None else q.dtype,
                block_counters(rows) if split else mx.int32, *query[1:]],
        template=[("T", q.dtype), ("HQ", Hq), ("HK", Hk), ("D", D), ("DV", Dv),
                  ("NT", threads), ("U", keys_at_once(D, Dv)),
                  ("MASK", _mask_kind(mask)), ("GATE", gate is not None), ("SPLIT", split),
                  ("PMAX", SPLIT_BLOCKS), ("QH", heads is not None),
                  *zip(("QW", "QC", "QNORM", "QROT", "QRD", "QTRAD", "QFREQS", "QPERB"),
                       query_template)],
        grid=(threads * rows, P, 1), threadgroup=(threads, 1, 1),
        output_shapes=[(B, Hq, L, Dv), (rows * P * (Dv + 2),) if split else None],
        output_dtypes=[q.dtype, mx.float32])[0]


def _kernel_applies(q: mx.array, keys: mx.array, values: mx.array,
                    mask: mx.array | None) -> bool:
    return (mode() == "kernel" and _short_block_on_cuda(q, keys, mask)
            and (mask is None or mask.ndim <= 2)
            and q.dtype == keys.dtype == values.dtype
            and q.dtype in (mx.float32, mx.float16, mx.bfloat16)
            and 0 < q.shape[3] <= 1024 and 0 < values.shape[3] <= 512
            and keys.shape[3] == q.shape[3] and values.shape[:3] == keys.shape[:3]
            and (mask is None or mask.shape[-1] == keys.shape[2]))


def _kernel_serves(q: mx.array, keys: mx.array, values: mx.array,
                   mask: mx.array | None, gated: bool = False,
                   heads: HeadSource | None = None) -> bool:
    """Whether the fused kernel serves this case (``gated``: with an output gate;
    ``heads``: making the queries from their raw heads; settled by a self-check on random
    inputs of its shapes, the first time)."""
    if not (_kernel_applies(q, keys, values, mask)
            and settings.current().kernel_allowed("attention")):
        return False
    case = _case(q, keys, values, mask, gated, heads)
    n_heads, kv_heads, head_dim, value_dim, dtype, kind, length, split, gated = case[:9]
    scale = head_dim ** -0.5
    batch = 2 if heads is not None and heads[2].size > 1 else 1  # (an offset a sequence)

    def probe() -> tuple[Any, ...]:
        S = 67  # not a multiple of the warps: some take one key fewer
        parts = [mx.random.key(2024 + i) for i in range(7)]  # no gather (see deltanet's)
        pq = mx.random.normal((batch, n_heads, length, head_dim), key=parts[0]).astype(dtype)
        pk = mx.random.normal((batch, kv_heads, S, head_dim), key=parts[1]).astype(dtype)
        pv = mx.random.normal((batch, kv_heads, S, value_dim), key=parts[2]).astype(dtype)
        keep = mx.random.uniform(shape=(length, S), key=parts[3]) < 0.7
        keep = keep | (mx.arange(S)[None] == mx.arange(length)[:, None])  # a key per row
        gate = (3 * mx.random.normal((batch, n_heads, length, value_dim), key=parts[4])
                ).astype(dtype) if gated else None
        return pq, pk, pv, (None, keep[0], keep)[kind], gate, \
            None if heads is None else _probe_heads(heads, pq, parts[5], parts[6])

    def reference(p: tuple[Any, ...]) -> mx.array:
        q = p[0] if p[5] is None else cuda_norms._reference_heads(
            [p[5][0]], p[5][1], p[5][2], head_dim, [p[5][3]])[0]
        out = folded_attention(q, *p[1:3], scale=scale, mask=p[3])
        return out if p[4] is None else out * mx.sigmoid(p[4])

    return serves("attention", case,
                  lambda p: _launch(p[0], p[1], p[2], scale, p[3], splits=3 if split else 1,
                                    gate=p[4], heads=p[5]),
                  reference, probe, 2e-3 if dtype == mx.float32 else 5e-2,
                  # (the heads' reference and what a HeadSource means are cuda_norms')
                  against="MLX's operations", source=kernel_code(__file__, cuda_norms.__file__))


def _probe_heads(heads: HeadSource, q: mx.array, key: mx.array, weight_key: mx.array
                 ) -> HeadSource:
    """Raw heads for a check of the kernel making ``q``'s queries as ``heads`` says: its
    layout, norm and rotation, random entries, weights and positions."""
    (x, weight, eps, rotate), (dims, traditional, log2_base, rope_scale, _), _, start = heads
    B, H, L, D = q.shape
    part = cuda_norms.probe_part((B, L, H, x.shape[3]), D, q.dtype, weight is not None,
                                 eps is not None, rotate, key, weight_key)
    rotation = cuda_norms.probe_rotation(dims, traditional, log2_base is None, rope_scale)
    return part, rotation, cuda_norms.probe_offsets(B), start


def prepare_attend(heads: int, kv_heads: int, head_dim: int, value_dim: int, length: int,
                   dtype: mx.Dtype) -> None:
    """Settle now whether :func:`attend` uses its fused kernel for query blocks of
    ``length`` rows with these heads and dtype, for every mask kind, over buffers short
    enough to attend unsplit and long enough to split (the check otherwise runs at first
    use, which may be inside a trace: that is fine too)."""
    q = mx.zeros((1, heads, length, head_dim), dtype)
    for S in (MIN_SPLIT_KEYS - 1, 67):
        k = mx.zeros((1, kv_heads, S, head_dim), dtype)
        v = mx.zeros((1, kv_heads, S, value_dim), dtype)
        for mask in (None, mx.zeros((S,), mx.bool_), mx.zeros((length, S), mx.bool_)):
            _kernel_serves(q, k, v, mask)
