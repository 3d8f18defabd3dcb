"""Gemma 4 text models (E2B / E4B with per-layer inputs and KV sharing, 31B with
K=V full layers, 26B-A4B with a mixture-of-experts block).

Facts (see the project's models.md): sliding layers use head_dim with plain RoPE
(theta 1e4) over a ``sliding_window`` ring; full layers use ``global_head_dim``
with "proportional" RoPE (theta 1e6, only the first quarter of the frequencies
non-zero); attention scale 1.0 with q/k RMSNorms (weighted) and a weightless v
norm; the last ``num_kv_shared_layers`` layers reuse the keys and values of the
last earlier layer of their type; RMSNorms multiply by ``w`` (not ``1 + w``);
the embedding is scaled by sqrt(hidden) in the weight dtype; logits are
softcapped at 30.

Decoding is the hot path: a forward of up to ``TRACED_BLOCK`` tokens through
existing caches (one-token decode steps, speculative verify blocks) is traced
once per length with ``mx.compile`` and replayed, so a step costs one call from
Python instead of building ~2000 graph nodes. The traced step writes the caches
at a traced offset and attends over fixed-size buffers with a validity mask, so
its shapes only change when a full-attention buffer grows (every
``DECODE_GROW`` tokens). Prompts run eagerly.

Every forward computes a layer's q/k/v (and the MLP's gate/up) projections with one
matmul over weights stacked by rows once after loading, and normalises and rotates
all of a layer's heads together: fewer kernels per step, the same arithmetic. The
layer stack runs on ``[B * L, hidden]`` rows and float weights are read through
transposed views evaluated once, so its matmuls add no flatten, unflatten or
transpose nodes to a traced step (whose every node, views included, costs host time
on each replay).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import mlx.core as mx
import mlx.nn as nn

import mlxrunner
from mlxrunner import KVCache, Model, ModelFolderError, RingCache, arange_constant

SLIDING = "sliding_attention"
FULL = "full_attention"

#: full-attention buffers used by traced steps grow in these steps (each growth
#: retraces the steps once; a traced step attends over the whole buffer, masked,
#: which costs a CPU more than the rarer retraces save)
DECODE_GROW = 1024
DECODE_GROW_CPU = 256
#: forwards of up to this many tokens (decode, speculative verify blocks) are traced
#: once per length and replayed; longer ones (prompts) are built eagerly
TRACED_BLOCK = 16

_DEFAULT_ROPE = {
    SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
    FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25,
           "rope_theta": 1_000_000.0},
}


# --------------------------------------------------------------------------
# config
# --------------------------------------------------------------------------
@dataclass(frozen=True)
class RopeSpec:
    """How one layer kind rotates: ``periods`` is None for plain RoPE over all dims."""

    theta: float
    periods: tuple[float, ...] | None = None


@dataclass
class Gemma4Config:
    """The text config with every per-layer fact resolved."""

    hidden_size: int
    num_layers: int
    vocab_size: int
    num_heads: int
    rms_norm_eps: float
    sliding_window: int
    layer_types: list[str]
    head_dims: list[int]
    kv_heads: list[int]
    kv_source: list[int]  # the layer whose keys/values layer i attends over (itself if own)
    k_eq_v: list[bool]
    intermediate_sizes: list[int]
    rope: dict[str, RopeSpec]
    final_logit_softcapping: float | None
    tie_word_embeddings: bool
    hidden_size_per_layer_input: int
    vocab_size_per_layer_input: int
    attention_bias: bool
    enable_moe_block: bool
    num_experts: int
    top_k_experts: int
    moe_intermediate_size: int
    raw: dict[str, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> Gemma4Config:
        try:
            return cls._from_dict(config)
        except (KeyError, TypeError, ValueError) as exc:
            missing = f"missing key {exc}" if isinstance(exc, KeyError) else str(exc)
            raise ModelFolderError(f"Gemma 4 config: {missing}") from None

    @classmethod
    def _from_dict(cls, c: dict[str, Any]) -> Gemma4Config:
        activation = c.get("hidden_activation", "gelu_pytorch_tanh")
        if activation not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"unsupported hidden_activation {activation!r}")
        if c.get("use_bidirectional_attention") == "all":
            raise ValueError("use_bidirectional_attention='all' is not a causal language model")
        n = int(c["num_hidden_layers"])
        hidden = int(c["hidden_size"])
        heads = int(c["num_attention_heads"])
        head_dim = int(c.get("head_dim") or hidden // heads)
        kv = int(c.get("num_key_value_heads") or heads)
        k_eq_v = bool(c.get("attention_k_eq_v", False))

        layer_types = c.get("layer_types")
        if layer_types is None:
            pattern = int(c.get("sliding_window_pattern", 6))
            layer_types = [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(n)]
        layer_types = list(layer_types)
        if len(layer_types) != n:
            raise ValueError(f"layer_types has {len(layer_types)} entries for {n} layers")
        for t in layer_types:
            if t not in (SLIDING, FULL):
                raise ValueError(f"unknown layer type {t!r}")
        layer_types[-1] = FULL  # transformers forces the last layer to full attention

        # Full layers' head dim and KV heads: Hub configs say global_head_dim and
        # num_global_key_value_heads; transformers' text configs per_layer_config.
        head_dims = [head_dim] * n
        kv_heads = [kv] * n
        per_layer = c.get("per_layer_config")
        if per_layer:
            for key, override in per_layer.items():
                i = int(key)
                if not 0 <= i < n:
                    raise ValueError(f"per_layer_config names layer {key!r} of {n}")
                head_dims[i] = int(override.get("head_dim", head_dims[i]))
                kv_heads[i] = int(override.get("num_key_value_heads", kv_heads[i]))
        else:
            global_dim = int(c.get("global_head_dim") or 512)
            global_kv = c.get("num_global_key_value_heads")
            for i, t in enumerate(layer_types):
                if t == FULL:
                    head_dims[i] = global_dim
                    if k_eq_v and global_kv is not None:
                        kv_heads[i] = int(global_kv)
        for i in range(n):
            if heads % kv_heads[i]:
                raise ValueError(f"layer {i}: {heads} heads do not group over "
                                 f"{kv_heads[i]} key/value heads")

        shared = int(c.get("num_kv_shared_layers") or 0)
        if not 0 <= shared < n:
            raise ValueError(f"num_kv_shared_layers {shared} must be below {n} layers")
        first_shared = n - shared
        kv_source = list(range(n))
        last_of_type = {t: i for i, t in enumerate(layer_types[:first_shared])}
        for j in range(first_shared, n):
            if layer_types[j] not in last_of_type:
                raise ValueError(f"layer {j} ({layer_types[j]}) shares keys and values but "
                                 "no earlier layer of its type has any")
            kv_source[j] = last_of_type[layer_types[j]]

        inter = c["intermediate_size"]
        inter = [int(x) for x in inter] if isinstance(inter, list) else [int(inter)] * n
        if len(inter) != n:
            raise ValueError(f"intermediate_size has {len(inter)} entries for {n} layers")
        if c.get("use_double_wide_mlp"):
            inter = [x * 2 if i >= first_shared else x for i, x in enumerate(inter)]

        rope_params = c.get("rope_parameters") or {}
        rope = {}
        for t in (SLIDING, FULL):
            dim = head_dims[layer_types.index(t)] if t in layer_types else head_dim
            rope[t] = _rope_spec(rope_params.get(t) or _DEFAULT_ROPE[t], dim)

        moe = bool(c.get("enable_moe_block", False))
        softcap = c.get("final_logit_softcapping")
        return cls(
            hidden_size=hidden,
            num_layers=n,
            vocab_size=int(c["vocab_size"]),
            num_heads=heads,
            rms_norm_eps=float(c.get("rms_norm_eps", 1e-6)),
            sliding_window=int(c.get("sliding_window") or 512),
            layer_types=layer_types,
            head_dims=head_dims,
            kv_heads=kv_heads,
            kv_source=kv_source,
            k_eq_v=[k_eq_v and t == FULL for t in layer_types],
            intermediate_sizes=inter,
            rope=rope,
            final_logit_softcapping=float(softcap) if softcap else None,
            tie_word_embeddings=bool(c.get("tie_word_embeddings", True)),
            hidden_size_per_layer_input=int(c.get("hidden_size_per_layer_input") or 0),
            vocab_size_per_layer_input=int(c.get("vocab_size_per_layer_input")
                                           or c["vocab_size"]),
            attention_bias=bool(c.get("attention_bias", False)),
            enable_moe_block=moe,
            num_experts=int(c["num_experts"]) if moe else 0,
            top_k_experts=int(c["top_k_experts"]) if moe else 0,
            moe_intermediate_size=int(c["moe_intermediate_size"]) if moe else 0,
            raw=dict(c),
        )


def _rope_spec(params: dict[str, Any], head_dim: int) -> RopeSpec:
    kind = params.get("rope_type", "default")
    theta = float(params.get("rope_theta", 10_000.0))
    if kind == "default":
        # transformers' default RoPE for Gemma 4 rotates every dim (no partial factor)
        return RopeSpec(theta)
    if kind == "proportional":
        # Frequencies 1/theta^(2i/head_dim) for the first partial*head_dim/2 pairs and
        # zero for the rest (those pass through); rotate-half pairs i, i + head_dim/2.
        factor = float(params.get("factor", 1.0))
        rotated = int(float(params.get("partial_rotary_factor", 1.0)) * head_dim // 2)
        periods = [factor * theta ** (2 * i / head_dim) for i in range(rotated)]
        periods += [math.inf] * (head_dim // 2 - rotated)
        return RopeSpec(theta, tuple(periods))
    raise ValueError(f"unsupported rope_type {kind!r}")


# --------------------------------------------------------------------------
# modules
# --------------------------------------------------------------------------
class RMSNorm(nn.Module):
    """Gemma 4's RMSNorm: ``x / rms(x) * w`` (no ``1 + w``), computed in float32."""

    def __init__(self, dims: int, eps: float) -> None:
        super().__init__()
        self.weight = mx.ones((dims,))
        self.eps = eps

    def __call__(self, x: mx.array) -> mx.array:
        return mx.fast.rms_norm(x, self.weight, self.eps)


