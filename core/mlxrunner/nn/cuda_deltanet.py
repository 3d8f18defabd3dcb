"""The fused CUDA kernels of the Gated DeltaNet core: one launch per layer for a decode
step (:func:`step`) or a short block (:func:`block`), each served only after its self-check
(``mlxrunner.nn.kernels.serves``), else the compiled MLX operations.

Decoding one token through MLX's CUDA backend costs a roughly fixed host time per
operation, so the ~15 small operations of the DeltaNet core (convolution, SiLU, q/k L2
norms, decay, the delta-rule update, the gated RMSNorm) dominate a small model's decode
step. The step kernel runs them as one: a thread block per (batch row, value head), each
warp owning value rows of the float32 state, its lanes striding the key dimension. The
block kernel loops over ``L`` tokens in one launch with the state in registers, and also
writes each token's normalised key, correction and log decay (what a rollback rebuilds
interior states from).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx

from .cuda_build import CudaKernel, kernel_code
from .kernels import kernel_allowed, serves

# Three block-wide float sums at once, for every thread (after the kWarps, red [3 * kWarps],
# lane and warp declarations of a kernel): the step and block kernels' norms.
_BLOCK_SUM3 = r"""
    auto block_sum3 = [&](float& s0, float& s1, float& s2) {
        for (int o = 16; o > 0; o >>= 1) {
            s0 += __shfl_xor_sync(0xffffffff, s0, o);
            s1 += __shfl_xor_sync(0xffffffff, s1, o);
            s2 += __shfl_xor_sync(0xffffffff, s2, o);
        }
        if (lane == 0) {
            red[warp] = s0;
            red[kWarps + warp] = s1;
            red[2 * kWarps + warp] = s2;
        }
        __syncthreads();
        s0 = 0.f; s1 = 0.f; s2 = 0.f;
        for (int w = 0; w < kWarps; ++w) {
            s0 += red[w];
            s1 += red[kWarps + w];
            s2 += red[2 * kWarps + w];
        }
        __syncthreads();
    };
"""

# Template constants: Hk, Hv, Dk, Dv, K (conv kernel), C (conv channels), NT (threads per
# block), P (row length of the joined in-projection [qkv | z | b | a], read in place rather
# than as four copied slices) and OZ, OB, OA (where z, b and a start in a row); types T
# (activations), TW (conv weight), TA (A_log), TD (dt_bias), TN (norm weight);
# EPS_E9 the RMSNorm epsilon times 1e9 (an int template argument).
DELTANET_STEP_SOURCE = r"""
    constexpr int kWarps = NT / 32;
    constexpr int kRep = Hv / Hk;
    constexpr int kPerLane = Dk / 32;
    const float eps = EPS_E9 * 1e-9f;
    const int bh = blockIdx.x;
    const int b = bh / Hv;
    const int hv = bh % Hv;
    const int hk = hv / kRep;
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    __shared__ float q_s[Dk];
    __shared__ float k_s[Dk];
    __shared__ float v_s[Dv];
    __shared__ float o_s[Dv];
    __shared__ float red[3 * kWarps];

    const T* x = proj + (size_t)b * P;  // [qkv | z | b | a] row
    const T* tail = conv_tail + (size_t)b * (K - 1) * C;
    T* tail_out = new_tail + (size_t)b * (K - 1) * C;

    // the warp's rows of the state, loaded first where they fit in 32 registers a thread
    // (Qwen3.5's 128 x 128 heads): their latency under the convolution and the norms (a row
    // loaded as the update reaches it waits once a row); larger heads load them so
    constexpr int kRows = (Dv + kWarps - 1) / kWarps;
    constexpr bool kPreload = kRows * kPerLane <= 32;
    const float* S = state + (size_t)bh * Dv * Dk;
    float* S_out = new_state + (size_t)bh * Dv * Dk;
    float s_reg[kPreload ? kRows : 1][kPerLane];
    if (kPreload) {
        #pragma unroll
        for (int m = 0; m < kRows; ++m) {
            const int r = warp + kWarps * m;
            #pragma unroll
            for (int i = 0; i < kPerLane; ++i) {
                s_reg[m][i] = r < Dv ? S[r * Dk + lane + 32 * i] : 0.f;
            }
        }
    }

    // causal depthwise conv at channel c: float32 sum, rounded to T, SiLU in T
    auto conv_silu = [&](int c) -> float {
        float acc = 0.f;
        for (int i = 0; i < K - 1; ++i) {
            acc += static_cast<float>(tail[i * C + c]) * static_cast<float>(conv_weight[c * K + i]);
        }
        acc += static_cast<float>(x[c]) * static_cast<float>(conv_weight[c * K + K - 1]);
        float r = static_cast<float>(static_cast<T>(acc));
        return static_cast<float>(static_cast<T>(r / (1.f + expf(-r))));
    };
    auto shift_tail = [&](int c) {
        for (int i = 0; i < K - 2; ++i) {
            tail_out[i * C + c] = tail[(i + 1) * C + c];
        }
        tail_out[(K - 2) * C + c] = x[c];
    };
