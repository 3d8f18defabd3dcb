"""Gated DeltaNet: the linear-attention mixer of Qwen3.5 (and Qwen3-Next), with the state a
speculative rollback needs.

Per value head, with state ``S [Dv, Dk]`` (float32)::

    S = exp(g) * S;  d = beta * (v - S k);  S = S + d k^T;  o = S q

A prompt runs the chunked (WY) form: inside a chunk of ``C`` tokens the rank-one updates
collapse into a unit lower-triangular system solved with matrix products, and only chunk
boundaries are scanned. Forwards of up to ``BLOCK_TOKENS`` tokens (decode steps, verify
blocks) run the recurrence token by token, on CUDA as one fused kernel per layer
(``cuda_deltanet``), and also return each token's key, correction and decay, from which a
rollback rebuilds the state at any boundary in a few operations (:class:`StateCapture`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import cache, partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from ..cache import RecurrentCache, StateCapture
from . import cuda_deltanet
from .linear import Linear, apply_linear, joined_linears
from .norm import gated_rms_norm
from .parallel import Row, ShardError, Split

#: forwards of up to this many tokens run the per-token recurrence; longer ones (prompts)
#: the chunked form
BLOCK_TOKENS = 16
#: tokens per chunk of the chunked form; on the CPU, where flops rather than launches count,
#: smaller chunks are cheaper
CHUNK_SIZE = 64
CPU_CHUNK_SIZE = 32
#: where the block kernel serves (CUDA), prompts of up to this many tokens run as blocks of
#: ``BLOCK_TOKENS`` through it rather than in the chunked form
SHORT_PROMPT_TOKENS = 64


def normalize_qk(q: mx.array, k: mx.array, eps: float = 1e-6) -> tuple[mx.array, mx.array]:
    """L2-normalise q and k in float32 (``x / sqrt(sum x^2 + eps)``), q also times
    ``Dk^-0.5`` (``rms_norm(x, eps / D)`` is ``sqrt(D) * x / sqrt(sum x^2 + eps)``)."""
    dk = q.shape[-1]
    q = mx.fast.rms_norm(q.astype(mx.float32), None, eps / dk) * (1.0 / dk)
    k = mx.fast.rms_norm(k.astype(mx.float32), None, eps / dk) * (dk ** -0.5)
    return q, k


def decay_and_beta(a: mx.array, b: mx.array, A_log: mx.array,
                   dt_bias: mx.array) -> tuple[mx.array, mx.array]:
    """Log decay ``g = -exp(A_log) * softplus(a + dt_bias)`` and ``beta = sigmoid(b)``."""
    a = a.astype(mx.float32) + dt_bias.astype(mx.float32)
    g = -mx.exp(A_log.astype(mx.float32)) * nn.softplus(a)
    return g, mx.sigmoid(b.astype(mx.float32))


@cache
def _triangles(size: int) -> tuple[mx.array, mx.array]:
    causal = mx.tril(mx.ones((size, size), dtype=mx.bool_))
    strict = mx.tril(mx.ones((size, size), dtype=mx.bool_), k=-1)
    mx.eval(causal, strict)
    return causal, strict


@cache
def _identity(size: int) -> mx.array:
    # A comparison, not mx.eye: eye is a scatter, one more kernel MLX's CUDA backend
    # compiles before the first token on a fresh machine.
    index = mx.arange(size)
    eye = (index[:, None] == index[None, :]).astype(mx.float32)
    mx.eval(eye)
    return eye


def _unit_lower_inverse(a: mx.array, leaf: int = 16) -> mx.array:
    """``(I + A)^-1`` for strictly lower-triangular ``A [..., C, C]``, by matrix products.

    Blocks of up to ``leaf`` rows: ``A`` is nilpotent, so ``(I + A)^-1 = (I - A)(I + A^2)
    (I + A^4)...`` with ``ceil(log2 C)`` factors is exact; larger sizes split in halves,
    ``[[X, 0], [-Y A21 X, Y]]``, which keeps the powers (and their rounding) small."""
    size = a.shape[-1]
    if size > leaf:
        half = size // 2
        if 2 * half == size:  # both diagonal blocks in one batch
            upper, lower = _unit_lower_inverse(
                mx.stack([a[..., :half, :half], a[..., half:, half:]]), leaf)
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
    ``h // (Hv / Hk)``. Returns the outputs ``[B, L, Hv, Dv]`` (float32), the final state
    and ``state_after(j)``: the state after the first ``j`` tokens, as a few lazy
    operations on this call's intermediate arrays."""
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

    G = mx.cumsum(g, axis=-1)  # [B, H, n, C]: log of the decay since the chunk start
    causal, strict = _triangles(C)
    # decay[t, i] = exp(G_t - G_i) for i <= t (masked before exp: the upper part overflows)
    decay = mx.exp(mx.where(causal, G[..., :, None] - G[..., None, :], -mx.inf))
    k_beta = k * beta[..., None]
    eG = mx.exp(G)[..., None]
    # u_t = beta_t (v_t - S_{t-1}' k_t) couples a chunk's tokens through A[t, i] = beta_t
    # exp(G_t - G_i) k_t.k_i (i < t): solve (I + A) [U | W] = [beta v | beta e^G k]
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
        S0, U = mx.stack(starts, axis=2), mx.stack(values, axis=2)
    else:
        S0, U = state[:, :, None], values[0][:, :, None]
    P = (q @ k.swapaxes(-1, -2)) * decay
    out = (q * eG) @ S0.swapaxes(-1, -2) + P @ U  # [B, H, n, C, Dv]
    out = out.reshape(B, Hv, n * C, Dv)[:, :, :L].transpose(0, 2, 1, 3)

    def state_after(j: int) -> mx.array:
        c, t = divmod(j - 1, C)
        Gt = G[:, :, c, t:t + 1]
        w = mx.exp(Gt - G[:, :, c, :t + 1])[..., None]
        update = U[:, :, c, :t + 1].swapaxes(-1, -2) @ (k[:, :, c, :t + 1] * w)
        return mx.exp(Gt)[..., None] * S0[:, :, c] + update

    return out, S, state_after