@dataclass
class TransposedWeight:
    """An evaluated transposed view of a float weight ``[out, in]`` (kept out of the
    parameter tree): a traced step holds it as a constant, so ``x @ weight.T`` costs no
    Transpose node per forward; the matmul reads the same memory with the same strides."""

    weight: mx.array  # the parameter it views
    view: mx.array

    @classmethod
    def of(cls, weight: mx.array) -> TransposedWeight:
        view = weight.T
        mx.eval(view)
        return cls(weight, view)


class _HoldsTransposed:
    """A module with a float ``weight`` that can hold its ``TransposedWeight``
    (``hold_transposed``; the model drops it with the other derived arrays)."""

    transposed: TransposedWeight | None = None

    def hold_transposed(self) -> None:
        self.transposed = TransposedWeight.of(self["weight"])

    def _weight_t(self) -> mx.array | None:
        """The held view while it still views the weight (None: use ``weight.T``)."""
        t = self.transposed
        return t.view if t is not None and t.weight is self["weight"] else None


class Linear(_HoldsTransposed, nn.Linear):
    """``nn.Linear`` through its held transposed weight view."""

    def __call__(self, x: mx.array) -> mx.array:
        weight_t = self._weight_t()
        if weight_t is None:
            return super().__call__(x)
        if "bias" in self:
            return mx.addmm(self["bias"], x, weight_t)
        return mlxrunner.project(x, weight_t)


class Embedding(_HoldsTransposed, nn.Embedding):
    """``nn.Embedding`` whose ``as_linear`` (the tied head) goes through its held
    transposed weight view."""

    def as_linear(self, x: mx.array) -> mx.array:
        weight_t = self._weight_t()
        return super().as_linear(x) if weight_t is None else mlxrunner.project(x, weight_t)


# Elementwise chains fused into one kernel each, whatever the shapes (prefill and
# verify forwards run eagerly; inside the traced decode step they are inlined).
@partial(mx.compile, shapeless=True)
def _softcap(x: mx.array, cap: mx.array) -> mx.array:
    return mx.tanh(x / cap) * cap


@partial(mx.compile, shapeless=True)
def _gelu_mul(gate: mx.array, x: mx.array) -> mx.array:
    """GELU (tanh approximation, ``gelu_pytorch_tanh``) of ``gate`` times ``x``; the GELU
    in float32 and rounded once, as torch computes it for bf16/fp16 inputs."""
    g = gate.astype(mx.float32)
    g = 0.5 * g * (1.0 + mx.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g * g * g)))
    return g.astype(x.dtype) * x


