"""Linear layers: one product per input, whatever the number of layers that read it.

A decode step of a small model is bound by how many operations it runs, not by its
arithmetic, so the projections that read one input (q/k/v, gate/up) run as one matrix
product whose output one split cuts into the layers' outputs. The layers keep their
checkpoint names and shapes: on first use their weights are concatenated along the output
rows and each layer's arrays are rebound to row views of the concatenation, so memory is not
doubled; new weights loaded later (other array objects) are noticed and packed again.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

from .derived import derived
from .kernels import project

_PACK = "_mlxrunner_pack"


def _transposed(layer: nn.Module) -> mx.array:
    """The evaluated transposed view ``weight.T`` of a float layer, held beside it (a traced
    forward then holds it as a constant instead of replaying a transpose)."""
    return derived(layer, "weight_t", (layer["weight"],), lambda w: w.T)


def _is_float(layer: nn.Module) -> bool:
    return type(layer) in (nn.Linear, Linear, nn.Embedding) or (
        isinstance(layer, (nn.Linear, nn.Embedding)) and not hasattr(layer, "scales"))


def _is_quantized(layer: nn.Module) -> bool:
    return isinstance(layer, (nn.QuantizedLinear, nn.QuantizedEmbedding))


def apply_linear(layer: nn.Module, x: mx.array, residual: mx.array | None = None) -> mx.array:
    """``layer(x)`` (``+ residual``) for any linear layer of MLX or this module: float
    weights through :func:`project` on their held transposed view, quantized ones through
    MLX's quantized product."""
    if _is_float(layer) and "scales" not in layer:
        bias = layer.get("bias")
        if bias is not None:
            y = mx.addmm(bias, x, _transposed(layer))
            return y if residual is None else y + residual
        return project(x, _transposed(layer), residual)
    y = layer(x)
    return y if residual is None else residual + y


class Linear(nn.Linear):
    """``mlx.nn.Linear`` (same parameters, same checkpoint names) whose product runs through
    :func:`mlxrunner.nn.project`, with an optional residual added the cheapest way per
    backend: ``layer(x, residual)``."""

    def __call__(self, x: mx.array, residual: mx.array | None = None) -> mx.array:
        return apply_linear(self, x, residual)

    def to_quantized(self, group_size: int | None = None, bits: int | None = None,
                     mode: str = "affine", quantize_input: bool = False,
                     **_: Any) -> QuantizedLinear:
        # mlx annotates from_linear's group_size and bits `int = None`
        return QuantizedLinear.from_linear(self, group_size, bits,  # type: ignore[arg-type]
                                           mode=mode)


class QuantizedLinear(nn.QuantizedLinear):
    """``mlx.nn.QuantizedLinear`` that takes a residual like :class:`Linear`."""

    def __call__(self, x: mx.array, residual: mx.array | None = None) -> mx.array:
        y = super().__call__(x)
        return y if residual is None else residual + y


class _Pack:
    """Several layers' weights joined along the output rows (see the module)."""

    def __init__(self, layers: tuple[nn.Module, ...]) -> None:
        self.layers = layers
        self.sources = tuple(layer["weight"] for layer in layers)
        rows = [layer["weight"].shape[0] for layer in layers]
        self.cuts = [sum(rows[:i]) for i in range(1, len(rows))]
        self.kind = _pack_kind(layers)
        self.joined: nn.Module | None = None
        if self.kind is not None:
            self._join()

    def _join(self) -> None:
        layers = self.layers
        first = layers[0]
        keys = [k for k in ("weight", "scales", "biases", "bias") if k in first]
        joined = {k: mx.concatenate([layer[k] for layer in layers], axis=0) for k in keys}
        try:
            mx.eval(list(joined.values()))
        except ValueError:  # traced weights (a training step, a gradient): one by one
            self.kind = None
            return
        start = 0
        for layer in layers:
            rows = layer["weight"].shape[0]
            for k in keys:
                layer[k] = joined[k][start:start + rows]
            start += rows
        # (the layer's own initial arrays are lazy and never evaluated: they cost nothing)
        out_dims = joined["weight"].shape[0]
        module: nn.Module
        if _is_quantized(first):
            in_dims = first["weight"].shape[1] * 32 // first.bits
            module = nn.QuantizedLinear(in_dims, out_dims, bias="bias" in joined,
                                        group_size=first.group_size, bits=first.bits,
                                        mode=first.mode)
        else:
            module = Linear(first["weight"].shape[1], out_dims, bias="bias" in joined)
        for k, v in joined.items():
            module[k] = v
        self.joined = module
        self.sources = tuple(layer["weight"] for layer in layers)

    def current(self, layers: tuple[nn.Module, ...]) -> bool:
        return len(layers) == len(self.layers) and all(
            a is b for a, b in zip(layers, self.layers)) and all(
            a is layer["weight"] for a, layer in zip(self.sources, layers))

    def __call__(self, x: mx.array) -> tuple[mx.array | None, list[mx.array]]:
        if self.joined is None:
            return None, [apply_linear(layer, x) for layer in self.layers]
        y = apply_linear(self.joined, x)
        # (mx.split's stub says it returns an array: it returns a list)
        return y, (mx.split(y, self.cuts, axis=-1)  # type: ignore[return-value]
                   if self.cuts else [y])


def _pack_kind(layers: tuple[nn.Module, ...]) -> tuple[Any, ...] | None:
    """What must agree for layers to share a product: float or the same quantization, and
    the same parameters (bias or none); None where they cannot."""
    kinds: set[tuple[Any, ...]] = set()
    for layer in layers:
        if _is_quantized(layer):
            kinds.add(("q", layer.group_size, layer.bits, layer.mode,
                       tuple(sorted(k for k in ("scales", "biases", "bias") if k in layer))))
        elif _is_float(layer):
            kinds.add(("f", "bias" in layer, layer["weight"].dtype))
        else:
            return None
    return kinds.pop() if len(kinds) == 1 else None


def linears(x: mx.array, *layers: nn.Module) -> list[mx.array]:
    """The outputs of linear ``layers`` that all read ``x``, from one product where they can
    share one (same kind and quantization): ``q, k, v = linears(x, self.q_proj,
    self.k_proj, self.v_proj)``."""
    return joined_linears(x, *layers)[1]


def joined_linears(x: mx.array, *layers: nn.Module) -> tuple[mx.array | None, list[mx.array]]:
    """:func:`linears`, and the one product's output the outputs are consecutive slices of
    (None where the layers could not share one): a fused kernel may read it in place."""
    if len(layers) == 1:
        y = apply_linear(layers[0], x)
        return y, [y]
    first = layers[0]
    pack = first.__dict__.get(_PACK)
    if pack is None or not pack.current(layers):
        pack = _Pack(layers)
        if pack.joined is not None or _pack_kind(layers) is None:
            object.__setattr__(first, _PACK, pack)
    return pack(x)