def _qk_pairs(conv: mx.array, hk: int, dk: int) -> mx.array:
    """Each key head's normalised (q, k) pair ``[..., Hk, 2, Dk]`` (float32) from the conv
    output ``[..., C]`` (float32): :func:`normalize_qk` as one rms_norm and one multiply."""
    lead = conv.shape[:-1]
    qk = conv[..., : 2 * hk * dk].reshape(*lead, 2, hk, dk).swapaxes(-3, -2)
    scale = mx.array([[1.0 / dk], [dk ** -0.5]], dtype=mx.float32)  # q row, k row
    return mx.fast.rms_norm(qk, None, 1e-6 / dk) * scale


def _conv_taps(window: mx.array, L: int) -> list[mx.array]:
    """The K shifted inputs ``[B, L, C]`` of the causal convolution from its window
    ``[B, K - 1 + L, C]`` (one split for a single token)."""
    K = window.shape[1] - L + 1
    if L == 1:
        # (mx.split's stub says it returns an array: it returns a list)
        return mx.split(window, K, axis=1)  # type: ignore[return-value]
    return [window[:, i:i + L] for i in range(K)]


def _conv_columns(conv_weight: mx.array) -> list[mx.array]:
    """The K weight columns ``[1, 1, C]`` of the depthwise weight ``[C, K, 1]``."""
    # (mx.split's stub says it returns an array: it returns a list)
    return mx.split(conv_weight.T, conv_weight.shape[1], axis=1)  # type: ignore[return-value]