@partial(mx.compile, shapeless=True)
def _residual_scaled(h: mx.array, x: mx.array, scalar: mx.array) -> mx.array:
    return (h + x) * scalar


def norm_add(x: mx.array, residual: mx.array, weight: mx.array, eps: float,
             scalar: mx.array | None = None, second: mx.array | None = None,
             eps2: float | None = None) -> tuple[mx.array, mx.array | None]:
    """Gemma's sandwich norm: ``h = residual + rms_norm(x) * weight`` (times ``scalar``)
    and, with a ``second`` weight, ``rms_norm(h) * second`` (the next sublayer's input)."""
    y = mx.fast.rms_norm(x, weight, eps)
    h = residual + y if scalar is None else _residual_scaled(residual, y, scalar)
    normed = None if second is None else mx.fast.rms_norm(
        h, second, eps if eps2 is None else eps2)
    return h, normed


def _stack_rows(parts: Sequence[nn.Module]) -> nn.Module | None:
    """One linear map giving the parts' outputs side by side: their arrays (weight and
    bias, or packed weight, scales and biases) concatenated along the output rows. The
    parts are rebound to row views of the stacked arrays, so each weight is held once.
    None when the parts differ in kind or quantization (a mixed-bits checkpoint)."""
    def kind(p: nn.Module) -> tuple[Any, ...]:
        return (type(p), getattr(p, "group_size", None), getattr(p, "bits", None),
                getattr(p, "mode", None),
                tuple(sorted(k for k, v in p.items() if isinstance(v, mx.array))))

    kinds = {kind(p) for p in parts}
    if len(kinds) != 1 or not isinstance(parts[0], (nn.Linear, nn.QuantizedLinear)):
        return None
    keys = kinds.pop()[-1]
    stacked = copy.copy(parts[0])
    for key in keys:
        stacked[key] = mx.concatenate([p[key] for p in parts])
    row = 0
    for p in parts:
        rows = p["weight"].shape[0]
        for key in keys:
            p[key] = stacked[key][row:row + rows]
        row += rows
    mx.eval(stacked.parameters(), [p.parameters() for p in parts])
    if isinstance(stacked, Linear):
        stacked.hold_transposed()
    return stacked


@dataclass
class FusedAttention:
    """A layer's q, k (and v) projections as one stacked map, and the q and k norm
    weights stacked per head: one matmul, one norm and one rope cover every head.
    (MLX's RMSNorm rounds the normed value before applying the weight, so a weightless
    norm times the weight is the same computation.)"""

    proj: nn.Module
    qk_norm_weight: mx.array  # [q heads + kv heads, 1, D]


class Attention(nn.Module):
    def __init__(self, cfg: Gemma4Config, i: int) -> None:
        super().__init__()
        self.layer_type = cfg.layer_types[i]
        self.head_dim = d = cfg.head_dims[i]
        self.n_heads = cfg.num_heads
        self.n_kv_heads = cfg.kv_heads[i]
        self.has_kv = cfg.kv_source[i] == i
        self.k_eq_v = cfg.k_eq_v[i]
        self.eps = cfg.rms_norm_eps
        bias = cfg.attention_bias
        hidden = cfg.hidden_size
        self.q_proj = Linear(hidden, self.n_heads * d, bias=bias)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        if self.has_kv:
            self.k_proj = Linear(hidden, self.n_kv_heads * d, bias=bias)
            if not self.k_eq_v:
                self.v_proj = Linear(hidden, self.n_kv_heads * d, bias=bias)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.o_proj = Linear(self.n_heads * d, hidden, bias=bias)
        spec = cfg.rope[self.layer_type]
        self._theta = spec.theta
        self._periods = None if spec.periods is None else mx.array(spec.periods, mx.float32)
        #: stacked projections (``fuse``), kept out of the parameter tree
        self.fused: FusedAttention | None = None

    def fuse(self) -> None:
        """Stack the q/k/v projections and q/k norm weights (a layer with keys and values
        of its own; a KV-sharing layer projects queries only)."""
        if not self.has_kv:
            return
        # The weightless norm's output times the weight equals RMSNorm's only when the
        # weight does not promote the projection's dtype (a float32 weight would).
        proj_dtype = getattr(self.q_proj, "scales", self.q_proj.weight).dtype
        if {self.q_norm.weight.dtype, self.k_norm.weight.dtype} != {proj_dtype}:
            return
        parts = [self.q_proj, self.k_proj] + ([] if self.k_eq_v else [self.v_proj])
        proj = _stack_rows(parts)
        if proj is None:
            return
        d = self.head_dim
        weight = mx.concatenate([mx.broadcast_to(self.q_norm.weight, (self.n_heads, d)),
                                 mx.broadcast_to(self.k_norm.weight, (self.n_kv_heads, d))])
        self.fused = FusedAttention(proj, weight[:, None, :])
        mx.eval(self.fused.qk_norm_weight)

    def rope(self, x: mx.array, offset: int | mx.array) -> mx.array:
        if self._periods is None:
            return mx.fast.rope(x, self.head_dim, traditional=False, base=self._theta,
                                scale=1.0, offset=offset)
        return mx.fast.rope(x, self.head_dim, traditional=False, base=None, scale=1.0,
                            offset=offset, freqs=self._periods)

    def _normed_heads(self, x: mx.array, L: int, heads: int,
                      norm: Callable[[mx.array], mx.array]) -> mx.array:
        """``[B * L, heads * D]`` to ``[B, heads, L, D]``, normed over D on the way (before
        the transpose, on contiguous rows); one token needs no transpose at all."""
        if L == 1:
            return norm(x.reshape(-1, heads, 1, self.head_dim))
        return norm(x.reshape(-1, L, heads, self.head_dim)).transpose(0, 2, 1, 3)

    def _v_norm(self, v: mx.array) -> mx.array:
        return mx.fast.rms_norm(v, None, self.eps)

    def prepare_traced(self, L: int, dtype: mx.Dtype) -> None:
        """Before a forward of ``L`` tokens a row is traced: the attention kernel's
        self-check (it evaluates)."""
        mlxrunner.prepare_attend(self.n_heads, self.n_kv_heads, self.head_dim, self.head_dim,
                                 L, dtype)

    def _rows(self, x: mx.array) -> mx.array | None:
        """The one projection of ``x`` a layer's heads come from: the stacked q/k/v one, or
        the query one of a layer sharing its keys and values; None for a layer whose own
        projections could not be stacked."""
        if self.fused is not None:
            return self.fused.proj(x)
        return None if self.has_kv else self.q_proj(x)

    def project(self, x: mx.array, L: int, offset: int | mx.array
                ) -> tuple[mx.array, mx.array | None, mx.array | None]:
        """Queries ``[B, H, L, D]`` of ``x [B * L, hidden]`` and, for a layer with its
        own, keys and values (q/k normed and rotated, v normed without a weight)."""
        rows = self._rows(x)
        if rows is None:
            return self._project_unfused(x, L, offset)
        return self._project_rows(rows, L, offset)

    def _project_rows(self, rows: mx.array, L: int, offset: int | mx.array
                      ) -> tuple[mx.array, mx.array | None, mx.array | None]:
        """q, k, v from the projection rows of :meth:`_rows`."""
        if self.fused is not None:
            return self._heads_fused(rows, L, offset)
        q = self.rope(self._normed_heads(rows, L, self.n_heads, self.q_norm), offset)
        return q, None, None

    def _project_unfused(self, x: mx.array, L: int, offset: int | mx.array
                         ) -> tuple[mx.array, mx.array | None, mx.array | None]:
        q = self.rope(self._normed_heads(self.q_proj(x), L, self.n_heads, self.q_norm), offset)
        k_raw = self.k_proj(x)
        # K=V layers: the value is the raw key projection, normed like any value
        v_raw = k_raw if self.k_eq_v else self.v_proj(x)
        k = self.rope(self._normed_heads(k_raw, L, self.n_kv_heads, self.k_norm), offset)
        v = self._normed_heads(v_raw, L, self.n_kv_heads, self._v_norm)
        return q, k, v

    def _heads_fused(self, rows: mx.array, L: int, offset: int | mx.array
                     ) -> tuple[mx.array, mx.array, mx.array]:
        """``project`` through the stacked weights: heads [q | k | v], all normed
        without a weight in one go, then q and k weighted and rotated together (each
        cut with one split: one graph node instead of a slice per part)."""
        fused = self.fused
        H, qk = self.n_heads, self.n_heads + self.n_kv_heads
        heads = qk if self.k_eq_v else qk + self.n_kv_heads
        normed = self._normed_heads(rows, L, heads, self._v_norm)
        if self.k_eq_v:  # the value is the key projection, normed without a weight
            qk_heads, v = normed, normed[:, H:]
        else:
            qk_heads, v = mx.split(normed, [qk], axis=1)
        q, k = mx.split(self.rope(qk_heads * fused.qk_norm_weight, offset), [H], axis=1)
        return q, k, v

    def attend(self, q: mx.array, keys: mx.array, values: mx.array,
               mask: mx.array | str | None) -> mx.array:
        """Attention of ``q [B, H, L, D]`` over the keys and values, projected to
        ``[B * L, hidden]``."""
        L = q.shape[2]
        out = mlxrunner.attend(q, keys, values, scale=1.0, mask=mask)
        if L > 1:
            out = out.transpose(0, 2, 1, 3)
        return self.o_proj(out.reshape(-1, self.n_heads * out.shape[-1]))


