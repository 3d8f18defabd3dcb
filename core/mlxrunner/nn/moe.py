"""Mixture-of-experts layers: one weight per expert, applied by index with ``gather_mm``
(``gather_qmm`` once quantized)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .parallel import REDUCE, ShardError, Split

#: from this many (token, expert) pairs on, rows are grouped by expert first, so that each
#: expert's weights are read once
SORT_FROM = 64


class ExpertLinear(nn.Module):
    """A linear map per expert, ``weight [experts, out, in]``: ``layer(x, indices)`` applies
    expert ``indices[...]`` to the rows of ``x`` (broadcast as ``gather_mm`` does)."""

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
    """:class:`ExpertLinear` with quantized weights (``gather_qmm``)."""

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


def experts_glu(x: mx.array, indices: mx.array, weights: mx.array, gate_up: nn.Module,
                down: nn.Module, act_mul: Callable[[mx.array, mx.array], mx.array]
                ) -> mx.array:
    """``sum_j weights[..., j] * down_e(act(gate_e(x)) * up_e(x))`` over the ``k`` experts
    ``e = indices[..., j]`` of each token; ``gate_up`` gives gate and up side by side."""
    lead = x.shape[:-1]
    k = indices.shape[-1]
    x = x.reshape(-1, x.shape[-1])
    idx = indices.reshape(-1, k)

    def glu(rows: mx.array, chosen: mx.array, sorted_indices: bool) -> mx.array:
        gate, up = mx.split(gate_up(rows, chosen, sorted_indices), 2, axis=-1)
        return down(act_mul(gate, up), chosen, sorted_indices)

    if idx.size >= SORT_FROM:
        flat = idx.flatten()
        order = mx.argsort(flat)
        y = glu(x[order // k][:, None, :], flat[order], True)
        y = y[mx.argsort(order)].reshape(-1, k, x.shape[-1])
    else:
        y = glu(x[:, None, None, :], idx, False).squeeze(-2)
    y = (y * weights.reshape(-1, k, 1).astype(y.dtype)).sum(axis=-2)
    return y.reshape(*lead, -1)


class GatedExperts(nn.Module):
    """``experts`` gated MLPs applied by index: ``gate_up_proj`` (gate and up side by side)
    and ``down_proj``, as transformers' fused expert tensors name them; ``act_mul`` is the
    gate's activation times up (``silu_mul``, ``gelu_tanh_mul``). Tensor-parallel: the
    experts split over the ranks; each rank applies the chosen experts it holds (the others
    weigh 0) and the ranks sum."""

    #: once sharded, the output is this rank's part of a sum over the ranks
    sums_over_ranks = True

    def __init__(self, experts: int, hidden: int, intermediate: int,
                 act_mul: Callable[[mx.array, mx.array], mx.array]) -> None:
        super().__init__()
        self.gate_up_proj = ExpertLinear(experts, hidden, 2 * intermediate)
        self.down_proj = ExpertLinear(experts, intermediate, hidden)
        self._act_mul = act_mul
        self.experts = experts
        self.first_expert = 0  # of this rank's, once sharded

    def shard_splits(self) -> dict[str, Split]:
        experts = Split(0, ((self.experts, self.experts),))
        return {"gate_up_proj.weight": experts, "down_proj.weight": experts}

    def shard_heads(self, rank: int, size: int) -> None:
        if self.experts % size:
            raise ShardError(f"{self.experts} experts do not split over {size} ranks")
        self.experts //= size
        self.first_expert = rank * self.experts

    def __call__(self, x: mx.array, indices: mx.array, weights: mx.array) -> mx.array:
        group = self.__dict__.get(REDUCE)
        if group is None:
            return experts_glu(x, indices, weights, self.gate_up_proj, self.down_proj,
                               self._act_mul)
        local = indices - self.first_expert
        held = (local >= 0) & (local < self.experts)
        y = experts_glu(x, mx.where(held, local, 0).astype(indices.dtype),
                        weights * held.astype(weights.dtype), self.gate_up_proj,
                        self.down_proj, self._act_mul)
        return mx.distributed.all_sum(y, group=group)
