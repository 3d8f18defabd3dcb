"""Qwen3.5 (dense) text decoder: Gated DeltaNet and gated full-attention layers.

Layer ``i`` is a Gated DeltaNet (linear attention) layer or a full-attention
layer as ``layer_types`` says (else every ``full_attention_interval``-th layer
is full attention). Each layer is
``h = x + mixer(input_layernorm(x)); out = h + mlp(post_attention_layernorm(h))``.

Gated DeltaNet, per value head with state ``S [Dv, Dk]`` (float32)::

    S = exp(g) * S;  d = beta * (v - S k);  S = S + d k^T;  o = S q

Prefill and verify forwards use the chunked (WY) form: inside a chunk of ``C``
tokens the ``C`` rank-one updates collapse into a unit lower-triangular system
solved with matmuls, and only the chunk boundaries are scanned sequentially
(one ``S @ M + B`` per chunk). Single-token decode uses the recurrence above in
one compiled function (on CUDA, one fused kernel: cuda_kernels.py). Both read and
write a ``RecurrentCache``; full-attention layers use a ``KVCache``.

Decoding is the hot path: a forward of up to ``TRACED_BLOCK`` tokens through filled caches
(decode steps, speculative verify blocks) is traced once per length with ``mx.compile`` and
replayed, so a step costs one call from Python instead of building hundreds of graph
nodes. The traced forward writes keys and values at a traced offset into fixed-size buffers
read under a validity mask, and runs the DeltaNet per token (the recurrence unrolled, on
CUDA one block-kernel launch per layer), also returning each token's key, correction and
decay so that a rollback rebuilds the state at any interior boundary in a few operations.
The first call of each trace is checked against the eager forward; prompts run eagerly.

Checkpoint conventions handled by ``sanitize``: Hub (transformers) checkpoints
store zero-centred RMSNorm weights (the norm multiplies by ``1 + w``) and the
depthwise convolution as ``[C, 1, K]``; MLX-converted checkpoints (mlx-lm's
layout, ``language_model.*`` names) already hold ``1 + w`` and ``[C, K, 1]``.
This module stores the MLX convention, so its norms are plain RMSNorms.

Written against mlxrunner's public API only.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache, lru_cache, partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from mlxrunner import (
    KVCache,
    Model,
    ModelFolderError,
    RecurrentCache,
    attend,
    prepare_attend,
    project,
)

from . import cuda_kernels

LINEAR = "linear_attention"
FULL = "full_attention"

#: tokens per chunk of the chunked DeltaNet form (shorter forwards are one chunk). On the CPU,
#: where flops rather than kernel launches count, smaller chunks are cheaper.
CHUNK_SIZE = 64
CPU_CHUNK_SIZE = 32
#: forwards of up to this many tokens through filled caches (decode steps, speculative verify
#: blocks) are traced once per length with ``mx.compile`` and replayed; longer ones and
#: prompts run eagerly
TRACED_BLOCK = 16
#: full-attention buffers used by traced forwards grow in these steps (each growth retraces
#: once; a traced forward attends over the whole buffer, masked, which costs a CPU more than
#: the rarer retraces save)
DECODE_GROW = 1024
DECODE_GROW_CPU = 256

# Norms whose Hub weights are zero-centred (the model multiplies by 1 + w).
_ZERO_CENTRED_SUFFIXES = (".input_layernorm.weight", ".post_attention_layernorm.weight",
                          ".q_norm.weight", ".k_norm.weight")
_DROPPED_PREFIXES = ("mtp.", "model.mtp.", "model.visual.", "visual.", "vision_tower.",
                     "model.vision_tower.", "language_model.mtp.")


@dataclass(frozen=True)
class Qwen3_5Config:
    """The config.json fields (text part) this architecture reads."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    layer_types: tuple[str, ...]
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int = 4
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 0.25
    tie_word_embeddings: bool = False
    attention_bias: bool = False

    @property
    def rotary_dims(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> Qwen3_5Config:
        required = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                    "num_attention_heads")
        missing = [key for key in required if key not in config]
        if missing:
            raise ModelFolderError(f"config.json lacks {', '.join(map(repr, missing))} "
                                   "needed by the qwen3_5 architecture")
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise ModelFolderError(f"qwen3_5 supports hidden_act 'silu' only, got {act!r}")
        if config.get("num_experts"):
            raise ModelFolderError("qwen3_5 mixture-of-experts checkpoints are not supported yet")
        layers = int(config["num_hidden_layers"])
        layer_types = config.get("layer_types")
        if layer_types is None:
            interval = int(config.get("full_attention_interval", 4))
            layer_types = [FULL if (i + 1) % interval == 0 else LINEAR for i in range(layers)]
        layer_types = tuple(layer_types)
        if len(layer_types) < layers or any(t not in (LINEAR, FULL) for t in layer_types):
            raise ModelFolderError(f"qwen3_5 layer_types must list {layers} entries of "
                                   f"{LINEAR!r} / {FULL!r}, got {list(layer_types)}")
        rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ModelFolderError(f"qwen3_5 supports rope_type 'default' only, got {rope_type!r}")
        heads = int(config["num_attention_heads"])
        hidden = int(config["hidden_size"])
        value_heads = int(config.get("linear_num_value_heads", 32))
        key_heads = int(config.get("linear_num_key_heads", 16))
        if value_heads % key_heads:
            raise ModelFolderError(f"qwen3_5 needs linear_num_value_heads ({value_heads}) to be "
                                   f"a multiple of linear_num_key_heads ({key_heads})")
        return cls(
            vocab_size=int(config["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(config["intermediate_size"]),
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=int(config.get("num_key_value_heads") or heads),
            head_dim=int(config.get("head_dim") or 256),
            layer_types=layer_types[:layers],
            linear_num_key_heads=key_heads,
            linear_num_value_heads=value_heads,
            linear_key_head_dim=int(config.get("linear_key_head_dim", 128)),
            linear_value_head_dim=int(config.get("linear_value_head_dim", 128)),
            linear_conv_kernel_dim=int(config.get("linear_conv_kernel_dim", 4)),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", config.get("rope_theta", 10000.0))),
            partial_rotary_factor=float(rope.get("partial_rotary_factor",
                                                 config.get("partial_rotary_factor", 0.25))),
            tie_word_embeddings=bool(config.get("tie_word_embeddings", False)),
            attention_bias=bool(config.get("attention_bias", False)),
        )


# -- Gated DeltaNet arithmetic ----------------------------------------------------------------


def _normalize_qk(q: mx.array, k: mx.array, eps: float = 1e-6) -> tuple[mx.array, mx.array]:
    """L2-normalise q and k in float32 (``x / sqrt(sum x^2 + eps)``), q also times ``Dk^-0.5``.

    ``rms_norm(x, eps / D)`` is ``sqrt(D) * x / sqrt(sum x^2 + eps)``, hence the factors.
    """
    dk = q.shape[-1]
    q = mx.fast.rms_norm(q.astype(mx.float32), None, eps / dk) * (1.0 / dk)
    k = mx.fast.rms_norm(k.astype(mx.float32), None, eps / dk) * (dk ** -0.5)
    return q, k


def _decay_and_beta(a: mx.array, b: mx.array, A_log: mx.array,
                    dt_bias: mx.array) -> tuple[mx.array, mx.array]:
    """Log decay ``g = -exp(A_log) * softplus(a + dt_bias)`` and ``beta = sigmoid(b)``, float32."""
    a = a.astype(mx.float32) + dt_bias.astype(mx.float32)
    g = -mx.exp(A_log.astype(mx.float32)) * nn.softplus(a)
    return g, mx.sigmoid(b.astype(mx.float32))


@cache
def _triangles(size: int) -> tuple[mx.array, mx.array]:
    """Lower-triangular masks with and without the diagonal (built once per size)."""
    causal = mx.tril(mx.ones((size, size), dtype=mx.bool_))
    strict = mx.tril(mx.ones((size, size), dtype=mx.bool_), k=-1)
    mx.eval(causal, strict)
    return causal, strict


@cache
def _inv_freq(rotary_dims: int, base: float) -> mx.array:
    """RoPE's inverse frequencies ``base ** (-2i / rotary_dims)`` (float32, evaluated once)."""
    exponents = mx.arange(0, rotary_dims, 2, dtype=mx.float32) / rotary_dims
    freqs = mx.power(mx.array(base, dtype=mx.float32), -exponents)
    mx.eval(freqs)
    return freqs


@lru_cache(maxsize=16)  # a few buffer sizes are live at a time; old ones may go
def _key_distances(length: int, size: int) -> mx.array:
    """``[length, size]``: key position minus query row (``j - i``), evaluated once: query
    row ``i`` of a traced forward at ``offset`` sees key ``j`` where this is ``<= offset``
    (one comparison per call rather than building the positions)."""
    distances = mx.arange(size, dtype=mx.int32)[None] - mx.arange(length, dtype=mx.int32)[:, None]
    mx.eval(distances)
    return distances


@cache
def _identity(size: int) -> mx.array:
    eye = mx.eye(size, dtype=mx.float32)
    mx.eval(eye)
    return eye


def _unit_lower_inverse(a: mx.array, leaf: int = 16) -> mx.array:
    """``(I + A)^-1`` for strictly lower-triangular ``A [..., C, C]``, by matmuls only.

    Blocks of up to ``leaf`` rows: ``A`` is nilpotent, so
    ``(I + A)^-1 = (I - A)(I + A^2)(I + A^4)...`` with ``ceil(log2 C)`` factors is exact.
    Larger sizes split in halves, ``[[X, 0], [-Y A21 X, Y]]``, which keeps the powers (and
    their float32 rounding) small.
    """
    size = a.shape[-1]
    if size > leaf:
        half = size // 2
        if 2 * half == size:  # invert both diagonal blocks in one batch
            diag = mx.stack([a[..., :half, :half], a[..., half:, half:]])
            upper, lower = _unit_lower_inverse(diag, leaf)
        else:
            upper = _unit_lower_inverse(a[..., :half, :half], leaf)
            lower = _unit_lower_inverse(a[..., half:, half:], leaf)
        corner = -((lower @ a[..., half:, :half]) @ upper)
        top = mx.concatenate([upper, mx.zeros_like(a[..., :half, half:])], axis=-1)
        return mx.concatenate([top, mx.concatenate([corner, lower], axis=-1)], axis=-2)
    neg = -a
    inv = neg + _identity(size)
    power = neg
    for _ in range(max(0, math.ceil(math.log2(size)) - 1)):
        power = power @ power
        inv = mx.addmm(inv, inv, power)
    return inv


def chunked_gated_delta(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array,
                        state: mx.array, chunk_size: int | None = None,
                        ) -> tuple[mx.array, mx.array, Callable[[int], mx.array]]:
    """The gated delta rule over ``L`` tokens in chunked form.

    q, k ``[B, L, Hk, Dk]`` (normalised, float32), v ``[B, L, Hv, Dv]``, g (log decay) and
    beta ``[B, L, Hv]``, state ``[B, Hv, Dv, Dk]`` float32; value head ``h`` reads key head
    ``h // (Hv / Hk)``. Returns the outputs ``[B, L, Hv, Dv]`` (float32), the final state and
    ``state_after(j)``: the state after the first ``j`` tokens, as a few lazy operations on
    this call's intermediate arrays (for snapshot restore).
    """
    B, L, Hk, Dk = k.shape
    Hv, Dv = v.shape[2], v.shape[3]
    if chunk_size is None:
        chunk_size = CPU_CHUNK_SIZE if mx.default_device() == mx.cpu else CHUNK_SIZE
    if Hv != Hk:
        q = mx.repeat(q, Hv // Hk, axis=2)
        k = mx.repeat(k, Hv // Hk, axis=2)
    C = min(chunk_size, L)
    n = -(-L // C)
    pad = n * C - L
    f32 = mx.float32

    def chunks(x: mx.array) -> mx.array:  # [B, L, H, D] -> [B, H, n, C, D]
        x = x.astype(f32).transpose(0, 2, 1, 3)
        if pad:  # zero k, v, beta and g leave the state unchanged
            x = mx.pad(x, [(0, 0), (0, 0), (0, pad), (0, 0)])
        return x.reshape(B, Hv, n, C, x.shape[-1])

    q, k, v = chunks(q), chunks(k), chunks(v)
    g, beta = (chunks(x[..., None])[..., 0] for x in (g, beta))

    G = mx.cumsum(g, axis=-1)  # [B, H, n, C] log of the decay since the chunk start
    causal, strict = _triangles(C)
    # decay[t, i] = exp(G_t - G_i) for i <= t (masked before exp: the upper part overflows)
    decay = mx.exp(mx.where(causal, G[..., :, None] - G[..., None, :], -mx.inf))
    k_beta = k * beta[..., None]
    eG = mx.exp(G)[..., None]
    # u_t = beta_t (v_t - S_{t-1}' k_t) couples the chunk's tokens through
    # A[t, i] = beta_t exp(G_t - G_i) k_t.k_i (i < t): solve (I + A) [U | W] = [beta v | beta e^G k]
    A = mx.where(strict, (k_beta @ k.swapaxes(-1, -2)) * decay, 0.0)
    T = _unit_lower_inverse(A)
    UW = T @ mx.concatenate([v * beta[..., None], k_beta * eG], axis=-1)
    U_base, W = UW[..., :Dv], UW[..., Dv:]
    # The scan over chunks: u = U_base - W S^T, then S <- e^{G_C} S + u^T Kd, with Kd the
    # keys decayed to the chunk end. Everything else is batched over all chunks.
    G_end = G[..., -1:]
    k_end = k * mx.exp(G_end - G)[..., None]
    chunk_decay = mx.exp(G_end)[..., None]  # [B, H, n, 1, 1]
    starts, values = [], []
    S = state
    for c in range(n):
        starts.append(S)
        u = mx.addmm(U_base[:, :, c], W[:, :, c], S.swapaxes(-1, -2), alpha=-1.0)
        values.append(u)
        S = mx.addmm(S * chunk_decay[:, :, c], u.swapaxes(-1, -2), k_end[:, :, c])
    if n > 1:
        S0, U = mx.stack(starts, axis=2), mx.stack(values, axis=2)  # chunk-start states, u_t
    else:
        S0, U = state[:, :, None], values[0][:, :, None]
    S0_t = S0.swapaxes(-1, -2)
    P = (q @ k.swapaxes(-1, -2)) * decay
    out = (q * eG) @ S0_t + P @ U  # [B, H, n, C, Dv]
    out = out.reshape(B, Hv, n * C, Dv)[:, :, :L].transpose(0, 2, 1, 3)

    def state_after(j: int) -> mx.array:
        c, t = divmod(j - 1, C)
        Gt = G[:, :, c, t:t + 1]
        w = mx.exp(Gt - G[:, :, c, :t + 1])[..., None]
        update = U[:, :, c, :t + 1].swapaxes(-1, -2) @ (k[:, :, c, :t + 1] * w)
        return mx.exp(Gt)[..., None] * S0[:, :, c] + update

    return out, S, state_after


def _gated_rms_norm(x: mx.array, gate: mx.array, weight: mx.array, eps: float) -> mx.array:
    """``weight * rmsnorm(x) * silu(gate)`` (this norm's weight is not zero-centred)."""
    return mx.fast.rms_norm(x, weight, eps) * nn.silu(gate)


def _qk_pairs(conv: mx.array, hk: int, dk: int) -> mx.array:
    """Each key head's normalised (q, k) pair ``[..., Hk, 2, Dk]`` (float32) from the conv
    output ``[..., C]`` (float32): :func:`_normalize_qk` as one rms_norm and one multiply."""
    lead = conv.shape[:-1]
    qk = conv[..., : 2 * hk * dk].reshape(*lead, 2, hk, dk).swapaxes(-3, -2)
    scale = mx.array([[1.0 / dk], [dk ** -0.5]], dtype=mx.float32)  # q row, k row
    return mx.fast.rms_norm(qk, None, 1e-6 / dk) * scale


@cache
def _decode_step(hk: int, hv: int, dk: int, dv: int, eps: float) -> Callable[..., Any]:
    """Compiled single-token DeltaNet core: conv, recurrence, gated norm (shared by layers).

    Laid out for few operations: q and k are normalised together, value heads are grouped
    by the key head they read (``[B, Hk, Hv / Hk, ...]``: q and k are broadcast, not
    repeated), ``S q`` and ``S k`` come from one product and ``k . q`` from another.
    """
    rep = hv // hk

    def step(qkv: mx.array, z: mx.array, b: mx.array, a: mx.array, conv_tail: mx.array,
             state: mx.array, conv_weight: mx.array, A_log: mx.array, dt_bias: mx.array,
             norm_weight: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        B = qkv.shape[0]
        dtype = qkv.dtype
        window = mx.concatenate([conv_tail, qkv], axis=1)  # [B, K, C]
        conv = _conv_silu(*_conv_taps(window, 1), *_conv_columns(conv_weight)
                          ).astype(mx.float32).squeeze(1)  # [B, C]
        qk = _qk_pairs(conv, hk, dk)  # [B, Hk, 2, Dk]
        v = conv[:, 2 * hk * dk:].reshape(B, hk, rep, dv)
        g, beta = _decay_and_beta(a, b, A_log, dt_bias)  # [B, 1, Hv]
        e = mx.exp(g).reshape(B, hk, rep, 1)
        S = state.reshape(B, hk, rep, dv, dk)
        # With S' = e S + d k^T: S q and S k come from one product; S' q = e Sq + d (k.q).
        sq_sk = qk[:, :, None] @ S.swapaxes(-1, -2)  # [B, Hk, rep, 2, Dv]
        kq = (qk @ qk.swapaxes(-1, -2))[:, :, None, 0, 1:]  # [B, Hk, 1, 1]
        delta = beta.reshape(B, hk, rep, 1) * (v - e * sq_sk[..., 1, :])
        new_state = e[..., None] * S + delta[..., :, None] * qk[:, :, None, 1:]
        out = (e * sq_sk[..., 0, :] + delta * kq).reshape(B, hv, dv)
        out = _gated_rms_norm(out.astype(dtype), z.reshape(B, hv, dv), norm_weight, eps)
        return out.reshape(B, 1, hv * dv), window[:, 1:], new_state.reshape(state.shape)

    return mx.compile(step)


@cache
def _block_step(hk: int, hv: int, dk: int, dv: int, eps: float) -> Callable[..., Any]:
    """Compiled DeltaNet core over a short block of ``L`` tokens: the per-token recurrence
    of :func:`_decode_step` unrolled (a verify block is too short for the chunked form to
    pay). Returns ``(out, new_tail, new_state, k, delta, g)``: besides what the step returns,
    each token's normalised key ``[B, Hv, L, Dk]``, correction ``d_t`` ``[B, Hv, L, Dv]`` and
    log decay ``[B, Hv, L]``, from which :func:`_block_state_after` rebuilds interior states."""
    rep = hv // hk

    def block(qkv: mx.array, z: mx.array, b: mx.array, a: mx.array, conv_tail: mx.array,
              state: mx.array, conv_weight: mx.array, A_log: mx.array, dt_bias: mx.array,
              norm_weight: mx.array) -> tuple[mx.array, ...]:
        B, L, _ = qkv.shape
        dtype = qkv.dtype
        window = mx.concatenate([conv_tail, qkv], axis=1)  # [B, K - 1 + L, C]
        conv = _conv_silu(*_conv_taps(window, L), *_conv_columns(conv_weight)
                          ).astype(mx.float32)
        qk = _qk_pairs(conv, hk, dk)  # [B, L, Hk, 2, Dk]
        v = conv[..., 2 * hk * dk:].reshape(B, L, hk, rep, dv)
        kq = (qk @ qk.swapaxes(-1, -2))[..., None, 0, 1:]  # [B, L, Hk, 1, 1]
        g, beta = _decay_and_beta(a, b, A_log, dt_bias)  # [B, L, Hv]
        e = mx.exp(g).reshape(B, L, hk, rep, 1)
        beta = beta.reshape(B, L, hk, rep, 1)
        outs, deltas = [], []
        S = state.reshape(B, hk, rep, dv, dk)
        for t in range(L):
            qk_t, e_t = qk[:, t], e[:, t]
            sq_sk = qk_t[:, :, None] @ S.swapaxes(-1, -2)  # [B, Hk, rep, 2, Dv]
            delta = beta[:, t] * (v[:, t] - e_t * sq_sk[..., 1, :])
            S = e_t[..., None] * S + delta[..., :, None] * qk_t[:, :, None, 1:]
            outs.append(e_t * sq_sk[..., 0, :] + delta * kq[:, t])
            deltas.append(delta)
        out = mx.stack(outs, axis=1).reshape(B, L, hv, dv)
        out = _gated_rms_norm(out.astype(dtype), z.reshape(B, L, hv, dv), norm_weight, eps)
        # per value head, [B, Hv, L, D] as the block kernel writes them
        k = mx.broadcast_to(qk[:, :, :, None, 1], (B, L, hk, rep, dk)).reshape(B, L, hv, dk)
        delta = mx.stack(deltas, axis=1).reshape(B, L, hv, dv)
        return (out.reshape(B, L, hv * dv), window[:, L:], S.reshape(state.shape),
                k.transpose(0, 2, 1, 3), delta.transpose(0, 2, 1, 3), g.transpose(0, 2, 1))

    return mx.compile(block)


@cache
def _block_state_after(j: int) -> Callable[..., tuple[mx.array, mx.array]]:
    """Compiled: the conv tail and state after the first ``j`` tokens of a traced block,
    from its starting tail and state, its inputs ``qkv`` and the block outputs k, delta, g:
    ``S_j = e^{G_j} S_0 + sum_{t<=j} e^{G_j - G_t} d_t k_t^T`` with ``G`` the cumulative log
    decay."""

    def state_after(tail: mx.array, state: mx.array, qkv: mx.array, k: mx.array,
                    delta: mx.array, g: mx.array) -> tuple[mx.array, mx.array]:
        window = mx.concatenate([tail, qkv[:, :j]], axis=1)
        G = mx.cumsum(g[..., :j], axis=-1)
        G_j = G[..., -1:]
        weights = mx.exp(G_j - G)[..., None]  # [B, Hv, j, 1]
        update = (delta[:, :, :j] * weights).swapaxes(-1, -2) @ k[:, :, :j]
        return window[:, j:], mx.exp(G_j)[..., None] * state + update

    return mx.compile(state_after)


def _conv_taps(window: mx.array, L: int) -> list[mx.array]:
    """The K shifted inputs ``[B, L, C]`` of the causal convolution from its window
    ``[B, K - 1 + L, C]`` (one split for a single token)."""
    K = window.shape[1] - L + 1
    if L == 1:
        return mx.split(window, K, axis=1)
    return [window[:, i:i + L] for i in range(K)]


def _conv_columns(conv_weight: mx.array) -> list[mx.array]:
    """The K weight columns ``[1, 1, C]`` of the depthwise weight ``[C, K, 1]``: one
    transpose and one split."""
    return mx.split(conv_weight.T, conv_weight.shape[1], axis=1)


@partial(mx.compile, shapeless=True)
def _swiglu(gate: mx.array, up: mx.array) -> mx.array:
    return nn.silu(gate) * up


@partial(mx.compile, shapeless=True)
def _sigmoid_gate(x: mx.array, gate: mx.array) -> mx.array:
    return x * mx.sigmoid(gate)


@partial(mx.compile, shapeless=True)
def _conv_silu(*taps_and_weights: mx.array) -> mx.array:
    """``silu(sum_i x_i * w_i)`` accumulated in float32, for the K shifted inputs ``x_i``
    and the K weight columns ``w_i`` of the depthwise causal convolution."""
    half = len(taps_and_weights) // 2
    acc = None
    for x, w in zip(taps_and_weights[:half], taps_and_weights[half:]):
        term = x.astype(mx.float32) * w.astype(mx.float32)
        acc = term if acc is None else acc + term
    return nn.silu(acc.astype(taps_and_weights[0].dtype))


# -- projections ------------------------------------------------------------------------------


class _Projection:
    """One matmul for one or more bias-free linear layers of ``owner`` that read one input.

    Decoding one token is bound by the number of operations, not by arithmetic, so the
    in-projections of a layer share one matmul (whose output one ``Split`` cuts into the
    layers' outputs) and a residual add rides in the output projection
    (:func:`mlxrunner.project`: one AddMM, except on CUDA). The
    layers keep their checkpoint names and shapes: on first use their weights are
    concatenated along the output rows and each layer's arrays are replaced by row slices
    (views) of the concatenation, so memory is not doubled. New weights loaded later (other
    array objects) are noticed and concatenated again. Layers that cannot share a matmul
    (different quantization, a bias) run one by one. An embedding (a tied output head)
    counts as a linear layer with the same weight layout.
    """

    def __init__(self, *names: str) -> None:
        self.names = names
        self.sources: tuple[mx.array, ...] = ()
        self.fused: tuple[Any, ...] | None = None  # (kind, arrays...) once built
        self.cuts: list[int] = []  # where each layer's output columns start (after the first)

    def _layers(self, owner: nn.Module) -> list[nn.Module]:
        return [getattr(owner, name) for name in self.names]

    def _build(self, layers: list[nn.Module]) -> None:
        plain = all(type(layer) in (nn.Linear, nn.Embedding) and "bias" not in layer
                    for layer in layers)
        quantized = all(isinstance(layer, (nn.QuantizedLinear, nn.QuantizedEmbedding))
                        and "bias" not in layer for layer in layers) and len(
            {(layer.group_size, layer.bits, layer.mode) for layer in layers}) == 1
        self.fused = None
        if plain or quantized:
            keys = ("weight",) if plain else ("weight", "scales", "biases")
            if quantized and any(layer.get("biases") is None for layer in layers):
                keys = ("weight", "scales")
            rows = [layer.weight.shape[0] for layer in layers]
            starts = [sum(rows[:i]) for i in range(len(rows) + 1)]
            self.cuts = starts[1:-1]
            arrays = []
            for key in keys:
                joined = (layers[0][key] if len(layers) == 1 else
                          mx.concatenate([layer[key] for layer in layers], axis=0))
                if len(layers) > 1:
                    for layer, a, b in zip(layers, starts[:-1], starts[1:]):
                        setattr(layer, key, joined[a:b])
                arrays.append(joined)
            if plain:
                self.fused = ("plain", arrays[0].T)
            else:
                first = layers[0]
                self.fused = ("quantized", *arrays, *([None] * (3 - len(arrays))),
                              first.group_size, first.bits, first.mode)
            # Materialise the joined arrays now: a traced forward that captured them lazy
            # would concatenate (and transpose) the weights again in every call.
            mx.eval([a for a in self.fused if isinstance(a, mx.array)])
        self.sources = tuple(layer.weight for layer in layers)

    def ensure(self, owner: nn.Module) -> list[nn.Module]:
        """Build (or rebuild, after new weights) the fused matmul; returns the layers.
        Traced forwards call this eagerly first: the build must not happen inside a trace."""
        layers = self._layers(owner)
        if len(self.sources) != len(layers) or any(
                a is not layer.weight for a, layer in zip(self.sources, layers)):
            self._build(layers)
        return layers

    def joined(self, owner: nn.Module, x: mx.array,
               residual: mx.array | None = None) -> mx.array | None:
        """The one matmul's output (``residual`` added), or None where the layers run one
        by one. ``x`` as rows ``[N, in]`` (with ``residual [N, out]``) needs no broadcast
        of the weight nor a flatten around the product."""
        self.ensure(owner)
        if self.fused is None:
            return None
        if self.fused[0] == "plain":
            return project(x, self.fused[1], residual)
        _, w, scales, biases, group_size, bits, mode = self.fused
        y = mx.quantized_matmul(x, w, scales=scales, biases=biases, transpose=True,
                                group_size=group_size, bits=bits, mode=mode)
        return y if residual is None else residual + y

    def split(self, joined: mx.array) -> list[mx.array]:
        """The layers' outputs from a joined output (any leading shape): one operation."""
        if not self.cuts:
            return [joined]
        return mx.split(joined, self.cuts, axis=-1)

    def __call__(self, owner: nn.Module, x: mx.array,
                 residual: mx.array | None = None) -> list[mx.array]:
        """The layers' outputs (``residual`` added, for a single layer)."""
        joined = self.joined(owner, x, residual)
        if joined is not None:
            return self.split(joined)
        outs = [layer(x) for layer in self._layers(owner)]
        if residual is not None:
            outs[0] = residual + outs[0]
        return outs


# -- layers -----------------------------------------------------------------------------------


class GatedDeltaNet(nn.Module):
    """Linear-attention mixer with a causal depthwise convolution and a gated delta rule."""

    def __init__(self, cfg: Qwen3_5Config) -> None:
        super().__init__()
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.kernel = cfg.linear_conv_kernel_dim
        self.eps = cfg.rms_norm_eps
        self.channels = 2 * self.hk * self.dk + self.hv * self.dv
        hidden = cfg.hidden_size
        self.in_proj_qkv = nn.Linear(hidden, self.channels, bias=False)
        self.in_proj_z = nn.Linear(hidden, self.hv * self.dv, bias=False)
        self.in_proj_b = nn.Linear(hidden, self.hv, bias=False)
        self.in_proj_a = nn.Linear(hidden, self.hv, bias=False)
        # Depthwise weight [C, K, 1] (MLX's grouped-conv layout), applied as K shifted
        # multiply-adds (one fused kernel) rather than a grouped convolution.
        self.conv1d = nn.Conv1d(self.channels, self.channels, self.kernel, groups=self.channels,
                                bias=False)
        self.dt_bias = mx.ones((self.hv,))
        self.A_log = mx.log(mx.random.uniform(1.0, 16.0, (self.hv,)))
        self.norm = nn.RMSNorm(self.dv, eps=self.eps)  # holds the gated norm's weight
        self.out_proj = nn.Linear(self.hv * self.dv, hidden, bias=False)
        self._in = _Projection("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a")
        self._out = _Projection("out_proj")

    def __call__(self, x: mx.array, cache: RecurrentCache | None,
                 residual: mx.array) -> mx.array:
        """``residual + mixer(x)``."""
        B, L, _ = x.shape
        qkv, z, b, a = self._in(self, x)
        if cache is not None and cache.recurrent_state is not None:
            conv_tail, state = cache.conv_tail, cache.recurrent_state
        else:
            conv_tail = mx.zeros((B, self.kernel - 1, self.channels), dtype=qkv.dtype)
            state = mx.zeros((B, self.hv, self.dv, self.dk), dtype=mx.float32)

        if L == 1:
            args = (qkv, z, b, a, conv_tail, state, self.conv1d.weight, self.A_log,
                    self.dt_bias, self.norm.weight)
            dims = (self.hk, self.hv, self.dk, self.dv, self.eps)
            out, conv_tail, state = cuda_kernels.deltanet_step(args, _decode_step(*dims), *dims)
            if cache is not None:
                cache.advance(1, conv_tail, state)
            return self._out(self, out, residual)[0]

        window = mx.concatenate([conv_tail, qkv], axis=1)  # [B, K - 1 + L, C]
        weight = self.conv1d.weight[..., 0]  # [C, K]
        conv = _conv_silu(*(window[:, i:i + L] for i in range(self.kernel)),
                          *(weight[:, i] for i in range(self.kernel)))
        hk_dk = self.hk * self.dk
        q = conv[..., :hk_dk].reshape(B, L, self.hk, self.dk)
        k = conv[..., hk_dk:2 * hk_dk].reshape(B, L, self.hk, self.dk)
        v = conv[..., 2 * hk_dk:].reshape(B, L, self.hv, self.dv)
        q, k = _normalize_qk(q, k)
        g, beta = _decay_and_beta(a, b, self.A_log, self.dt_bias)
        out, state, state_after = chunked_gated_delta(q, k, v, g, beta, state)
        out = _gated_rms_norm(out.astype(x.dtype), z.reshape(B, L, self.hv, self.dv),
                              self.norm.weight, self.eps)
        if cache is not None:
            keep = self.kernel - 1
            capture = None
            if cache.snapshot_positions(L):
                def capture(j: int) -> tuple[mx.array, mx.array]:
                    return window[:, j:j + keep], state_after(j)
            # a copy, so that the cache does not keep the whole window alive
            cache.advance(L, mx.contiguous(window[:, L:]), state, capture)
        return self._out(self, out.reshape(B, L, -1), residual)[0]


    def dims(self) -> tuple[int, int, int, int, float]:
        return (self.hk, self.hv, self.dk, self.dv, self.eps)

    def prepare_traced(self, batch: int, length: int, dtype: mx.Dtype) -> None:
        """Eager setup a traced forward needs before it is traced: the fused projections
        and the CUDA kernels' self-checks (on random inputs of these shapes)."""
        self._in.ensure(self)
        self._out.ensure(self)
        args = (mx.zeros((batch, length, self.channels), dtype),
                mx.zeros((batch, length, self.hv * self.dv), dtype),
                mx.zeros((batch, length, self.hv), dtype),
                mx.zeros((batch, length, self.hv), dtype),
                mx.zeros((batch, self.kernel - 1, self.channels), dtype),
                mx.zeros((batch, self.hv, self.dv, self.dk), mx.float32),
                self.conv1d.weight, self.A_log, self.dt_bias, self.norm.weight)
        if length == 1:
            cuda_kernels.prepare("step", args, _decode_step(*self.dims()), *self.dims())
        else:
            cuda_kernels.prepare("block", args, _block_step(*self.dims()), *self.dims())

    def traced(self, x: mx.array, residual: mx.array, conv_tail: mx.array, state: mx.array,
               capture: bool) -> tuple[mx.array, mx.array, mx.array, list[mx.array]]:
        """Inside a traced forward through a filled cache, on rows ``x, residual [B * L,
        hidden]``: ``residual + mixer(x)``, the new conv tail and state, and (``capture``,
        blocks of L > 1) the arrays :func:`_block_state_after` rebuilds interior states
        from: qkv, k, delta, g. The DeltaNet core (and its kernels) sees ``[B, L, ...]``."""
        B = conv_tail.shape[0]
        L = x.shape[0] // B
        joined = self._in.joined(self, x)
        if joined is None:  # the in-projections run one by one
            qkv, z, b, a = (part.reshape(B, L, -1) for part in self._in(self, x))
        else:
            joined = joined.reshape(B, L, -1)
            qkv, z, b, a = self._in.split(joined)
        args = (qkv, z, b, a, conv_tail, state, self.conv1d.weight, self.A_log,
                self.dt_bias, self.norm.weight)
        extra: list[mx.array] = []
        if L == 1:
            out, tail, state = cuda_kernels.deltanet_step(args, _decode_step(*self.dims()),
                                                          *self.dims(), joined=joined)
        else:
            out, tail, state, k, delta, g = cuda_kernels.deltanet_block(
                args, _block_step(*self.dims()), *self.dims(), joined=joined)
            if capture:
                extra = [qkv, k, delta, g]
        return self._out(self, out.reshape(B * L, -1), residual)[0], tail, state, extra


class Attention(nn.Module):
    """Full attention: gated output, q/k RMSNorm, partial RoPE, grouped-query heads."""

    def __init__(self, cfg: Qwen3_5Config) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = (cfg.num_attention_heads,
                                                     cfg.num_key_value_heads, cfg.head_dim)
        self.scale = self.head_dim ** -0.5
        self.rotary_dims, self.rope_theta = cfg.rotary_dims, cfg.rope_theta
        hidden, bias = cfg.hidden_size, cfg.attention_bias
        self.q_proj = nn.Linear(hidden, self.heads * self.head_dim * 2, bias=bias)
        self.k_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=bias)
        self.q_norm = nn.RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
        self.k_norm = nn.RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
        self._in = _Projection("q_proj", "k_proj", "v_proj")
        self._out = _Projection("o_proj")

    def _project(self, x: mx.array, offset: int | mx.array, B: int, L: int
                 ) -> tuple[mx.array, mx.array, mx.array, mx.array]:
        """Queries, keys, values (normed, rotated) and the output gate, all ``[B, H, L, D]``,
        from ``x`` (``[B, L, hidden]`` or rows ``[B * L, hidden]``)."""
        joined = self._in.joined(self, x)
        if joined is None:  # the projections run one by one
            joined = mx.concatenate(self._in(self, x), axis=-1)
        flat = joined.reshape(B * L, -1)
        # The joined row is D-wide head rows [q_0 | gate_0 | q_1 | gate_1 | ... | k | v]:
        # one reshape and one transpose give every head row as [B, rows, L, D].
        q_gate, k, v = self._heads(flat, B, L)
        gate = q_gate[:, 1::2]
        if self._fused_qk(flat, B, L):  # CUDA: both norms and both rotations, one kernel
            position = offset.reshape(1) if isinstance(offset, mx.array) else \
                mx.array([offset], dtype=mx.int32)
            q, k = cuda_kernels.qk_norm_rope(flat, self.q_norm.weight, self.k_norm.weight,
                                             _inv_freq(self.rotary_dims, self.rope_theta),
                                             position.astype(mx.int32), self._qk_dims(), B, L)
            return q, k, v, gate
        q, k = self._norm_rope(q_gate[:, 0::2], k, offset)
        return q, k, v, gate

    def _heads(self, flat: mx.array, B: int, L: int) -> list[mx.array]:
        """``[q | gate pairs, k, v]`` heads ``[B, heads, L, D]`` of joined rows (views)."""
        rows = flat.reshape(B, L, -1, self.head_dim).transpose(0, 2, 1, 3)
        pairs = 2 * self.heads
        return mx.split(rows, [pairs, pairs + self.kv_heads], axis=1)

    def _norm_rope(self, q: mx.array, k: mx.array, offset: int | mx.array
                   ) -> tuple[mx.array, mx.array]:
        q = mx.fast.rope(self.q_norm(q), self.rotary_dims, traditional=False,
                         base=self.rope_theta, scale=1.0, offset=offset)
        k = mx.fast.rope(self.k_norm(k), self.rotary_dims, traditional=False,
                         base=self.rope_theta, scale=1.0, offset=offset)
        return q, k

    def _qk_dims(self) -> tuple[int, int, int, int, float]:
        return (self.heads, self.kv_heads, self.head_dim, self.rotary_dims, self.q_norm.eps)

    def _fused_qk(self, flat: mx.array, B: int, L: int) -> bool:
        """Whether the fused q/k kernel serves rows like ``flat`` (self-checked on first
        use against :meth:`_norm_rope`; traced forwards settle that first, in
        :meth:`prepare_traced`)."""
        if self.q_norm.eps != self.k_norm.eps:
            return False

        def reference(rows: mx.array, position: mx.array) -> tuple[mx.array, mx.array]:
            q_gate, k, _ = self._heads(rows, B, L)
            return self._norm_rope(q_gate[:, 0::2], k, position)

        return cuda_kernels.qk_norm_rope_usable(
            flat, self.q_norm.weight, self.k_norm.weight, self._qk_dims(), B, L, reference,
            _inv_freq(self.rotary_dims, self.rope_theta))

    def _finish(self, out: mx.array, gate: mx.array, residual: mx.array) -> mx.array:
        """``residual + o_proj(out * sigmoid(gate))`` for ``out, gate [B, H, L, D]``, in
        ``residual``'s shape."""
        out = _sigmoid_gate(out, gate).transpose(0, 2, 1, 3)
        return self._out(self, out.reshape(*residual.shape[:-1], -1), residual)[0]

    def __call__(self, x: mx.array, cache: KVCache | None, residual: mx.array) -> mx.array:
        """``residual + attention(x)``."""
        B, L, _ = x.shape
        offset = 0 if cache is None else cache.offset
        q, k, v, gate = self._project(x, offset, B, L)
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        out = attend(q, k, v, scale=self.scale, mask="causal" if L > 1 else None)
        return self._finish(out, gate, residual)

    def prepare_traced(self, batch: int, length: int, dtype: mx.Dtype) -> None:
        """Eager setup before a forward of ``batch x length`` tokens is traced: the joined
        projections and the fused q/k and attention kernels' self-checks."""
        self._in.ensure(self)
        self._out.ensure(self)
        width = (2 * self.heads + 2 * self.kv_heads) * self.head_dim
        self._fused_qk(mx.zeros((batch * length, width), dtype), batch, length)
        prepare_attend(self.heads, self.kv_heads, self.head_dim, self.head_dim, length, dtype)

    def traced(self, x: mx.array, residual: mx.array, keys: mx.array, values: mx.array,
               offset: mx.array, start: mx.array, mask: mx.array
               ) -> tuple[mx.array, mx.array, mx.array]:
        """Inside a traced forward, on rows ``x, residual [B * L, hidden]``: write the new
        keys and values into the fixed-size buffers at ``offset`` (``start``: the same as
        ``[offset]``) and attend over the whole buffers under ``mask``."""
        B = keys.shape[0]
        q, k, v, gate = self._project(x, offset, B, x.shape[0] // B)
        keys = mx.slice_update(keys, k, start, (2,))
        values = mx.slice_update(values, v, start, (2,))
        out = attend(q, keys, values, scale=self.scale, mask=mask)
        return self._finish(out, gate, residual), keys, values


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self._in = _Projection("gate_proj", "up_proj")
        self._out = _Projection("down_proj")

    def __call__(self, x: mx.array, residual: mx.array) -> mx.array:
        """``residual + mlp(x)``."""
        gate, up = self._in(self, x)
        return self._out(self, _swiglu(gate, up), residual)[0]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Qwen3_5Config, layer_type: str) -> None:
        super().__init__()
        self.is_linear = layer_type == LINEAR
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = Attention(cfg)
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)

    def __call__(self, x: mx.array, cache: Any) -> mx.array:
        mixer = self.linear_attn if self.is_linear else self.self_attn
        h = mixer(self.input_layernorm(x), cache, x)
        return self.mlp(self.post_attention_layernorm(h), h)


class TextModel(nn.Module):
    def __init__(self, cfg: Qwen3_5Config) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [DecoderLayer(cfg, t) for t in cfg.layer_types]
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)


class Qwen3_5(Model):
    """Qwen3.5 dense text model (``Qwen3_5ForConditionalGeneration`` / ``Qwen3_5ForCausalLM``)."""

    # The chat format these checkpoints were trained on (used when the user names none and
    # the renderer plugin is installed).
    default_renderer = "qwen3.5"
    default_parser = "qwen3.5"

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        self.config = Qwen3_5Config.from_dict(config)
        self.model = TextModel(self.config)
        if not self.config.tie_word_embeddings:
            self.lm_head = nn.Linear(self.config.hidden_size, self.config.vocab_size, bias=False)
        # traced forwards: the output head (the embedding when tied) as one matmul on a
        # weight transposed once
        self._head = _Projection("embed_tokens" if self.config.tie_word_embeddings
                                 else "lm_head")
        #: trace forwards of up to TRACED_BLOCK tokens through filled caches (False: eager)
        self.compile_steps = True
        self._steps: dict[Any, Callable[..., Any]] = {}

    def update(self, parameters: dict, strict: bool = True) -> Qwen3_5:
        self._steps.clear()  # traced forwards hold the old weights
        return super().update(parameters, strict=strict)

    def update_modules(self, modules: dict, strict: bool = True) -> Qwen3_5:
        self._steps.clear()
        return super().update_modules(modules, strict=strict)

    # -- loading -----------------------------------------------------------
    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Map Hub (composite or text-only) and MLX-converted names to this module's names.

        Drops the vision tower and the MTP head; converts Hub conv weights ``[C, 1, K]`` to
        ``[C, K, 1]`` and folds the ``1 +`` of zero-centred norms into their weights.
        """
        conv_shapes = [v.shape for k, v in weights.items() if k.endswith("conv1d.weight")]
        if conv_shapes:
            hub_layout = any(shape[-1] != 1 for shape in conv_shapes)
        else:  # no DeltaNet layer: mlx-lm names its text weights language_model.*
            hub_layout = not any(k.startswith("language_model.") for k in weights)
        out: dict[str, mx.array] = {}
        for name, value in weights.items():
            if name.startswith(_DROPPED_PREFIXES):
                continue
            if name.startswith("model.language_model."):
                name = "model." + name[len("model.language_model."):]
            elif name.startswith("language_model."):
                name = name[len("language_model."):]
            if self.config.tie_word_embeddings and name.startswith("lm_head."):
                continue
            if hub_layout:
                if name.endswith("conv1d.weight") and value.ndim == 3:
                    value = value.swapaxes(1, 2)
                if name == "model.norm.weight" or name.endswith(_ZERO_CENTRED_SUFFIXES):
                    value = (value.astype(mx.float32) + 1.0).astype(value.dtype)
            out[name] = value
        return out

    # -- running -----------------------------------------------------------
    def make_cache(self) -> list[KVCache | RecurrentCache]:
        return [RecurrentCache() if layer.is_linear else KVCache() for layer in self.model.layers]

    def __call__(self, ids: mx.array, cache: Sequence[Any] | None = None, *,
                 taps: Sequence[int] | None = None) -> mx.array | tuple[mx.array, mx.array]:
        layers = self.model.layers
        if cache is None:
            cache = [None] * len(layers)
        if taps is not None:
            bad = [t for t in {int(t) for t in taps} if not 0 <= t < len(layers)]
            if bad:
                raise ValueError(f"tap layers {sorted(bad)} out of range 0..{len(layers) - 1}")
        taps = None if taps is None else tuple(int(t) for t in taps)
        result = None
        if cache[0] is not None and self.compile_steps and self._can_trace(ids, cache):
            result = self._forward_traced(ids, cache, taps)
        if result is None:
            result = self._forward_eager(ids, cache, taps)
        logits, tapped = result
        if taps is None:
            return logits
        if not taps:
            return logits, mx.zeros((*ids.shape, 0), dtype=logits.dtype)
        return logits, tapped

    def _forward_eager(self, ids: mx.array, cache: Sequence[Any],
                       taps: tuple[int, ...] | None) -> tuple[mx.array, mx.array | None]:
        wanted = set(taps or ())
        tapped: dict[int, mx.array] = {}
        h = self.model.embed_tokens(ids)
        for i, (layer, layer_cache) in enumerate(zip(self.layers, cache)):
            h = layer(h, layer_cache)
            if i in wanted:
                tapped[i] = h
        logits = self.raw_logits(self.model.norm(h))
        if not taps:
            return logits, None
        return logits, mx.concatenate([tapped[t] for t in taps], axis=-1)

    # -- traced forwards: decode steps and short verify blocks -------------------------
    def _can_trace(self, ids: mx.array, cache: Sequence[Any]) -> bool:
        B, L = ids.shape
        if not 0 < L <= TRACED_BLOCK or len(cache) != len(self.layers):
            return False
        offsets = set()
        for layer, c in zip(self.layers, cache):
            if layer.is_linear:
                if not isinstance(c, RecurrentCache) or c.recurrent_state is None or \
                        c.recurrent_state.shape[0] != B:
                    return False
            elif not isinstance(c, KVCache) or c.keys is None or c.keys.shape[0] != B:
                return False
            offsets.add(c.offset)
        return len(offsets) == 1

    def _forward_traced(self, ids: mx.array, cache: Sequence[Any], taps: tuple[int, ...] | None
                        ) -> tuple[mx.array, mx.array | None] | None:
        """One call of a forward traced for this length: ids, offset and every cache's
        arrays in, logits, taps and the new cache arrays out. Full-attention buffers have a
        fixed size (a multiple of the grow step), written at the traced offset and read
        under a validity mask; DeltaNet state and conv tail are plain inputs and outputs."""
        B, L = ids.shape
        layers = self.layers
        offset = cache[0].offset
        grow = DECODE_GROW_CPU if mx.default_device() == mx.cpu else DECODE_GROW
        for layer, c in zip(layers, cache):
            if not layer.is_linear:
                size = c.keys.shape[2]
                if size < offset + L or size % grow:
                    _grow(c, offset, L, grow)
        capture = L > 1 and any(c.snapshot_positions(L) for layer, c in zip(layers, cache)
                                if layer.is_linear)
        key = (taps or None, L, capture)
        step = self._steps.get(key)
        if step is None:
            dtype = self.model.embed_tokens(ids[:, :1]).dtype  # the activations' (lazy)
            for layer in layers:
                if layer.is_linear:
                    layer.linear_attn.prepare_traced(B, L, dtype)
                else:
                    layer.self_attn.prepare_traced(B, L, dtype)
                layer.mlp._in.ensure(layer.mlp)
                layer.mlp._out.ensure(layer.mlp)
            self._head.ensure(self._head_owner())
            step = self._steps[key] = mx.compile(self._step_graph(taps or (), L, capture))
            first_call = True
        else:
            first_call = False
        # The first call of each traced forward is checked against the eager forward on
        # shadow caches (same arrays, other objects): a trace that computes garbage on some
        # backend must not decode garbage silently.
        shadow = _shadow_caches(cache) if first_call else None
        state: list[mx.array] = []
        starts: list[tuple[mx.array, mx.array] | None] = []
        for layer, c in zip(layers, cache):
            if layer.is_linear:
                state += [c.conv_tail, c.recurrent_state]
                starts.append((c.conv_tail, c.recurrent_state) if capture else None)
                c.conv_tail = c.recurrent_state = None
            else:
                state += [c.keys, c.values]
                starts.append(None)
                # drop the cache's references so the write can reuse the buffers
                c.keys = c.values = None
        try:
            out = step(ids, mx.array(offset, mx.int32), mx.array([offset], mx.int32), state)
        except Exception as exc:
            if not first_call:
                raise
            # A forward that cannot be traced here must not stop generation: put the
            # caches back and run eagerly from now on.
            del self._steps[key]
            self.compile_steps = False
            for i, (layer, c) in enumerate(zip(layers, cache)):
                if layer.is_linear:
                    c.conv_tail, c.recurrent_state = state[2 * i], state[2 * i + 1]
                else:
                    c.keys, c.values = state[2 * i], state[2 * i + 1]
            print(f"mlxrunner-qwen3-5: traced forward unavailable ({type(exc).__name__}: "
                  f"{exc}); running eagerly", file=sys.stderr)
            return None
        logits, tapped = out[0], (out[1] if taps else None)
        rest = out[1 + bool(taps):]
        new_state, extras = rest[:2 * len(layers)], rest[2 * len(layers):]
        for i, (layer, c) in enumerate(zip(layers, cache)):
            first, second = new_state[2 * i], new_state[2 * i + 1]
            if not layer.is_linear:
                c.keys, c.values = first, second
                c.offset = offset + L
                continue
            capture_fn = None
            if capture:
                tail0, state0 = starts[i]
                qkv, k, delta, g = extras[:4]
                extras = extras[4:]

                def capture_fn(j: int, tail0=tail0, state0=state0, qkv=qkv, k=k, delta=delta,
                               g=g) -> tuple[mx.array, mx.array]:
                    return _block_state_after(j)(tail0, state0, qkv, k, delta, g)
            c.advance(L, first, second, capture_fn)
        if shadow is not None:
            want = self._forward_eager(ids, shadow, taps)
            if not _agree(logits, want[0]):
                print("mlxrunner-qwen3-5: traced forward disagrees with the eager forward; "
                      "running eagerly", file=sys.stderr)
                self._steps.clear()
                self.compile_steps = False
                for c, s in zip(cache, shadow):
                    c.__dict__.update(s.__dict__)
                return want
        return logits, tapped

    def _step_graph(self, taps: tuple[int, ...], L: int, capture: bool) -> Callable[..., Any]:
        """A forward of ``L`` tokens as a pure function of (ids, offset, ``[offset]``, cache
        arrays). Activations stay rows ``[B * L, hidden]`` from the embedding to the head:
        2-D matmuls need no flatten, unflatten or weight broadcast around them."""
        layers = self.layers
        wanted = set(taps)

        def step(ids: mx.array, offset: mx.array, start: mx.array,
                 state: list[mx.array]) -> list[mx.array]:
            B = ids.shape[0]
            state = list(state)
            extras: list[mx.array] = []
            tapped: dict[int, mx.array] = {}
            masks: dict[int, mx.array] = {}
            h = self.model.embed_tokens(ids).reshape(B * L, -1)
            for i, layer in enumerate(layers):
                x = layer.input_layernorm(h)
                if layer.is_linear:
                    h, state[2 * i], state[2 * i + 1], extra = layer.linear_attn.traced(
                        x, h, state[2 * i], state[2 * i + 1], capture)
                    extras += extra
                else:
                    size = state[2 * i].shape[2]
                    if size not in masks:  # query row i sits at position offset + i
                        masks[size] = _key_distances(L, size) <= offset
                    h, state[2 * i], state[2 * i + 1] = layer.self_attn.traced(
                        x, h, state[2 * i], state[2 * i + 1], offset, start, masks[size])
                h = layer.mlp(layer.post_attention_layernorm(h), h)
                if i in wanted:
                    tapped[i] = h
            head = self._head(self._head_owner(), self.model.norm(h))[0]
            out = [head.reshape(B, L, -1)]
            if taps:
                out.append(mx.concatenate([tapped[t] for t in taps], axis=-1).reshape(B, L, -1))
            return out + state + extras

        return step

    def _head_owner(self) -> nn.Module:
        """The module holding the output head's layer (``self._head`` names it)."""
        return self.model if self.config.tie_word_embeddings else self

    def embed_tokens(self, ids: mx.array) -> mx.array:
        return self.model.embed_tokens(ids)

    def raw_logits(self, hidden: mx.array) -> mx.array:
        if self.config.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(hidden)
        return self.lm_head(hidden)

    # -- facts -------------------------------------------------------------
    @property
    def layers(self) -> list[DecoderLayer]:
        return self.model.layers

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers

    @property
    def vocab_size(self) -> int:
        return self.config.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size


def _grow(cache: KVCache, offset: int, n: int, step: int) -> None:
    """Give a KV cache room for positions up to ``offset + n - 1``, its capacity a multiple
    of ``step`` (a traced forward is traced once per capacity)."""
    B, H, _, Dk = cache.keys.shape
    Dv = cache.values.shape[3]
    size = ((offset + n + step - 1) // step) * step
    keys = mx.zeros((B, H, size, Dk), cache.keys.dtype)
    values = mx.zeros((B, cache.values.shape[1], size, Dv), cache.values.dtype)
    keys[..., :offset, :] = cache.keys[..., :offset, :]
    values[..., :offset, :] = cache.values[..., :offset, :]
    cache.keys, cache.values = keys, values


def _shadow_caches(cache: Sequence[Any]) -> list[Any]:
    """New cache objects holding the same arrays, offsets and schedules (MLX arrays are
    values: a forward through the copies leaves the originals as they are)."""
    out = []
    for c in cache:
        twin = type(c).__new__(type(c))
        twin.__dict__.update(c.__dict__)
        out.append(twin)
    return out


def _agree(got: mx.array, want: mx.array) -> bool:
    """Logits of two paths agree up to their rounding (loose: this catches broken traces).

    In float32 the two paths agree to a few ulps. In half precision their roundings differ
    (the traced verify runs the per-token recurrence, the eager one the chunked form) and a
    random-weight model amplifies that to tens of percent of the largest logit, so there the
    check compares direction: a broken trace gives logits uncorrelated with the eager ones.
    """
    got, want32 = got.astype(mx.float32), want.astype(mx.float32)
    if want.dtype == mx.float32:
        scale = 1.0 + float(mx.abs(want32).max())
        return float(mx.abs(got - want32).max()) <= 1e-3 * scale
    g = got.reshape(-1, got.shape[-1])
    w = want32.reshape(-1, want32.shape[-1])
    g = g - g.mean(axis=-1, keepdims=True)
    w = w - w.mean(axis=-1, keepdims=True)
    cosine = (g * w).sum(-1) / mx.sqrt((g * g).sum(-1) * (w * w).sum(-1) + 1e-12)
    return float(cosine.min()) >= 0.95