@dataclass
class FusedMLP:
    """The gate and up projections as one stacked map (kept out of the parameter tree)."""

    gate_up: nn.Module


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.intermediate = intermediate
        self.gate_proj = Linear(hidden, intermediate, bias=False)
        self.up_proj = Linear(hidden, intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)
        self.fused: FusedMLP | None = None

    def fuse(self) -> None:
        gate_up = _stack_rows([self.gate_proj, self.up_proj])
        self.fused = None if gate_up is None else FusedMLP(gate_up)

    def __call__(self, x: mx.array) -> mx.array:
        if self.fused is None:
            return self.down_proj(_gelu_mul(self.gate_proj(x), self.up_proj(x)))
        gate, up = mx.split(self.fused.gate_up(x), [self.intermediate], axis=-1)
        return self.down_proj(_gelu_mul(gate, up))


class ExpertLinear(nn.Module):
    """One linear map per expert, ``weight [experts, out, in]``, applied by index."""

    def __init__(self, experts: int, in_dims: int, out_dims: int) -> None:
        super().__init__()
        self.weight = mx.zeros((experts, out_dims, in_dims))

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        w = self.weight
        if x.dtype != mx.float32 and mx.default_device() == mx.cpu:
            # MLX's CPU gather_mm takes float32 only
            return mx.gather_mm(x.astype(mx.float32), w.astype(mx.float32).swapaxes(-1, -2),
                                rhs_indices=indices, sorted_indices=sorted_indices
                                ).astype(x.dtype)
        return mx.gather_mm(x, w.swapaxes(-1, -2), rhs_indices=indices,
                            sorted_indices=sorted_indices)

    def to_quantized(self, group_size: int | None = None, bits: int | None = None,
                     mode: str = "affine", **_: Any) -> QuantizedExpertLinear:
        experts, out_dims, in_dims = self.weight.shape
        q = QuantizedExpertLinear(experts, in_dims, out_dims, group_size, bits, mode)
        q.weight, q.scales, *biases = mx.quantize(self.weight, q.group_size, q.bits, mode=mode)
        if biases:
            q.biases = biases[0]
        return q


class QuantizedExpertLinear(nn.Module):
    def __init__(self, experts: int, in_dims: int, out_dims: int, group_size: int | None,
                 bits: int | None, mode: str = "affine") -> None:
        super().__init__()
        self.mode = mode
        self.group_size = group_size or 64
        self.bits = bits or 4
        self.weight, self.scales, *biases = mx.quantize(
            mx.zeros((experts, out_dims, in_dims)), self.group_size, self.bits, mode=mode)
        if biases:
            self.biases = biases[0]
        self.freeze()

    def __call__(self, x: mx.array, indices: mx.array, sorted_indices: bool = False) -> mx.array:
        return mx.gather_qmm(x, self.weight, self.scales, self.get("biases"),
                             rhs_indices=indices, transpose=True, group_size=self.group_size,
                             bits=self.bits, mode=self.mode, sorted_indices=sorted_indices)


