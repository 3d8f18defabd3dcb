"""A fused CUDA kernel for the single-token Gated DeltaNet step, with a checked fallback.

Decoding one token through MLX's CUDA backend costs a roughly fixed host time per
graph operation, so the ~15 small operations of the DeltaNet core (convolution,
SiLU, q/k L2 norms, decay, the delta-rule update, the gated RMSNorm) dominate a
decode step of a small model. ``deltanet_step`` runs them as one kernel: one thread
block per (batch row, value head); each warp owns value rows of the float32 state,
its lanes stride the key dimension.

The kernel is used only where it applies (MLX's CUDA backend, key dim a multiple of
32, head dims <= 1024) and only after a self-check: on the first call for a shape
and dtype it runs beside the pure-MLX step on random inputs; any error or mismatch
disables it for that shape (one warning) and the pure-MLX step runs instead. Set
``MLXRUNNER_QWEN3_5_CUDA_KERNELS=0`` to never use it.

``deltanet_block`` is the same for a short block of ``L`` tokens (speculative verify
forwards): one launch loops over the tokens with the state held in registers, and also
writes each token's normalised key, delta-rule correction and log decay, from which the
cache rebuilds the state at any interior boundary (rollback) without a replay.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx

from mlxrunner import check_kernel, constant, on_cuda, switch_allows

ENV_SWITCH = "MLXRUNNER_QWEN3_5_CUDA_KERNELS"
KERNELS = ("deltanet", "qk")  # the names ENV_SWITCH takes

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

    const float* S = state + (size_t)bh * Dv * Dk;
    float* S_out = new_state + (size_t)bh * Dv * Dk;
    for (int r = warp; r < Dv; r += kWarps) {
        float s_reg[kPerLane];
        float s_k = 0.f, s_q = 0.f;
        for (int i = 0; i < kPerLane; ++i) {
            const int j = lane + 32 * i;
            s_reg[i] = S[r * Dk + j];
            s_k += s_reg[i] * k_s[j];
            s_q += s_reg[i] * q_s[j];
        }
        for (int o = 16; o > 0; o >>= 1) {
            s_k += __shfl_xor_sync(0xffffffff, s_k, o);
            s_q += __shfl_xor_sync(0xffffffff, s_q, o);
        }
        // S' = e S + d k^T with d = beta (v - e S k); S' q = e S q + d (k . q)
        const float delta = beta * (v_s[r] - decay * s_k * k_scale);
        for (int i = 0; i < kPerLane; ++i) {
            const int j = lane + 32 * i;
            S_out[r * Dk + j] = decay * s_reg[i] + delta * k_s[j] * k_scale;
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

_kernel: Any = None
_block_kernel: Any = None
_verdicts: dict[tuple[Any, ...], bool] = {}


cuda_backend = on_cuda  # (tests stand in for it here)


def kernel_on(name: str) -> bool:
    """Whether this plugin's fused kernel ``name`` ('deltanet', 'qk') may run: on
    the CUDA backend and not switched off by ``ENV_SWITCH`` ("0": none; a comma-separated
    list of names: only those; unset or "1": all)."""
    return cuda_backend() and switch_allows(ENV_SWITCH, name, KERNELS)


def applies(hk: int, hv: int, dk: int, dv: int) -> bool:
    """Whether the fused kernel supports these head sizes on the current device."""
    if not kernel_on("deltanet"):
        return False
    return dk % 32 == 0 and 0 < dk <= 1024 and 0 < dv <= 1024 and hv % hk == 0


def _joined(args: tuple[mx.array, ...], joined: mx.array | None
            ) -> tuple[mx.array, list[tuple[str, int]]]:
    """The in-projection row ``[qkv | z | b | a]`` (given, or joined here) and its layout."""
    qkv, z, b, a = args[:4]
    if joined is None:
        joined = mx.concatenate([qkv, z, b, a], axis=-1)
    C, Z, H = qkv.shape[-1], z.shape[-1], b.shape[-1]
    return joined, [("P", joined.shape[-1]), ("OZ", C), ("OB", C + Z), ("OA", C + Z + H)]


def _launch(args: tuple[mx.array, ...], hk: int, hv: int, dk: int, dv: int,
            eps: float, joined: mx.array | None = None) -> tuple[mx.array, mx.array, mx.array]:
    global _kernel
    if _kernel is None:
        _kernel = mx.fast.cuda_kernel(
            name="qwen3_5_deltanet_step",
            input_names=["proj", "conv_tail", "state", "conv_weight", "A_log", "dt_bias",
                         "norm_weight"],
            output_names=["out", "new_tail", "new_state"],
            source=DELTANET_STEP_SOURCE,
        )
    qkv, z, b, a, conv_tail, state, conv_weight, A_log, dt_bias, norm_weight = args
    proj, layout = _joined(args, joined)
    B, C = qkv.shape[0], qkv.shape[-1]
    K = conv_weight.shape[1]
    threads = min(1024, max(512, 32 * -(-max(dk, dv) // 32)))
    out, new_tail, new_state = _kernel(
        inputs=[proj, conv_tail, state, conv_weight, A_log, dt_bias, norm_weight],
        template=[("T", qkv.dtype), ("Hk", hk), ("Hv", hv), ("Dk", dk), ("Dv", dv),
                  ("K", K), ("C", C), *layout, ("NT", threads), ("EPS_E9", round(eps * 1e9))],
        grid=(threads * B * hv, 1, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(B, 1, hv * dv), conv_tail.shape, state.shape],
        output_dtypes=[qkv.dtype, conv_tail.dtype, mx.float32],
    )
    return out, new_tail, new_state


def _launch_block(args: tuple[mx.array, ...], hk: int, hv: int, dk: int, dv: int,
                  eps: float, joined: mx.array | None = None) -> tuple[mx.array, ...]:
    global _block_kernel
    if _block_kernel is None:
        _block_kernel = mx.fast.cuda_kernel(
            name="qwen3_5_deltanet_block",
            input_names=["proj", "conv_tail", "state", "conv_weight", "A_log", "dt_bias",
                         "norm_weight"],
            output_names=["out", "new_tail", "new_state", "k_out", "delta_out", "g_out"],
            source=DELTANET_BLOCK_SOURCE,
        )
    qkv, z, b, a, conv_tail, state, conv_weight, A_log, dt_bias, norm_weight = args
    proj, layout = _joined(args, joined)
    B, L, C = qkv.shape
    K = conv_weight.shape[1]
    threads = min(1024, max(512, 32 * -(-max(dk, dv) // 32)))
    return tuple(_block_kernel(
        inputs=[proj, conv_tail, state, conv_weight, A_log, dt_bias, norm_weight],
        template=[("T", qkv.dtype), ("Hk", hk), ("Hv", hv), ("Dk", dk), ("Dv", dv),
                  ("K", K), ("C", C), *layout, ("L", L), ("NT", threads),
                  ("EPS_E9", round(eps * 1e9))],
        grid=(threads * B * hv, 1, 1),
        threadgroup=(threads, 1, 1),
        output_shapes=[(B, L, hv * dv), conv_tail.shape, state.shape, (B, hv, L, dk),
                       (B, hv, L, dv), (B, hv, L)],
        output_dtypes=[qkv.dtype, conv_tail.dtype, mx.float32, mx.float32, mx.float32,
                       mx.float32],
    ))


def _tolerance(dtype: mx.Dtype) -> float:
    # float32: the pure-MLX step's matrix products may run in TF32 (MLX's CUDA default
    # unless MLX_ENABLE_TF32=0), about 1e-3 relative; the kernel's are full float32. On an
    # H200 they differed by up to 2.5e-4 of the largest output over 8-token blocks.
    return 2e-3 if dtype == mx.float32 else 5e-2


def _self_check(args: tuple[mx.array, ...], fallback: Callable[..., tuple[mx.array, ...]],
                dims: tuple[int, int, int, int, float], launch: Callable[..., Any]) -> bool:
    """Run the kernel beside the pure-MLX step on random inputs of the same shapes."""
    qkv, z, b, a, conv_tail, state, *weights = args
    keys = mx.random.split(mx.random.key(1234), 6)
    probe = tuple(mx.random.normal(x.shape, key=key).astype(x.dtype)
                  for x, key in zip((qkv, z, b, a, conv_tail), keys))
    probe += (0.1 * mx.random.normal(state.shape, key=keys[5]),)
    probe += tuple(weights)
    return check_kernel("mlxrunner-qwen3-5: fused DeltaNet kernel",
                        lambda: launch(probe, *dims), lambda: fallback(*probe),
                        _tolerance(qkv.dtype), against="the pure-MLX step")


def _verdict(kind: str, args: tuple[mx.array, ...],
             fallback: Callable[..., tuple[mx.array, ...]], dims: tuple[int, int, int, int, float],
             launch: Callable[..., Any]) -> bool:
    """Whether the kernel runs for these shapes: it applies and passed its self-check (run
    on the first call per shape and dtypes, and per block length)."""
    hk, hv, dk, dv, _ = dims
    if not applies(hk, hv, dk, dv):
        return False
    key = (hk, hv, dk, dv, args[0].shape[0], args[0].dtype, args[6].dtype, args[7].dtype,
           args[8].dtype, args[9].dtype)
    if kind != "step":
        key = (kind, args[0].shape[1], *key)
    verdict = _verdicts.get(key)
    if verdict is None:
        verdict = _verdicts[key] = _self_check(args, fallback, dims, launch)
    return verdict


def _checked(kind: str, args: tuple[mx.array, ...],
             fallback: Callable[..., tuple[mx.array, ...]], dims: tuple[int, int, int, int, float],
             launch: Callable[..., Any], joined: mx.array | None = None
             ) -> tuple[mx.array, ...]:
    if not _verdict(kind, args, fallback, dims, launch):
        return fallback(*args)
    if joined is not None:
        return launch(args, *dims, joined=joined)
    return launch(args, *dims)


def prepare(kind: str, args: tuple[mx.array, ...], fallback: Callable[..., tuple[mx.array, ...]],
            hk: int, hv: int, dk: int, dv: int, eps: float) -> bool:
    """Settle the verdict for ``kind`` ("step" or "block") on arrays of these shapes now,
    launching nothing else: a traced forward must not run the self-check (an evaluation)
    while it is being traced."""
    launch = _launch if kind == "step" else _launch_block
    return _verdict(kind, args, fallback, (hk, hv, dk, dv, eps), launch)


def deltanet_step(args: tuple[mx.array, ...], fallback: Callable[..., tuple[mx.array, ...]],
                  hk: int, hv: int, dk: int, dv: int, eps: float, *,
                  launch: Callable[..., Any] = _launch,
                  joined: mx.array | None = None) -> tuple[mx.array, ...]:
    """``(out, new_tail, new_state)`` of one token: the fused kernel where it applies and
    has passed its self-check, else ``fallback(*args)``.

    ``args``: qkv ``[B, 1, C]``, z ``[B, 1, Hv*Dv]``, b and a ``[B, 1, Hv]``, conv tail
    ``[B, K-1, C]``, state ``[B, Hv, Dv, Dk]`` float32, conv weight ``[C, K, 1]``, A_log,
    dt_bias ``[Hv]``, norm weight ``[Dv]``. ``joined``: optionally the in-projection output
    that qkv, z, b and a are consecutive slices of (the kernel reads it in place).
    """
    return _checked("step", args, fallback, (hk, hv, dk, dv, eps), launch, joined)


def deltanet_block(args: tuple[mx.array, ...], fallback: Callable[..., tuple[mx.array, ...]],
                   hk: int, hv: int, dk: int, dv: int, eps: float, *,
                   launch: Callable[..., Any] = _launch_block,
                   joined: mx.array | None = None) -> tuple[mx.array, ...]:
    """``(out, new_tail, new_state, k, delta, g)`` of a block of ``L`` tokens (args as for
    :func:`deltanet_step` with ``L`` rows): the block kernel where it applies and has passed
    its self-check (per block length), else ``fallback(*args)``. ``k [B, Hv, L, Dk]``,
    ``delta [B, Hv, L, Dv]`` and ``g [B, Hv, L]`` (float32) let the state after any first
    ``j`` tokens be rebuilt from the starting state."""
    return _checked("block", args, fallback, (hk, hv, dk, dv, eps), launch, joined)


# -- attention: q/k RMSNorm and partial RoPE in one launch --------------------------------------

# One block per (row, head) of the joined projection ``[B * L, P]`` (rows of
# ``[q_0 | gate_0 | ... | q_{H-1} | gate_{H-1} | k_0 .. k_{Hk-1} | v ...]``): the head's D values
# normalised over D (as MLX's RMSNorm: the normalised value and the weight rounded to T, their
# product in T), then its first R dims rotated (as MLX's non-traditional RoPE: pairs (i, i + R/2)
# at angle (pos + l) * inv_freq[i]), written to q ``[B, H, L, D]`` or k ``[B, Hk, L, D]``.
# Template constants: H, HK, D, R, P, NT (threads, D rounded up to 32), EPS_E9; type T. The
# block length L is an input (``seq``), so one build serves every length.
QK_NORM_ROPE_SOURCE = r"""
    constexpr int kWarps = NT / 32;
    const int L = seq[0];
    const float eps = EPS_E9 * 1e-9f;
    const int block = blockIdx.x;
    const int head = block % (H + HK);
    const int bl = block / (H + HK);  // b * L + l
    const int b = bl / L;
    const int l = bl % L;
    const bool is_q = head < H;
    const int t = threadIdx.x;
    const int lane = t & 31;
    const int warp = t >> 5;
    __shared__ float red[kWarps];
    __shared__ float normed[D];
    const T* src = rows + (size_t)bl * P + (is_q ? 2 * head * D : 2 * H * D + (head - H) * D);
    const float x = t < D ? static_cast<float>(src[t]) : 0.f;
    float s = x * x;
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
    const float rstd = rsqrtf(total / D + eps);
    float n = 0.f;
    if (t < D) {
        const float weight = static_cast<float>(is_q ? q_weight[t] : k_weight[t]);
        const float w_t = static_cast<float>(static_cast<T>(weight));
        n = static_cast<float>(static_cast<T>(w_t * static_cast<float>(static_cast<T>(x * rstd))));
        normed[t] = n;
    }
    __syncthreads();
    if (t < D) {
        float out = n;
        if (t < R) {
            constexpr int half = R / 2;
            const int i = t < half ? t : t - half;
            const float angle = static_cast<float>(position[0] + l) * inv_freq[i];
            const float c = cosf(angle);
            const float sn = sinf(angle);
            out = t < half ? n * c - normed[t + half] * sn : normed[t - half] * sn + n * c;
        }
        T* dst = is_q ? q_out + (((size_t)b * H + head) * L + l) * D
                      : k_out + (((size_t)b * HK + (head - H)) * L + l) * D;
        dst[t] = static_cast<T>(out);
    }