@partial(mx.compile, shapeless=True)
def _conv_silu(*taps_and_weights: mx.array) -> mx.array:
    """``silu(sum_i x_i * w_i)`` accumulated in float32, for the K shifted inputs ``x_i``
    and the K weight columns ``w_i`` of the depthwise causal convolution."""
    half = len(taps_and_weights) // 2
    acc = None
    for x, w in zip(taps_and_weights[:half], taps_and_weights[half:]):
        term = x.astype(mx.float32) * w.astype(mx.float32)
        acc = term if acc is None else acc + term
    assert acc is not None  # K >= 1 taps
    return nn.silu(acc.astype(taps_and_weights[0].dtype))


@cache
def recurrent_step(hk: int, hv: int, dk: int, dv: int, eps: float) -> Callable[..., Any]:
    """Compiled DeltaNet core of one token (:func:`recurrent_block` without the outputs a
    rollback needs, which a one-token forward never does): ``(out, new_tail, new_state)``."""
    rep = hv // hk

    def step(qkv: mx.array, z: mx.array, b: mx.array, a: mx.array, conv_tail: mx.array,
             state: mx.array, conv_weight: mx.array, A_log: mx.array, dt_bias: mx.array,
             norm_weight: mx.array) -> tuple[mx.array, mx.array, mx.array]:
        B = qkv.shape[0]
        window = mx.concatenate([conv_tail, qkv], axis=1)  # [B, K, C]
        conv = _conv_silu(*_conv_taps(window, 1), *_conv_columns(conv_weight)
                          ).astype(mx.float32).squeeze(1)  # [B, C]
        qk = _qk_pairs(conv, hk, dk)  # [B, Hk, 2, Dk]
        v = conv[:, 2 * hk * dk:].reshape(B, hk, rep, dv)
        g, beta = decay_and_beta(a, b, A_log, dt_bias)  # [B, 1, Hv]
        e = mx.exp(g).reshape(B, hk, rep, 1)
        S = state.reshape(B, hk, rep, dv, dk)
        sq_sk = qk[:, :, None] @ S.swapaxes(-1, -2)  # [B, Hk, rep, 2, Dv]
        kq = (qk @ qk.swapaxes(-1, -2))[:, :, None, 0, 1:]  # [B, Hk, 1, 1]
        delta = beta.reshape(B, hk, rep, 1) * (v - e * sq_sk[..., 1, :])
        new_state = e[..., None] * S + delta[..., :, None] * qk[:, :, None, 1:]
        out = (e * sq_sk[..., 0, :] + delta * kq).reshape(B, hv, dv)
        out = gated_rms_norm(out.astype(qkv.dtype), z.reshape(B, hv, dv), norm_weight, eps)
        return out.reshape(B, 1, hv * dv), window[:, 1:], new_state.reshape(state.shape)

    return mx.compile(step)