class Router(nn.Module):
    def __init__(self, cfg: Gemma4Config) -> None:
        super().__init__()
        self.proj = Linear(cfg.hidden_size, cfg.num_experts, bias=False)
        self.scale = mx.ones((cfg.hidden_size,))
        self.per_expert_scale = mx.ones((cfg.num_experts,))
        self.eps = cfg.rms_norm_eps
        self.top_k = cfg.top_k_experts
        self.root = cfg.hidden_size ** -0.5

    def __call__(self, x: mx.array) -> tuple[mx.array, mx.array]:
        x = mx.fast.rms_norm(x, None, self.eps) * self.scale * self.root
        scores = self.proj(x)
        indices = _top_k(scores, self.top_k)
        # softmax over the chosen scores == full softmax renormalised over them
        weights = mx.softmax(mx.take_along_axis(scores, indices, axis=-1).astype(mx.float32),
                             axis=-1)
        weights = weights * self.per_expert_scale[indices].astype(mx.float32)
        return indices, weights


def _top_k(scores: mx.array, k: int) -> mx.array:
    topk = getattr(mlxrunner, "topk_indices", None)
    return topk(scores, k) if topk is not None else \
        mx.argpartition(-scores, kth=k - 1, axis=-1)[..., :k]


class Experts(nn.Module):
    def __init__(self, cfg: Gemma4Config) -> None:
        super().__init__()
        e, h, i = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size
        self.gate_up_proj = ExpertLinear(e, h, 2 * i)
        self.down_proj = ExpertLinear(e, i, h)

    def __call__(self, x: mx.array, indices: mx.array, weights: mx.array) -> mx.array:
        lead = x.shape[:-1]
        k = indices.shape[-1]
        x = x.reshape(-1, x.shape[-1])
        idx = indices.reshape(-1, k)
        if idx.size >= 64:
            # Many tokens: group rows by expert so each expert's weights are read once.
            flat = idx.flatten()
            order = mx.argsort(flat)
            rows = x[order // k][:, None, :]
            y = self._glu(rows, flat[order], True)
            y = y[mx.argsort(order)].reshape(-1, k, x.shape[-1])
        else:
            y = self._glu(x[:, None, None, :], idx, False).squeeze(-2)
        y = (y * weights.reshape(-1, k, 1).astype(y.dtype)).sum(axis=-2)
        return y.reshape(*lead, -1)

    def _glu(self, x: mx.array, idx: mx.array, sorted_indices: bool) -> mx.array:
        gate, up = mx.split(self.gate_up_proj(x, idx, sorted_indices), 2, axis=-1)
        return self.down_proj(_gelu_mul(gate, up), idx, sorted_indices)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: Gemma4Config, i: int) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.layer_type = cfg.layer_types[i]
        self.self_attn = Attention(cfg, i)
        self.mlp = MLP(h, cfg.intermediate_sizes[i])
        self.input_layernorm = RMSNorm(h, eps)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.pre_feedforward_layernorm = RMSNorm(h, eps)
        self.post_feedforward_layernorm = RMSNorm(h, eps)
        self.moe = cfg.enable_moe_block
        if self.moe:
            self.router = Router(cfg)
            self.experts = Experts(cfg)
            self.post_feedforward_layernorm_1 = RMSNorm(h, eps)
            self.post_feedforward_layernorm_2 = RMSNorm(h, eps)
            self.pre_feedforward_layernorm_2 = RMSNorm(h, eps)
        self.per_layer = cfg.hidden_size_per_layer_input > 0
        if self.per_layer:
            p = cfg.hidden_size_per_layer_input
            self.per_layer_input_gate = Linear(h, p, bias=False)
            self.per_layer_projection = Linear(p, h, bias=False)
            self.post_per_layer_input_norm = RMSNorm(h, eps)
        self.layer_scalar = mx.ones((1,))

    def finish(self, h: mx.array, attn: mx.array, per_layer_input: mx.array | None,
               next_norm: RMSNorm | None = None) -> tuple[mx.array, mx.array | None]:
        """Everything after attention: residuals, feed-forward, per-layer input, scalar.
        Returns the new residual stream and, given the next layer's input norm, that norm
        of it. Each "normalise a sublayer's output, add it to the stream (scale it), and
        normalise the stream for the next sublayer" is one :func:`norm_add`."""
        second = None if next_norm is None else next_norm.weight
        eps2 = None if next_norm is None else next_norm.eps
        post_attn = self.post_attention_layernorm
        if self.moe:
            h = h + post_attn(attn)
            ff = self.mlp(self.pre_feedforward_layernorm(h))
            indices, weights = self.router(h)
            moe = self.experts(self.pre_feedforward_layernorm_2(h), indices, weights)
            ff = self.post_feedforward_layernorm_1(ff) + self.post_feedforward_layernorm_2(moe)
        else:
            h, x = norm_add(attn, h, post_attn.weight, post_attn.eps,
                            second=self.pre_feedforward_layernorm.weight,
                            eps2=self.pre_feedforward_layernorm.eps)
            ff = self.mlp(x)
        post_ff = self.post_feedforward_layernorm
        if not self.per_layer:
            return norm_add(ff, h, post_ff.weight, post_ff.eps, self.layer_scalar, second, eps2)
        h, _ = norm_add(ff, h, post_ff.weight, post_ff.eps)
        gate = _gelu_mul(self.per_layer_input_gate(h), per_layer_input)
        post_ple = self.post_per_layer_input_norm
        return norm_add(self.per_layer_projection(gate), h, post_ple.weight, post_ple.eps,
                        self.layer_scalar, second, eps2)


class TextModel(nn.Module):
    def __init__(self, cfg: Gemma4Config) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = [DecoderLayer(cfg, i) for i in range(cfg.num_layers)]
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.hidden_size_per_layer_input:
            p = cfg.hidden_size_per_layer_input
            self.embed_tokens_per_layer = Embedding(cfg.vocab_size_per_layer_input,
                                                       cfg.num_layers * p)
            self.per_layer_model_projection = Linear(cfg.hidden_size, cfg.num_layers * p,
                                                        bias=False)
            self.per_layer_projection_norm = RMSNorm(p, cfg.rms_norm_eps)