""" + _BLOCK_SUM3 + r"""

    if (tid < Dk) {
        const int cq = hk * Dk + tid;
        const int ck = Hk * Dk + hk * Dk + tid;
        q_s[tid] = conv_silu(cq);
        k_s[tid] = conv_silu(ck);
        if (hv % kRep == 0) {  // key channels are shared by kRep value heads: write once
            shift_tail(cq);
            shift_tail(ck);
        }
    }
    if (tid < Dv) {
        const int cv = 2 * Hk * Dk + hv * Dv + tid;
        v_s[tid] = conv_silu(cv);
        shift_tail(cv);
    }
    __syncthreads();

    float sq = 0.f, sk = 0.f, qk = 0.f;
    if (tid < Dk) {
        sq = q_s[tid] * q_s[tid];
        sk = k_s[tid] * k_s[tid];
        qk = q_s[tid] * k_s[tid];
    }
    block_sum3(sq, sk, qk);
    // q, k L2-normalised (eps 1e-6 inside the root), q also scaled by Dk^-0.5
    const float q_scale = rsqrtf(sq + 1e-6f) * rsqrtf(static_cast<float>(Dk));
    const float k_scale = rsqrtf(sk + 1e-6f);
    const float kq = qk * q_scale * k_scale;
    const float a_in = static_cast<float>(x[OA + hv]) + static_cast<float>(dt_bias[hv]);
    const float softplus = a_in > 20.f ? a_in : log1pf(expf(a_in));
    const float decay = expf(-expf(static_cast<float>(A_log[hv])) * softplus);
    const float beta = 1.f / (1.f + expf(-static_cast<float>(x[OB + hv])));

    #pragma unroll
    for (int m = 0; m < kRows; ++m) {
        const int r = warp + kWarps * m;
        if (r >= Dv) {
            break;  // (the same for every lane of the warp)
        }
        float* row = s_reg[kPreload ? m : 0];
        if (!kPreload) {
            for (int i = 0; i < kPerLane; ++i) {
                row[i] = S[r * Dk + lane + 32 * i];
            }
        }
        float s_k = 0.f, s_q = 0.f;
        for (int i = 0; i < kPerLane; ++i) {
            const int j = lane + 32 * i;
            s_k += row[i] * k_s[j];
            s_q += row[i] * q_s[j];
        }
        for (int o = 16; o > 0; o >>= 1) {
            s_k += __shfl_xor_sync(0xffffffff, s_k, o);
            s_q += __shfl_xor_sync(0xffffffff, s_q, o);
        }
        // S' = e S + d k^T with d = beta (v - e S k); S' q = e S q + d (k . q)
        const float delta = beta * (v_s[r] - decay * s_k * k_scale);
        for (int i = 0; i < kPerLane; ++i) {
            const int j = lane + 32 * i;
            S_out[r * Dk + j] = decay * row[i] + delta * k_s[j] * k_scale;
        }
        if (lane == 0) {
            o_s[r] = decay * s_q * q_scale + delta * kq;
        }
    }
    __syncthreads();

    // gated RMSNorm over Dv: w * rmsnorm(o) * silu(z), o rounded to T first
    float ov = 0.f, ss = 0.f, unused0 = 0.f, unused1 = 0.f;
    if (tid < Dv) {
        ov = static_cast<float>(static_cast<T>(o_s[tid]));
        ss = ov * ov;
    }
    block_sum3(ss, unused0, unused1);
    if (tid < Dv) {
        const float rstd = rsqrtf(ss / Dv + eps);
        const float normed = static_cast<float>(
            static_cast<T>(ov * rstd * static_cast<float>(norm_weight[tid])));
        const float zv = static_cast<float>(x[OZ + hv * Dv + tid]);
        const float gate = static_cast<float>(static_cast<T>(zv / (1.f + expf(-zv))));
        out[(size_t)b * Hv * Dv + hv * Dv + tid] = static_cast<T>(normed * gate);
    }