@cache
def recurrent_block(hk: int, hv: int, dk: int, dv: int, eps: float) -> Callable[..., Any]:
    """Compiled DeltaNet core over a block of ``L`` tokens, token by token: conv,
    recurrence, gated norm. Returns ``(out, new_tail, new_state, k, delta, g)``: besides
    the output and state, each token's normalised key ``[B, Hv, L, Dk]``, correction
    ``[B, Hv, L, Dv]`` and log decay ``[B, Hv, L]`` (see :func:`block_state_after`).

    Laid out for few operations: q and k are normalised together, value heads grouped by
    the key head they read (q and k broadcast, not repeated), ``S q`` and ``S k`` come from
    one product and ``k . q`` from another."""
    rep = hv // hk

    def block(qkv: mx.array, z: mx.array, b: mx.array, a: mx.array, conv_tail: mx.array,
              state: mx.array, conv_weight: mx.array, A_log: mx.array, dt_bias: mx.array,
              norm_weight: mx.array) -> tuple[mx.array, ...]:
        B, L, _ = qkv.shape
        window = mx.concatenate([conv_tail, qkv], axis=1)  # [B, K - 1 + L, C]
        conv = _conv_silu(*_conv_taps(window, L), *_conv_columns(conv_weight)
                          ).astype(mx.float32)
        qk = _qk_pairs(conv, hk, dk)  # [B, L, Hk, 2, Dk]
        v = conv[..., 2 * hk * dk:].reshape(B, L, hk, rep, dv)
        kq = (qk @ qk.swapaxes(-1, -2))[..., None, 0, 1:]  # [B, L, Hk, 1, 1]
        g, beta = decay_and_beta(a, b, A_log, dt_bias)  # [B, L, Hv]
        e = mx.exp(g).reshape(B, L, hk, rep, 1)
        beta = beta.reshape(B, L, hk, rep, 1)
        outs, deltas = [], []
        S = state.reshape(B, hk, rep, dv, dk)
        for t in range(L):
            qk_t, e_t = qk[:, t], e[:, t]
            # With S' = e S + d k^T: S q and S k from one product; S' q = e Sq + d (k.q).
            sq_sk = qk_t[:, :, None] @ S.swapaxes(-1, -2)  # [B, Hk, rep, 2, Dv]
            delta = beta[:, t] * (v[:, t] - e_t * sq_sk[..., 1, :])
            S = e_t[..., None] * S + delta[..., :, None] * qk_t[:, :, None, 1:]
            outs.append(e_t * sq_sk[..., 0, :] + delta * kq[:, t])
            deltas.append(delta)
        out = mx.stack(outs, axis=1).reshape(B, L, hv, dv)
        out = gated_rms_norm(out.astype(qkv.dtype), z.reshape(B, L, hv, dv), norm_weight, eps)
        k = mx.broadcast_to(qk[:, :, :, None, 1], (B, L, hk, rep, dk)).reshape(B, L, hv, dk)
        delta = mx.stack(deltas, axis=1).reshape(B, L, hv, dv)
        return (out.reshape(B, L, hv * dv), window[:, L:], S.reshape(state.shape),
                k.transpose(0, 2, 1, 3), delta.transpose(0, 2, 1, 3), g.transpose(0, 2, 1))

    return mx.compile(block)


@cache
def _state_after(j: int) -> Callable[..., tuple[mx.array, mx.array]]:
    def state_after(tail: mx.array, state: mx.array, qkv: mx.array, k: mx.array,
                    delta: mx.array, g: mx.array) -> tuple[mx.array, mx.array]:
        window = mx.concatenate([tail, qkv[:, :j]], axis=1)
        G = mx.cumsum(g[..., :j], axis=-1)
        G_j = G[..., -1:]
        weights = mx.exp(G_j - G)[..., None]  # [B, Hv, j, 1]
        update = (delta[:, :, :j] * weights).swapaxes(-1, -2) @ k[:, :, :j]
        return window[:, j:], mx.exp(G_j)[..., None] * state + update

    return mx.compile(state_after)


def block_state_after(j: int, tail: mx.array, state: mx.array, qkv: mx.array, k: mx.array,
                      delta: mx.array, g: mx.array) -> tuple[mx.array, mx.array]:
    """The conv tail and state after the first ``j`` tokens of a block, from its starting
    tail and state, its inputs ``qkv`` and the block's k, delta, g: ``S_j = e^{G_j} S_0 +
    sum_{t<=j} e^{G_j - G_t} d_t k_t^T`` with ``G`` the cumulative log decay."""
    return _state_after(j)(tail, state, qkv, k, delta, g)


