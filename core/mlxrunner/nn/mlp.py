"""Gated feed-forward blocks: ``down(act(gate(x)) * up(x))``."""

from __future__ import annotations

import math
from functools import partial

import mlx.core as mx
import mlx.nn as nn

from .cuda_gated import gated_rows
from .cuda_products import fused_gated, fused_product, short_rows
from .host_ops import host_silu_mul
from .linear import Linear, apply_linear, joined_linears, packed
from .parallel import Column, Row


@partial(mx.compile, shapeless=True)
def _silu_mul(gate: mx.array, up: mx.array) -> mx.array:
    return nn.silu(gate) * up


@partial(mx.compile, shapeless=True)
def _gelu_tanh_mul(gate: mx.array, up: mx.array) -> mx.array:
    g = gate.astype(mx.float32)
    g = 0.5 * g * (1.0 + mx.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g * g * g)))
    return g.astype(up.dtype) * up


def silu_mul(gate: mx.array, up: mx.array) -> mx.array:
    """``silu(gate) * up`` as one fused kernel (on CUDA, where ``gate`` is a decode step's
    product: in that product's kernel)."""
    fused = fused_gated(gate, up, "silu")
    return _silu_mul(gate, up) if fused is None else fused


def gelu_tanh_mul(gate: mx.array, up: mx.array) -> mx.array:
    """``gelu_tanh(gate) * up`` (``gelu_pytorch_tanh``), the GELU in float32 and rounded
    once, as torch computes it for half-precision inputs; one fused kernel (on CUDA, where
    ``gate`` is a decode step's product: in that product's kernel)."""
    fused = fused_gated(gate, up, "gelu_tanh")
    return _gelu_tanh_mul(gate, up) if fused is None else fused


@partial(mx.compile, shapeless=True)
def _softcap(x: mx.array, cap: mx.array) -> mx.array:
    return mx.tanh(x / cap) * cap


def softcap(x: mx.array, cap: float | None) -> mx.array:
    """``cap * tanh(x / cap)`` as one fused kernel (``x`` itself where ``cap`` is None or 0)."""
    return _softcap(x, mx.array(cap, x.dtype)) if cap else x


ACTIVATIONS = {"silu": silu_mul, "swish": silu_mul, "gelu_pytorch_tanh": gelu_tanh_mul,
               "gelu_tanh": gelu_tanh_mul}
#: the fused products' names of these activations (mlxrunner.nn.cuda_products)
_FUSED_NAMES = {silu_mul: "silu", gelu_tanh_mul: "gelu_tanh"}


class GatedMLP(nn.Module):
    """``down_proj(act(gate_proj(x)) * up_proj(x))``; gate and up run as one product.
    ``activation``: a config's ``hidden_act`` (silu, gelu_pytorch_tanh). Tensor-parallel:
    gate and up by columns, down by rows."""

    def __init__(self, hidden: int, intermediate: int, activation: str = "silu",
                 bias: bool = False) -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {activation!r} "
                             f"(known: {', '.join(sorted(ACTIVATIONS))})")
        self.gate_proj = Linear(hidden, intermediate, bias=bias, parallel=Column())
        self.up_proj = Linear(hidden, intermediate, bias=bias, parallel=Column())
        self.down_proj = Linear(intermediate, hidden, bias=bias, parallel=Row())
        self._act = ACTIVATIONS[activation]

    def __call__(self, x: mx.array, residual: mx.array | None = None) -> mx.array:
        """``mlp(x)`` (``+ residual``, added in the down projection)."""
        joined = packed(self.gate_proj, self.up_proj) if short_rows(x) else None
        if joined is not None and "bias" not in joined and "scales" not in joined:
            # on CUDA, gate, up and the activation as one kernel
            fused = fused_product(x, joined["weight"], activation=_FUSED_NAMES[self._act])
            if fused is not None:
                return apply_linear(self.down_proj, fused, residual)
        joined_out, (gate, up) = joined_linears(x, self.gate_proj, self.up_proj)
        # (on CUDA, a prompt's activation as the core's kernel on the one product's output)
        h = None if joined_out is None else gated_rows(joined_out, _FUSED_NAMES[self._act])
        if h is None and self._act is silu_mul:
            h = host_silu_mul(gate, up)
        return apply_linear(self.down_proj, self._act(gate, up) if h is None else h, residual)
