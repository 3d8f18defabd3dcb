"""The layers architectures compose (``mlxrunner.nn``, public for plugin authors).

Each picks MLX's operations, MLX's fast operations or our fused kernels for the device it
runs on, with one self-check and fallback for every kernel (:func:`serves`); weights that
are packed or transposed for speed are derived once and keep their checkpoint names. An
architecture built from these layers reads as its math; the core traces its decode step
(as it traces any architecture's).
"""

from __future__ import annotations

from ..constants import arange_constant, constant
from .attention import KV, attend, folded_attention, prepare_attend, store
from .deltanet import GatedDeltaNet, chunked_gated_delta
from .derived import derived
from .embedding import Embedding, QuantizedEmbedding
from .kernels import (
    check_kernel,
    host_bound,
    host_declined,
    host_products,
    kernel_allowed,
    on_cuda,
    outputs_agree,
    project,
    serves,
    switch_allows,
)
from .linear import Linear, QuantizedLinear, apply_linear, joined_linears, linears
from .mlp import ACTIVATIONS, GatedMLP, gelu_tanh_mul, silu_mul, softcap
from .moe import ExpertLinear, GatedExperts, QuantizedExpertLinear, experts_glu
from .norm import RMSNorm, gated_rms_norm, rms_norm
from .parallel import Column, Row, ShardError, Split
from .rope import RoPE, RopeConfigError
from .taps import Taps

__all__ = [
    "ACTIVATIONS",
    "KV",
    "Column",
    "Embedding",
    "ExpertLinear",
    "GatedExperts",
    "GatedDeltaNet",
    "GatedMLP",
    "Linear",
    "QuantizedEmbedding",
    "QuantizedExpertLinear",
    "QuantizedLinear",
    "RMSNorm",
    "RoPE",
    "RopeConfigError",
    "Row",
    "ShardError",
    "Split",
    "Taps",
    "apply_linear",
    "arange_constant",
    "attend",
    "check_kernel",
    "chunked_gated_delta",
    "constant",
    "derived",
    "experts_glu",
    "folded_attention",
    "gated_rms_norm",
    "gelu_tanh_mul",
    "host_bound",
    "host_declined",
    "host_products",
    "joined_linears",
    "kernel_allowed",
    "linears",
    "on_cuda",
    "outputs_agree",
    "prepare_attend",
    "project",
    "rms_norm",
    "serves",
    "silu_mul",
    "softcap",
    "store",
    "switch_allows",
]