"""

# The block kernel: the step above looped over L tokens inside one launch, the float32 state
# held in registers (warp w owns value rows w, w + NT/32, ...; lane l key columns l, l + 32,
# ...). Extra outputs for rollback: k_out [B, Hv, L, Dk] (normalised keys), delta_out
# [B, Hv, L, Dv] (the corrections d_t), g_out [B, Hv, L] (log decays).
DELTANET_BLOCK_SOURCE = r"""
    constexpr int kWarps = NT / 32;
    constexpr int kRep = Hv / Hk;
    constexpr int kPerLane = Dk / 32;
    constexpr int kRows = (Dv + kWarps - 1) / kWarps;
    const float eps = EPS_E9 * 1e-9f;
    const int bh = blockIdx.x;
    const int b = bh / Hv;
    const int hv = bh % Hv;
    const int hk = hv / kRep;
    const int tid = threadIdx.x;
    const int lane = tid & 31;
    const int warp = tid >> 5;
    __shared__ float q_s[Dk];
    __shared__ float k_s[Dk];
    __shared__ float v_s[Dv];
    __shared__ float o_s[Dv];
    __shared__ float red[3 * kWarps];

    const T* x = proj + (size_t)b * L * P;  // L rows of [qkv | z | b | a]
    const T* tail = conv_tail + (size_t)b * (K - 1) * C;
    T* tail_out = new_tail + (size_t)b * (K - 1) * C;

    // row `row` of the window [tail; x] (K - 1 + L rows) at channel c
    auto win = [&](int row, int c) -> float {
        return row < K - 1 ? static_cast<float>(tail[row * C + c])
                           : static_cast<float>(x[(size_t)(row - (K - 1)) * P + c]);
    };
    auto conv_silu = [&](int t, int c) -> float {
        float acc = 0.f;
        for (int i = 0; i < K; ++i) {
            acc += win(t + i, c) * static_cast<float>(conv_weight[c * K + i]);
        }
        float r = static_cast<float>(static_cast<T>(acc));
        return static_cast<float>(static_cast<T>(r / (1.f + expf(-r))));
    };
    auto shift_tail = [&](int c) {
        for (int i = 0; i < K - 1; ++i) {
            tail_out[i * C + c] = static_cast<T>(win(L + i, c));
        }
    };
