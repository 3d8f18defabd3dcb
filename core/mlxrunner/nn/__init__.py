"""The layers architectures compose (``mlxrunner.nn``, public for plugin authors).

Each picks MLX's operations, MLX's fast operations or our fused kernels for the device it
runs on, with one self-check and fallback for every kernel (the kernels and their checks
are the core's own, in the private ``kernels`` module); weights that are packed or
transposed for speed are derived once and keep their checkpoint names. An architecture
built from these layers reads as its math; the core traces its decode step (as it traces
any architecture's).
"""

from __future__ import annotations

from ..constants import arange_constant, constant
from ..lazy import lazy_exports
from .attention import KV, attend, store
from .cuda_products import current as residual_stream
from .deltanet import GatedDeltaNet, chunked_gated_delta
from .derived import derived
from .embedding import Embedding, QuantizedEmbedding
from .heads import attention_heads
from .linear import Linear, QuantizedLinear, apply_linear, joined_linears, linears
from .mlp import ACTIVATIONS, GatedMLP, gelu_tanh_mul, silu_mul, softcap
from .moe import ExpertLinear, GatedExperts, QuantizedExpertLinear, experts_glu
from .norm import RMSNorm, gated_rms_norm, rms_norm
from .parallel import Column, Row, ShardError, Split
from .rope import RoPE, RopeConfigError
from .taps import Taps, caches_only, head_rows, last_logits_only

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
    "attention_heads",
    "caches_only",
    "chunked_gated_delta",
    "constant",
    "derived",
    "experts_glu",
    "gated_rms_norm",
    "gelu_tanh_mul",
    "head_rows",
    "joined_linears",
    "last_logits_only",
    "linears",
    "residual_stream",
    "rms_norm",
    "silu_mul",
    "softcap",
    "store",
]

# Kernel and trace plumbing this module exported before: still resolved for old plugins
# (a DeprecationWarning at first use), listed nowhere.
_PLUMBING = {name: "kernels" for name in (
    "check_kernel", "host_bound", "host_declined", "host_products", "kernel_allowed",
    "on_cuda", "outputs_agree", "project", "serves", "switch_allows")}
_PLUMBING.update(folded_attention="attention", prepare_attend="attention")
__getattr__, __dir__ = lazy_exports(
    __name__, _PLUMBING, listed=__all__,
    moved={name: "internal to the core; kept for plugins written before" for name in _PLUMBING})