# --------------------------------------------------------------------------
# the target model
# --------------------------------------------------------------------------
_NON_TEXT = ("vision_tower", "audio_tower", "embed_vision", "embed_audio",
             "multi_modal_projector", "vision_embedder")

# (keys, values, mask) one layer attends over; KV-sharing layers reuse their source's
KV = tuple[mx.array, mx.array, "mx.array | str | None"]


class Gemma4Model(Model):
    """``Gemma4ForConditionalGeneration`` / ``Gemma4ForCausalLM`` (text part)."""

    default_renderer = "gemma4"
    default_parser = "gemma4"
    #: ``<eos>``, ``<turn|>``, ``<|tool_response>``
    eos_token_ids = (1, 106, 50)

    def __init__(self, config: dict[str, Any]) -> None:
        super().__init__(config)
        self.args = Gemma4Config.from_dict(config)
        self.model = TextModel(self.args)
        if not self.args.tie_word_embeddings:
            self.lm_head = Linear(self.args.hidden_size, self.args.vocab_size, bias=False)
        #: trace and replay decode steps and short verify forwards (off: always eager)
        self.compile_decode = True
        self._steps: dict[Any, Callable] = {}
        self._fused = False  # the layers' projections are stacked (``_fuse``)
        self._shared_sources = frozenset(s for i, s in enumerate(self.args.kv_source) if s != i)

    # -- facts ---------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        return self.args.num_layers

    @property
    def vocab_size(self) -> int:
        return self.args.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.args.hidden_size

    @property
    def layers(self) -> list[DecoderLayer]:
        return self.model.layers

    # -- loading ---------------------------------------------------------------
    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Hub (``model.language_model.*``), transformers text-only (``model.*``) and
        mlx-lm (``language_model.model.*``) names to ours; drops vision/audio towers,
        rotary buffers, the tied head and the K/V weights of KV-sharing layers."""
        hub = any(k.startswith("model.language_model.") for k in weights)
        out: dict[str, mx.array] = {}
        pending: dict[str, dict[str, mx.array]] = {}
        for name, value in weights.items():
            key = self._text_name(name, hub)
            if key is None:
                continue
            if ".experts.switch_glu." in key:  # mlx-lm's split expert projections
                base, rest = key.split(".experts.switch_glu.")
                proj, _, part = rest.partition(".")
                if proj == "down_proj":
                    out[f"{base}.experts.down_proj.{part}"] = value
                else:
                    pending.setdefault(f"{base}.experts.gate_up_proj.{part}", {})[proj] = value
                continue
            if key.endswith((".experts.gate_up_proj", ".experts.down_proj")):
                key += ".weight"
            out[key] = value
        for key, parts in pending.items():
            if set(parts) != {"gate_proj", "up_proj"}:
                raise ValueError(f"{key}: expected gate_proj and up_proj, got {sorted(parts)}")
            out[key] = mx.concatenate([parts["gate_proj"], parts["up_proj"]], axis=1)
        return out

    def _text_name(self, name: str, hub: bool) -> str | None:
        if name.startswith("language_model."):  # mlx-lm's layout
            name = name[len("language_model."):]
        elif hub:
            if name.startswith("model.language_model."):
                name = "model." + name[len("model.language_model."):]
            elif name.startswith("model."):
                return None  # towers and projectors of other modalities
        if name.startswith(_NON_TEXT) or name.startswith(tuple("model." + p for p in _NON_TEXT)):
            return None
        if "rotary_emb" in name or name.endswith(("input_max", "input_min", "output_max",
                                                  "output_min")):
            return None
        if name.startswith("lm_head.") and self.args.tie_word_embeddings:
            return None
        if name.startswith("model.layers.") and ".self_attn." in name:
            i = int(name.split(".")[2])
            part = name.split(".self_attn.")[1].split(".")[0]
            if part in ("k_proj", "v_proj", "k_norm", "v_norm") and self.args.kv_source[i] != i:
                return None
        return name

    def update(self, parameters: dict, strict: bool = True) -> Gemma4Model:
        self._drop_derived()
        return super().update(parameters, strict=strict)

    def update_modules(self, modules: dict, strict: bool = True) -> Gemma4Model:
        self._drop_derived()
        return super().update_modules(modules, strict=strict)

    def _drop_derived(self) -> None:
        """Forget what was built from the weights: traced steps, stacked projections and
        transposed weight views."""
        self._steps.clear()
        if self._fused:
            for layer in self.layers:
                layer.self_attn.fused = layer.mlp.fused = None
            for _, module in self.named_modules():
                if isinstance(module, _HoldsTransposed):
                    module.transposed = None
            self._fused = False

    def _fuse(self) -> None:
        """Stack each layer's q/k/v and gate/up projections, once per set of weights:
        fewer, wider matmuls (and one norm and rope for q and k), the same arithmetic;
        and hold the float weights' transposed views (the tied head's included)."""
        if self._fused:
            return
        for layer in self.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()
        for _, module in self.named_modules():
            if isinstance(module, Linear):
                module.hold_transposed()
        if self.args.tie_word_embeddings and isinstance(self.model.embed_tokens, Embedding):
            self.model.embed_tokens.hold_transposed()
        self._fused = True

    # -- target interface ------------------------------------------------------
    def make_cache(self) -> list[KVCache | RingCache | None]:
        caches: list[KVCache | RingCache | None] = []
        for i, t in enumerate(self.args.layer_types):
            if self.args.kv_source[i] != i:
                caches.append(None)
            elif t == SLIDING:
                caches.append(RingCache(self.args.sliding_window))
            else:
                caches.append(KVCache())
        return caches

    def embed_tokens(self, ids: mx.array) -> mx.array:
        """The input embedding times sqrt(hidden) (the scale rounded to the weight dtype)."""
        h = self.model.embed_tokens(ids)
        return h * mx.array(self.args.hidden_size ** 0.5, h.dtype)

    def raw_logits(self, hidden: mx.array) -> mx.array:
        """The tied (or own) output head on final-normed hidden states, before softcapping."""
        if self.args.tie_word_embeddings:
            return self.model.embed_tokens.as_linear(hidden)
        return self.lm_head(hidden)

    def logits(self, hidden: mx.array) -> mx.array:
        """Final norm, head and softcap on residual-stream hidden states."""
        out = self.raw_logits(self.model.norm(hidden))
        cap = self.args.final_logit_softcapping
        return _softcap(out, mx.array(cap, out.dtype)) if cap else out

    def __call__(self, ids: mx.array, cache: Sequence[Any] | None = None, *,
                 taps: Sequence[int] | None = None) -> mx.array | tuple[mx.array, mx.array]:
        taps = self._check_taps(taps)
        self._fuse()
        if cache is not None and len(cache) != self.num_layers:
            raise ValueError(f"expected {self.num_layers} cache entries, got {len(cache)}")
        if cache is not None and self.compile_decode and self._can_replay(ids, cache):
            logits, tapped = self._forward_traced(ids, cache, taps)
        else:
            logits, tapped = self._forward_eager(ids, cache, taps)
        return (logits, tapped) if taps else logits

    def _check_taps(self, taps: Sequence[int] | None) -> tuple[int, ...]:
        if not taps:
            return ()
        taps = tuple(int(t) for t in taps)
        if any(b <= a for a, b in zip(taps, taps[1:])):
            raise ValueError(f"taps must be strictly ascending, got {list(taps)}")
        if taps[0] < 0 or taps[-1] >= self.num_layers:
            raise ValueError(f"taps must lie in [0, {self.num_layers}), got {list(taps)}")
        return taps

    # -- the layer stack (shared by both paths) ----------------------------------
    def _per_layer_inputs(self, ids: mx.array, h: mx.array) -> list[mx.array]:
        """Each layer's ``[N, P]`` input for ``N`` tokens: token table (times sqrt(P))
        and projection of the scaled embedding ``h [N, hidden]``, combined, then cut
        with one split."""
        m, a = self.model, self.args
        p = a.hidden_size_per_layer_input
        table = m.embed_tokens_per_layer(ids)
        proj = m.per_layer_model_projection(h) * (a.hidden_size ** -0.5)
        proj = m.per_layer_projection_norm(proj.reshape(-1, a.num_layers, p))
        # one fused kernel for the scales and the sum
        combined = (proj.reshape(table.shape) + table * mx.array(p ** 0.5, table.dtype)
                    ) * (2 ** -0.5)
        return _split_evenly(combined, a.num_layers)

    def _run(self, ids: mx.array, offset: int | mx.array,
             store: Callable[[int, mx.array, mx.array], KV], taps: tuple[int, ...]
             ) -> tuple[mx.array, mx.array | None]:
        """Embedding, every layer, head; ``store(i, k, v)`` files layer i's new keys
        and values in its cache and returns what its queries attend over. The stack
        runs on ``[B * L, hidden]`` rows: its matmuls need no flatten and unflatten."""
        B, L = ids.shape
        ids = ids.reshape(-1)
        h = self.embed_tokens(ids)
        ple = self._per_layer_inputs(ids, h) if self.args.hidden_size_per_layer_input else None
        kv_of: dict[int, KV] = {}
        tapped = []
        tap_set = set(taps)
        layers = self.model.layers
        x = layers[0].input_layernorm(h)
        for i, layer in enumerate(layers):
            attn = layer.self_attn
            q, k, v = attn.project(x, L, offset)
            if k is not None:
                kv = store(i, k, v)
                if i in self._shared_sources:
                    kv_of[i] = kv
            else:
                kv = kv_of[self.args.kv_source[i]]
            a = attn.attend(q, *kv)
            next_norm = layers[i + 1].input_layernorm if i + 1 < len(layers) else None
            h, x = layer.finish(h, a, ple[i] if ple is not None else None, next_norm)
            if i in tap_set:
                tapped.append(h)
        out = self.logits(h).reshape(B, L, -1)
        return out, (mx.concatenate(tapped, axis=-1).reshape(B, L, -1) if tapped else None)

    # -- eager path ------------------------------------------------------------
    def _forward_eager(self, ids: mx.array, cache: Sequence[Any] | None,
                       taps: tuple[int, ...]) -> tuple[mx.array, mx.array | None]:
        L = ids.shape[1]
        window = self.args.sliding_window
        stateful = [c for c in cache if c is not None] if cache is not None else []
        offset = stateful[0].offset if stateful else 0
        masks: dict[str, Any] = {FULL: "causal" if L > 1 else None}
        ring = next((c for c in stateful if isinstance(c, RingCache)), None)
        if ring is not None:
            masks[SLIDING] = ring.mask(L)
        else:
            masks[SLIDING] = _sliding_mask(offset, L, window)
        types = self.args.layer_types

        def store(i: int, k: mx.array, v: mx.array) -> KV:
            c = cache[i] if cache is not None else None
            if c is None:
                return k, v, masks[types[i]]
            keys, values = c.update_and_fetch(k, v)
            return keys, values, masks[types[i]]

        return self._run(ids, offset, store, taps)

    # -- traced steps: one-token decode and short verify blocks --------------------
    def _can_replay(self, ids: mx.array, cache: Sequence[Any]) -> bool:
        L = ids.shape[1]
        if L > min(TRACED_BLOCK, self.args.sliding_window):
            return False
        offsets = set()
        for i, c in enumerate(cache):
            if self.args.kv_source[i] != i:
                continue
            want = RingCache if self.args.layer_types[i] == SLIDING else KVCache
            if type(c) is not want or c.keys is None or c.keys.shape[0] != ids.shape[0]:
                return False
            if want is RingCache and c.window != self.args.sliding_window:
                return False
            offsets.add(c.offset)
        return len(offsets) == 1

    def _forward_traced(self, ids: mx.array, cache: Sequence[Any], taps: tuple[int, ...]
                        ) -> tuple[mx.array, mx.array | None]:
        L = ids.shape[1]
        own = [i for i, s in enumerate(self.args.kv_source) if s == i]
        rings = [i for i in own if isinstance(cache[i], RingCache)]
        offset = cache[own[0]].offset
        grow = DECODE_GROW_CPU if mx.default_device() == mx.cpu else DECODE_GROW
        for i in own:
            c = cache[i]
            size = c.keys.shape[2]
            if isinstance(c, KVCache) and (size < offset + L or size % grow):
                _grow(c, offset, L, grow)
        # Once every ring slot holds a position in the window, one query needs no mask.
        rings_full = L == 1 and offset >= self.args.sliding_window - 1
        capture = any(cache[i].needs_capture(L) for i in rings)
        key = (taps, L, rings_full, capture)
        step = self._steps.get(key)
        if step is None:
            # the attention kernel's self-check evaluates: settle it before tracing
            dtype = self.embed_tokens(ids[:1, :1]).dtype
            for layer in self.model.layers:
                layer.self_attn.prepare_traced(L, dtype)
            step = self._steps[key] = mx.compile(self._step_graph(own, taps, L, rings_full,
                                                                  capture))
        state = []
        for i in own:
            state += [cache[i].keys, cache[i].values]
            if not (capture and i in rings):
                # Drop the caches' references so the step's writes reuse the buffers
                # (a ring that captures keeps its window before the write instead).
                cache[i].keys = cache[i].values = None
        out = step(ids, mx.array(offset, mx.int32), state)
        logits, tapped = out[0], (out[1] if taps else None)
        rest = out[1 + bool(taps):]
        new_state, written = rest[:2 * len(own)], rest[2 * len(own):]
        for j, i in enumerate(own):
            c = cache[i]
            keys, values = new_state[2 * j], new_state[2 * j + 1]
            if isinstance(c, RingCache):
                r = rings.index(i)
                c.adopt_write(keys, values, L, (written[2 * r], written[2 * r + 1])
                              if capture else None)
            else:
                c.keys, c.values = keys, values
                c.offset = offset + L
        return logits, tapped

    def _step_graph(self, own: list[int], taps: tuple[int, ...], L: int, rings_full: bool,
                    capture: bool) -> Callable:
        """A forward of ``L`` tokens as a pure function of (ids, offset, cache buffers):
        it returns the logits, the taps, the new buffers and (``capture``) the rings'
        new keys and values."""
        window = self.args.sliding_window
        types = self.args.layer_types
        slot_of = {i: j for j, i in enumerate(own)}

        def step(ids: mx.array, offset: mx.array, state: list[mx.array]) -> list[mx.array]:
            state = list(state)
            written: list[mx.array] = []
            queries = offset + arange_constant(L)  # positions of the new tokens
            masks: dict[Any, mx.array] = {}

            def full_mask(size: int) -> mx.array:
                # a full buffer holds positions 0 .. offset + L - 1 in place
                if size not in masks:
                    masks[size] = arange_constant(size) <= offset + arange_constant(L)[:, None]
                return masks[size]

            def ring_mask() -> mx.array:
                # Before the write slot s holds position (offset - 1) - ((offset - 1 - s)
                # mod window) (negative: never written); the new keys follow the ring.
                if "ring" not in masks:
                    slots = arange_constant(window)
                    held = (offset - 1) - mx.remainder(offset - 1 - slots, window)
                    pos = mx.concatenate([held, queries])
                    q = queries[:, None]
                    masks["ring"] = (pos >= 0) & (pos <= q) & (pos > q - window)
                return masks["ring"]

            def store(i: int, k: mx.array, v: mx.array) -> KV:
                j = slot_of[i]
                keys, values = state[2 * j], state[2 * j + 1]
                if types[i] != SLIDING:
                    keys = mx.slice_update(keys, k, offset.reshape(1), (2,))
                    values = mx.slice_update(values, v, offset.reshape(1), (2,))
                    state[2 * j], state[2 * j + 1] = keys, values
                    return keys, values, full_mask(keys.shape[2])
                if L == 1:
                    # write, then attend over the ring as it stands: no copy
                    slot = mx.remainder(offset, window).reshape(1)
                    keys = mx.slice_update(keys, k, slot, (2,))
                    values = mx.slice_update(values, v, slot, (2,))
                    state[2 * j], state[2 * j + 1] = keys, values
                    mask = None if rings_full else arange_constant(window) <= offset
                    return keys, values, mask
                # A block attends over the old window plus itself, then is stored
                # (L <= window: its slots are distinct).
                out = (mx.concatenate([keys, k], axis=2), mx.concatenate([values, v], axis=2),
                       ring_mask())
                slots = mx.remainder(queries, window)[None, None, :, None]
                state[2 * j] = mx.put_along_axis(
                    keys, mx.broadcast_to(slots, k.shape), k, axis=2)
                state[2 * j + 1] = mx.put_along_axis(
                    values, mx.broadcast_to(slots, v.shape), v, axis=2)
                if capture:
                    written.extend([k, v])
                return out

            logits, tapped = self._run(ids, offset, store, taps)
            return [logits] + ([tapped] if taps else []) + state + written

        return step


#: MLX records a split into up to this many parts as one graph node, into more as a
#: slice per part
_SPLIT_NODE_PARTS = 10


def _split_evenly(x: mx.array, parts: int) -> list[mx.array]:
    """``mx.split(x, parts, axis=-1)`` in few graph nodes: groups of up to
    ``_SPLIT_NODE_PARTS`` parts first, then each group (views of the same memory)."""
    if parts <= _SPLIT_NODE_PARTS:
        return mx.split(x, parts, axis=-1)
    width = x.shape[-1] // parts
    group = _SPLIT_NODE_PARTS * width
    pieces = []
    for chunk in mx.split(x, list(range(group, x.shape[-1], group)), axis=-1):
        pieces += mx.split(chunk, chunk.shape[-1] // width, axis=-1)
    return pieces


def _grow(cache: KVCache, offset: int, n: int, step: int) -> None:
    """Give a KV cache room for positions up to ``offset + n - 1``, its capacity a
    multiple of ``step`` (a traced step is traced once per capacity)."""
    B, H, _, Dk = cache.keys.shape
    Dv = cache.values.shape[3]
    size = ((offset + n + step - 1) // step) * step
    keys = mx.zeros((B, H, size, Dk), cache.keys.dtype)
    values = mx.zeros((B, cache.values.shape[1], size, Dv), cache.values.dtype)
    keys[..., :offset, :] = cache.keys[..., :offset, :]
    values[..., :offset, :] = cache.values[..., :offset, :]
    cache.keys, cache.values = keys, values


def _sliding_mask(offset: int, n: int, window: int) -> mx.array | str | None:
    """Mask of ``n`` queries at ``offset ..`` over keys ``0 .. offset + n - 1``."""
    if n == 1 and offset < window:
        return None
    if offset + n <= window:
        return "causal"
    key_pos = mx.arange(offset + n)
    query_pos = mx.arange(offset, offset + n)[:, None]
    return (key_pos <= query_pos) & (key_pos > query_pos - window)