""" + _BLOCK_SUM3 + r"""

    const float* S = state + (size_t)bh * Dv * Dk;
    float* S_out = new_state + (size_t)bh * Dv * Dk;
    float s_reg[kRows][kPerLane];
    for (int m = 0; m < kRows; ++m) {
        const int r = warp + kWarps * m;
        for (int i = 0; i < kPerLane; ++i) {
            s_reg[m][i] = r < Dv ? S[r * Dk + lane + 32 * i] : 0.f;
        }
    }
    const float neg_A = -expf(static_cast<float>(A_log[hv]));

    for (int t = 0; t < L; ++t) {
        if (tid < Dk) {
            q_s[tid] = conv_silu(t, hk * Dk + tid);
            k_s[tid] = conv_silu(t, Hk * Dk + hk * Dk + tid);
        }
        if (tid < Dv) {
            v_s[tid] = conv_silu(t, 2 * Hk * Dk + hv * Dv + tid);
        }
        __syncthreads();

        float sq = 0.f, sk = 0.f, qk = 0.f;
        if (tid < Dk) {
            sq = q_s[tid] * q_s[tid];
            sk = k_s[tid] * k_s[tid];
            qk = q_s[tid] * k_s[tid];
        }
        block_sum3(sq, sk, qk);
        const float q_scale = rsqrtf(sq + 1e-6f) * rsqrtf(static_cast<float>(Dk));
        const float k_scale = rsqrtf(sk + 1e-6f);
        const float kq = qk * q_scale * k_scale;
        const size_t bt = (size_t)b * L + t;
        const float a_in = static_cast<float>(x[t * P + OA + hv]) + static_cast<float>(dt_bias[hv]);
        const float softplus = a_in > 20.f ? a_in : log1pf(expf(a_in));
        const float g = neg_A * softplus;
        const float decay = expf(g);
        const float beta = 1.f / (1.f + expf(-static_cast<float>(x[t * P + OB + hv])));

        for (int m = 0; m < kRows; ++m) {
            const int r = warp + kWarps * m;
            if (r < Dv) {
                float s_k = 0.f, s_q = 0.f;
                for (int i = 0; i < kPerLane; ++i) {
                    const int j = lane + 32 * i;
                    s_k += s_reg[m][i] * k_s[j];
                    s_q += s_reg[m][i] * q_s[j];
                }
                for (int o = 16; o > 0; o >>= 1) {
                    s_k += __shfl_xor_sync(0xffffffff, s_k, o);
                    s_q += __shfl_xor_sync(0xffffffff, s_q, o);
                }
                const float delta = beta * (v_s[r] - decay * s_k * k_scale);
                for (int i = 0; i < kPerLane; ++i) {
                    const int j = lane + 32 * i;
                    s_reg[m][i] = decay * s_reg[m][i] + delta * k_s[j] * k_scale;
                }
                if (lane == 0) {
                    o_s[r] = decay * s_q * q_scale + delta * kq;
                    delta_out[((size_t)bh * L + t) * Dv + r] = delta;
                }
            }
        }
        if (tid < Dk) {
            k_out[((size_t)bh * L + t) * Dk + tid] = k_s[tid] * k_scale;
        }
        if (tid == 0) {
            g_out[(size_t)bh * L + t] = g;
        }
        __syncthreads();

        float ov = 0.f, ss = 0.f, unused0 = 0.f, unused1 = 0.f;
        if (tid < Dv) {
            ov = static_cast<float>(static_cast<T>(o_s[tid]));
            ss = ov * ov;
        }
        block_sum3(ss, unused0, unused1);
        if (tid < Dv) {
            const float rstd = rsqrtf(ss / Dv + eps);
            const float normed = static_cast<float>(
                static_cast<T>(ov * rstd * static_cast<float>(norm_weight[tid])));
            const size_t at = bt * Hv * Dv + (size_t)hv * Dv + tid;
            const float zv = static_cast<float>(x[t * P + OZ + hv * Dv + tid]);
            const float gate = static_cast<float>(static_cast<T>(zv / (1.f + expf(-zv))));
            out[at] = static_cast<T>(normed * gate);
        }
    }

    for (int m = 0; m < kRows; ++m) {
        const int r = warp + kWarps * m;
        if (r < Dv) {
            for (int i = 0; i < kPerLane; ++i) {
                S_out[r * Dk + lane + 32 * i] = s_reg[m][i];
            }
        }
    }
    if (tid < Dk && hv % kRep == 0) {  // key channels are shared by kRep value heads
        shift_tail(hk * Dk + tid);
        shift_tail(Hk * Dk + hk * Dk + tid);
    }
    if (tid < Dv) {
        shift_tail(2 * Hk * Dk + hv * Dv + tid);
    }