class GatedDeltaNet(nn.Module):
    """Qwen3.5's linear-attention mixer (checkpoint names ``in_proj_qkv``, ``in_proj_z``,
    ``in_proj_b``, ``in_proj_a``, ``conv1d``, ``dt_bias``, ``A_log``, ``norm``,
    ``out_proj``): a causal depthwise convolution and the gated delta rule, over a
    :class:`mlxrunner.RecurrentCache`. ``layer(x, cache, residual)`` returns ``residual
    + mixer(x)`` (the residual rides in the output projection). Tensor-parallel: its value
    heads split with the key heads they read (key heads replicated where fewer than the
    ranks), ``out_proj`` by rows."""

    def __init__(self, hidden: int, key_heads: int, value_heads: int, key_dim: int,
                 value_dim: int, conv_kernel: int = 4, eps: float = 1e-6) -> None:
        super().__init__()
        if value_heads % key_heads:
            raise ValueError(f"{value_heads} value heads do not group over {key_heads} "
                             "key heads")
        self.hk, self.hv, self.dk, self.dv = key_heads, value_heads, key_dim, value_dim
        self.kernel = conv_kernel
        self.eps = eps
        self.channels = 2 * key_heads * key_dim + value_heads * value_dim
        self.in_proj_qkv = Linear(hidden, self.channels, bias=False)
        self.in_proj_z = Linear(hidden, value_heads * value_dim, bias=False)
        self.in_proj_b = Linear(hidden, value_heads, bias=False)
        self.in_proj_a = Linear(hidden, value_heads, bias=False)
        # depthwise weight [C, K, 1] (MLX's grouped-conv layout), applied as K shifted
        # multiply-adds (one fused kernel) rather than a grouped convolution
        self.conv1d = nn.Conv1d(self.channels, self.channels, conv_kernel,
                                groups=self.channels, bias=False)
        self.dt_bias = mx.ones((value_heads,))
        self.A_log = mx.log(mx.random.uniform(1.0, 16.0, (value_heads,)))
        self.norm = nn.RMSNorm(value_dim, eps=eps)  # holds the gated norm's weight
        self.out_proj = Linear(value_heads * value_dim, hidden, bias=False, parallel=Row())

    def shard_splits(self) -> dict[str, Split]:
        """How its parameters split by heads (see :mod:`mlxrunner.nn.parallel`)."""
        qk = (self.hk * self.dk, self.hk)
        channels = Split(0, (qk, qk, (self.hv * self.dv, self.hv)))
        values = Split(0, ((self.hv * self.dv, self.hv),))
        heads = Split(0, ((self.hv, self.hv),))
        return {"in_proj_qkv.weight": channels, "conv1d.weight": channels,
                "in_proj_z.weight": values, "in_proj_b.weight": heads,
                "in_proj_a.weight": heads, "dt_bias": heads, "A_log": heads}

    def shard_heads(self, rank: int, size: int) -> None:
        """Keep this rank's head counts (after :meth:`shard_splits` cut the weights)."""
        if self.hv % size:
            raise ShardError(f"Gated DeltaNet: {self.hv} value heads do not split over "
                             f"{size} ranks")
        self.hk, self.hv = Split.local_units(self.hk, size), self.hv // size
        self.channels = 2 * self.hk * self.dk + self.hv * self.dv

    def _dims(self) -> tuple[int, int, int, int, float]:
        return (self.hk, self.hv, self.dk, self.dv, self.eps)

    def __call__(self, x: mx.array, cache: RecurrentCache | None = None,
                 residual: mx.array | None = None) -> mx.array:
        B, L, _ = x.shape
        joined, (qkv, z, b, a) = joined_linears(
            x, self.in_proj_qkv, self.in_proj_z, self.in_proj_b, self.in_proj_a)
        if cache is not None and cache.conv_tail is not None and \
                cache.recurrent_state is not None:
            conv_tail, state = cache.conv_tail, cache.recurrent_state
        else:
            conv_tail = mx.zeros((B, self.kernel - 1, self.channels), dtype=qkv.dtype)
            state = mx.zeros((B, self.hv, self.dv, self.dk), dtype=mx.float32)
        args = (qkv, z, b, a, conv_tail, state, self.conv1d.weight, self.A_log,
                self.dt_bias, self.norm.weight)
        if L == 1:
            out, tail, new_state = cuda_deltanet.step(
                args, recurrent_step(*self._dims()), *self._dims(), joined=joined)
            if cache is not None:
                cache.advance(1, tail, new_state)
            return apply_linear(self.out_proj, out, residual)
        if L <= BLOCK_TOKENS:
            out, tail, new_state, k, delta, g = cuda_deltanet.block(
                args, recurrent_block(*self._dims()), *self._dims(), joined=joined)
            if cache is not None:
                capture = None
                if cache.snapshot_positions(L):
                    capture = StateCapture(block_state_after,
                                           (conv_tail, state, qkv, k, delta, g))
                cache.advance(L, tail, new_state, capture)
            return apply_linear(self.out_proj, out, residual)
        if L <= SHORT_PROMPT_TOKENS and cuda_deltanet.applies(self.hk, self.hv, self.dk,
                                                              self.dv) and \
                (cache is None or not cache.snapshot_positions(L)):
            out, tail, new_state = self._blocks(args, joined)
            if cache is not None:
                cache.advance(L, tail, new_state)
            return apply_linear(self.out_proj, out, residual)
        out = self._chunked(qkv, z, b, a, conv_tail, state, cache)
        return apply_linear(self.out_proj, out.reshape(B, L, -1), residual)

    def _blocks(self, args: tuple[mx.array, ...], joined: mx.array | None
                ) -> tuple[mx.array, mx.array, mx.array]:
        """A short prompt as consecutive blocks of ``BLOCK_TOKENS`` through the block kernel:
        a launch per block where the chunked form costs some hundred operations, which is
        most of a short prompt's time on a GPU (a chat turn after a prefix-cache hit)."""
        qkv, z, b, a, tail, state, *weights = args
        core = recurrent_block(*self._dims())
        outs = []
        for start in range(0, qkv.shape[1], BLOCK_TOKENS):
            cut = slice(start, start + BLOCK_TOKENS)
            piece = (qkv[:, cut], z[:, cut], b[:, cut], a[:, cut], tail, state, *weights)
            out, tail, state, *_ = cuda_deltanet.block(
                piece, core, *self._dims(), joined=None if joined is None else joined[:, cut])
            outs.append(out)
        return mx.concatenate(outs, axis=1), tail, state

    def _chunked(self, qkv: mx.array, z: mx.array, b: mx.array, a: mx.array,
                 conv_tail: mx.array, state: mx.array, cache: RecurrentCache | None
                 ) -> mx.array:
        B, L, _ = qkv.shape
        window = mx.concatenate([conv_tail, qkv], axis=1)  # [B, K - 1 + L, C]
        weight = self.conv1d.weight[..., 0]  # [C, K]
        conv = _conv_silu(*(window[:, i:i + L] for i in range(self.kernel)),
                          *(weight[:, i] for i in range(self.kernel)))
        hk_dk = self.hk * self.dk
        q = conv[..., :hk_dk].reshape(B, L, self.hk, self.dk)
        k = conv[..., hk_dk:2 * hk_dk].reshape(B, L, self.hk, self.dk)
        v = conv[..., 2 * hk_dk:].reshape(B, L, self.hv, self.dv)
        q, k = normalize_qk(q, k)
        g, beta = decay_and_beta(a, b, self.A_log, self.dt_bias)
        out, state, state_after = chunked_gated_delta(q, k, v, g, beta, state)
        out = gated_rms_norm(out.astype(qkv.dtype), z.reshape(B, L, self.hv, self.dv),
                             self.norm.weight, self.eps)
        if cache is not None:
            keep = self.kernel - 1
            capture = None
            if cache.snapshot_positions(L):
                def capture(j: int) -> tuple[mx.array, mx.array]:
                    return window[:, j:j + keep], state_after(j)
            # a copy, so that the cache does not keep the whole window alive
            cache.advance(L, mx.contiguous(window[:, L:]), state, capture)
        return out