"""

_qk_kernel: Any = None
_qk_verdicts: dict[tuple[Any, ...], bool] = {}
#: decode steps and verify blocks: where launches cost; prompts keep MLX's operations
QK_MAX_ROWS = 64


def _qk_launch(rows: mx.array, q_weight: mx.array, k_weight: mx.array, inv_freq: mx.array,
               position: mx.array, dims: tuple[int, int, int, int, float], B: int, L: int
               ) -> tuple[mx.array, mx.array]:
    global _qk_kernel
    if _qk_kernel is None:
        _qk_kernel = mx.fast.cuda_kernel(
            name="qwen3_5_qk_norm_rope",
            input_names=["rows", "q_weight", "k_weight", "inv_freq", "position", "seq"],
            output_names=["q_out", "k_out"], source=QK_NORM_ROPE_SOURCE)
    heads, kv_heads, head_dim, rotary, eps = dims
    threads = 32 * -(-head_dim // 32)
    q, k = _qk_kernel(
        inputs=[rows, q_weight, k_weight, inv_freq, position, constant((L,), mx.int32)],
        template=[("T", rows.dtype), ("H", heads), ("HK", kv_heads), ("D", head_dim),
                  ("R", rotary), ("P", rows.shape[-1]), ("NT", threads),
                  ("EPS_E9", round(eps * 1e9))],
        grid=(threads * B * L * (heads + kv_heads), 1, 1), threadgroup=(threads, 1, 1),
        output_shapes=[(B, heads, L, head_dim), (B, kv_heads, L, head_dim)],
        output_dtypes=[rows.dtype, rows.dtype])
    return q, k


def _qk_applies(rows: mx.array, dims: tuple[int, int, int, int, float], B: int, L: int
                ) -> bool:
    heads, kv_heads, head_dim, rotary, _ = dims
    if not kernel_on("qk"):
        return False
    return (rows.ndim == 2 and rows.shape[0] == B * L <= QK_MAX_ROWS and 0 < head_dim <= 1024
            and rotary % 2 == 0 and 0 <= rotary <= head_dim
            and rows.shape[1] >= (2 * heads + kv_heads) * head_dim
            and rows.dtype in (mx.float32, mx.float16, mx.bfloat16))


def qk_norm_rope_usable(rows: mx.array, q_weight: mx.array, k_weight: mx.array,
                        dims: tuple[int, int, int, int, float], B: int, L: int,
                        reference: Callable[..., tuple[mx.array, mx.array]],
                        inv_freq: mx.array) -> bool:
    """Whether :func:`qk_norm_rope` runs the kernel for arrays like these: it applies and
    passed its self-check (run eagerly on the first call per shape and dtypes beside
    ``reference(rows, position)``, MLX's operations; call it before tracing)."""
    if not _qk_applies(rows, dims, B, L):
        return False
    key = (rows.shape, rows.dtype, q_weight.dtype, k_weight.dtype, dims, B, L)
    verdict = _qk_verdicts.get(key)
    if verdict is None:
        probe = mx.random.normal(rows.shape, key=mx.random.key(99)).astype(rows.dtype)
        # a 0-d position for MLX's rope: a (1,)-shaped one reads as one offset per batch row
        # on CUDA (rows past the first then rotate by garbage; seen at B = 4)
        position = mx.array(1234, dtype=mx.int32)
        verdict = _qk_verdicts[key] = check_kernel(
            "mlxrunner-qwen3-5: fused q/k norm kernel",
            lambda: _qk_launch(probe, q_weight, k_weight, inv_freq, position.reshape(1), dims,
                               B, L),
            lambda: reference(probe, position), _tolerance(rows.dtype))
    return verdict


def qk_norm_rope(rows: mx.array, q_weight: mx.array, k_weight: mx.array, inv_freq: mx.array,
                 position: mx.array, dims: tuple[int, int, int, int, float], B: int, L: int
                 ) -> tuple[mx.array, mx.array]:
    """q ``[B, H, L, D]`` and k ``[B, Hk, L, D]``, normalised and rotated, from the joined
    projection rows ``[B * L, P]`` (only where :func:`qk_norm_rope_usable` said yes)."""
    return _qk_launch(rows, q_weight, k_weight, inv_freq, position, dims, B, L)