"""

_kernels: dict[str, Any] = {}

#: the module whose operations the kernels are checked against (part of a kept verdict)
_DELTANET_FILE = str(Path(__file__).with_name("deltanet.py"))

_INPUTS = ["proj", "conv_tail", "state", "conv_weight", "A_log", "dt_bias", "norm_weight"]


def _kernel(kind: str) -> Any:
    if kind not in _kernels:
        step = kind == "step"
        _kernels[kind] = CudaKernel(
            name=f"mlxrunner_deltanet_{kind}", input_names=_INPUTS,
            output_names=["out", "new_tail", "new_state"] + (
                [] if step else ["k_out", "delta_out", "g_out"]),
            source=DELTANET_STEP_SOURCE if step else DELTANET_BLOCK_SOURCE)
    return _kernels[kind]


def applies(hk: int, hv: int, dk: int, dv: int) -> bool:
    """Whether the kernels support these head sizes (and may run here at all)."""
    return (kernel_allowed("deltanet") and dk % 32 == 0 and 0 < dk <= 1024 and 0 < dv <= 1024
            and hv % hk == 0)


def _joined(args: tuple[mx.array, ...], joined: mx.array | None
            ) -> tuple[mx.array, list[tuple[str, int]]]:
    """The in-projection row ``[qkv | z | b | a]`` (given, or joined here) and its layout."""
    qkv, z, b, a = args[:4]
    if joined is None:
        joined = mx.concatenate([qkv, z, b, a], axis=-1)
    C, Z, H = qkv.shape[-1], z.shape[-1], b.shape[-1]
    return joined, [("P", joined.shape[-1]), ("OZ", C), ("OB", C + Z), ("OA", C + Z + H)]


def _launch(kind: str, args: tuple[mx.array, ...], hk: int, hv: int, dk: int, dv: int,
            eps: float, joined: mx.array | None = None) -> tuple[mx.array, ...]:
    qkv, z, b, a, conv_tail, state, conv_weight, A_log, dt_bias, norm_weight = args
    proj, layout = _joined(args, joined)
    B, L, C = qkv.shape
    threads = min(1024, max(512, 32 * -(-max(dk, dv) // 32)))
    shapes = [(B, L, hv * dv), conv_tail.shape, state.shape]
    dtypes = [qkv.dtype, conv_tail.dtype, mx.float32]
    template = [("T", qkv.dtype), ("Hk", hk), ("Hv", hv), ("Dk", dk), ("Dv", dv),
                ("K", conv_weight.shape[1]), ("C", C), *layout, ("NT", threads),
                ("EPS_E9", round(eps * 1e9))]
    if kind == "block":
        shapes += [(B, hv, L, dk), (B, hv, L, dv), (B, hv, L)]
        dtypes += [mx.float32] * 3
        template.append(("L", L))
    return tuple(_kernel(kind)(
        inputs=[proj, conv_tail, state, conv_weight, A_log, dt_bias, norm_weight],
        template=template, grid=(threads * B * hv, 1, 1), threadgroup=(threads, 1, 1),
        output_shapes=shapes, output_dtypes=dtypes))


def _tolerance(dtype: mx.Dtype) -> float:
    # float32: the kernel's products are full float32 and so are MLX's (TF32 off); on an H200
    # they differed by up to 2.5e-4 of the largest output over 8-token blocks
    return 2e-3 if dtype == mx.float32 else 5e-2


def _serves(kind: str, args: tuple[mx.array, ...], fallback: Callable[..., tuple[mx.array, ...]],
            dims: tuple[int, int, int, int, float]) -> bool:
    hk, hv, dk, dv, _ = dims
    if not applies(hk, hv, dk, dv):
        return False
    qkv, z, b, a, conv_tail, state, *weights = args
    case = (kind, dims, qkv.shape[0], qkv.shape[1] if kind == "block" else 1, qkv.dtype,
            *(w.dtype for w in weights))

    def probe() -> tuple[mx.array, ...]:
        # a key per input, not split ones: indexing a split key array is a gather, one more
        # kernel MLX builds on a fresh machine
        keys = [mx.random.key(1234 + i) for i in range(6)]
        made = tuple(mx.random.normal(x.shape, key=key).astype(x.dtype)
                     for x, key in zip((qkv, z, b, a, conv_tail), keys))
        return made + (0.1 * mx.random.normal(state.shape, key=keys[5]),) + tuple(weights)

    return serves("deltanet", case, lambda p: _launch(kind, p, *dims), lambda p: fallback(*p),
                  probe, _tolerance(qkv.dtype), against="the compiled MLX operations",
                  source=kernel_code(__file__, _DELTANET_FILE))


def step(args: tuple[mx.array, ...], fallback: Callable[..., tuple[mx.array, ...]],
         hk: int, hv: int, dk: int, dv: int, eps: float, *,
         joined: mx.array | None = None) -> tuple[mx.array, ...]:
    """``(out, new_tail, new_state)`` of one token: the kernel where it serves, else
    ``fallback(*args)``. ``args``: qkv ``[B, 1, C]``, z ``[B, 1, Hv*Dv]``, b and a ``[B, 1,
    Hv]``, conv tail ``[B, K-1, C]``, state ``[B, Hv, Dv, Dk]`` float32, conv weight ``[C, K,
    1]``, A_log, dt_bias ``[Hv]``, norm weight ``[Dv]``. ``joined``: the in-projection
    output that qkv, z, b and a are consecutive slices of (read in place)."""
    dims = (hk, hv, dk, dv, eps)
    if not _serves("step", args, fallback, dims):
        return fallback(*args)
    return _launch("step", args, *dims, joined=joined)


def block(args: tuple[mx.array, ...], fallback: Callable[..., tuple[mx.array, ...]],
          hk: int, hv: int, dk: int, dv: int, eps: float, *,
          joined: mx.array | None = None) -> tuple[mx.array, ...]:
    """``(out, new_tail, new_state, k, delta, g)`` of a block of ``L`` tokens (args as for
    :func:`step` with ``L`` rows): the block kernel where it serves, else
    ``fallback(*args)``."""
    dims = (hk, hv, dk, dv, eps)
    if not _serves("block", args, fallback, dims):
        return fallback(*args)
    return _launch("block", args, *dims, joined=joined)
