"""Linear layers: one product per input, whatever the number of layers that read it.

A decode step of a small model is bound by how many operations it runs, not by its
arithmetic, so the projections that read one input (q/k/v, gate/up) run as one matrix
product whose output one split cuts into the layers' outputs (on CUDA a prompt's q/k/v
excepted: see :func:`linears`). The layers keep their
checkpoint names and shapes: on first use their weights are concatenated along the output
rows and each layer's arrays are rebound to row views of the concatenation, so memory is not
doubled; new weights loaded later (other array objects) are noticed and packed again.

Where products run on the host (:func:`mlxrunner.nn.host_products`), a 4- or 8-bit quantized
layer's products in the core's forwards for generation read its quantized words through the
core's C loops (:mod:`mlxrunner.nn.host_quantized`). Elsewhere (no C compiler, another width,
a gradient) its weights are dequantized to float32 once, on first use, for numpy's BLAS: on
these CPUs MLX's quantized loops cost as much as its reference float product, several times
the host's (bench/cpu_products.py). The copy costs 4 bytes per weight (the default model's
135M: 540 MB beside its 98 MB of quantized weights); copies stop while MLX's memory would
pass ``DEQUANTIZED_MEMORY_SHARE`` of the machine's, and the layers past that keep MLX's
quantized product.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from .cuda_products import MAX_ROWS as PRODUCT_ROWS
from .cuda_products import current, fused_product
from .derived import derived
from .host_ops import host_active, host_add, host_split
from .host_quantized import host_quantized_product
from .kernels import host_eligible, host_project, kernel_allowed, mlx_product_rows, project
from .parallel import REDUCE, Parallel

log = logging.getLogger("mlxrunner.nn")

_PACK = "_mlxrunner_pack"
_DEQUANTIZED = "_mlxrunner_dequantized"
#: dequantized copies are made while MLX's memory stays under this share of the machine's
DEQUANTIZED_MEMORY_SHARE = 0.5


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
    """``layer(x)`` (``+ residual``) for any linear layer of MLX or this module (a quantized
    embedding: its ``as_linear``): float weights through :func:`project` on their held
    transposed view, quantized ones through MLX's quantized product, or on the host from
    their dequantized copy (see the module). A row-parallel layer the core sharded sums its
    product over its group before the bias and the residual (:mod:`mlxrunner.nn.parallel`)."""
    if residual is not None:
        residual = current(residual)
    group = layer.__dict__.get(REDUCE)
    if group is not None:
        return _reduced(layer, x, residual, group)
    if _is_float(layer) and "scales" not in layer:
        w_t = _transposed(layer)
        bias = layer.get("bias")
        if mlx_product_rows(x):  # (a prompt chunk's rows on CUDA: asked first, saving the rest)
            y = x @ w_t if bias is None else mx.addmm(bias, x, w_t)
            return y if residual is None else y + residual
        if bias is None:
            fused = fused_product(x, layer["weight"], residual)
            if fused is not None:
                return fused
            if residual is None or not host_active():
                return project(x, w_t, residual)
            y = project(x, w_t)
        else:
            hosted = host_project(x, w_t)
            y = mx.addmm(bias, x, w_t) if hosted is None else _add(hosted, bias)
        return y if residual is None else _add(y, residual)
    y = _quantized_product(layer, x) if _is_quantized(layer) else layer(x)
    return y if residual is None else _add(y, residual)


def _add(y: mx.array, residual: mx.array) -> mx.array:
    hosted = host_add(y, residual)
    return residual + y if hosted is None else hosted


def _reduced(layer: nn.Module, x: mx.array, residual: mx.array | None,
             group: object) -> mx.array:
    """A row-parallel product: this rank's share, summed over the group, then the bias (added
    once, not once per rank) and the residual."""
    if _is_float(layer) and "scales" not in layer:
        y = project(x, _transposed(layer))
    elif _is_quantized(layer):
        y = _quantized_product(layer, x, with_bias=False)
    else:
        raise TypeError(f"{type(layer).__name__} cannot run row-parallel")
    y = mx.distributed.all_sum(y, group=group)  # type: ignore[arg-type]
    bias = layer.get("bias")
    if bias is not None:
        y = y + bias
    return y if residual is None else y + residual


def _quantized_product(layer: nn.Module, x: mx.array, with_bias: bool = True) -> mx.array:
    """``x`` times a quantized layer's weights, transposed (``nn.QuantizedLinear`` and
    ``nn.QuantizedEmbedding.as_linear``), plus its bias."""
    weight = layer["weight"]
    in_dims = weight.shape[1] * 32 // layer.bits
    y = None
    if host_eligible(x, in_dims, weight.shape[0]):
        y = host_quantized_product(layer, x)
        if y is None and _readable(x):
            w_t = _dequantized_t(layer, x)
            y = None if w_t is None else host_project(x, w_t)
        # (traced rows: MLX's product, and no float32 copy made for a trace that the
        # decode step declines)
    if y is None:
        y = mx.quantized_matmul(x, layer["weight"], scales=layer["scales"],
                                biases=layer.get("biases"), transpose=True,
                                group_size=layer.group_size, bits=layer.bits, mode=layer.mode)
    bias = layer.get("bias") if with_bias else None
    return y if bias is None else _add(y, bias)


def _readable(x: mx.array) -> bool:
    """Whether the host can read ``x`` (not inside a traced function)."""
    try:
        np.asarray(x)
    except ValueError:  # "[eval] ... not allowed" while tracing
        return False
    return True


_over_budget_said = False


def _dequantized_t(layer: nn.Module, x: mx.array) -> mx.array | None:
    """The float32 transposed copy of a quantized layer's weights that host products of
    ``x`` read, made once (see the module); None where none applies: not a host product,
    traced weights, or the memory share reached."""
    weight = layer["weight"]
    out_dims, in_dims = weight.shape[0], weight.shape[1] * 32 // layer.bits
    if not host_eligible(x, in_dims, out_dims):
        return None
    sources = (weight, layer["scales"], layer.get("biases"))
    held = layer.__dict__.get(_DEQUANTIZED)
    if held is not None and all(a is b for a, b in zip(held[0], sources)):
        return held[1]
    if not _dequantized_fits(4 * in_dims * out_dims):
        return None
    w = mx.dequantize(weight, sources[1], sources[2], group_size=layer.group_size,
                      bits=layer.bits, mode=layer.mode, dtype=mx.float32)
    try:
        mx.eval(w)
    except ValueError:  # traced weights (a compiled step): the host cannot run there
        return None
    object.__setattr__(layer, _DEQUANTIZED, (sources, w.T))
    return w.T


def _dequantized_fits(size: int) -> bool:
    global _over_budget_said
    try:
        machine = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (AttributeError, ValueError, OSError):  # no sysconf: no budget known
        return True
    if mx.get_active_memory() + size <= DEQUANTIZED_MEMORY_SHARE * machine:
        return True
    if not _over_budget_said:
        _over_budget_said = True
        log.info("mlxrunner: quantized layers past %.0f%% of memory keep MLX's quantized "
                 "product", 100 * DEQUANTIZED_MEMORY_SHARE)
    return False


class Linear(nn.Linear):
    """``mlx.nn.Linear`` (same parameters, same checkpoint names) whose product runs through
    :func:`mlxrunner.nn.project`, with an optional residual added the cheapest way per
    backend: ``layer(x, residual)``. ``parallel``: how it shards for tensor parallelism
    (:class:`mlxrunner.nn.Column`, :class:`mlxrunner.nn.Row`; None: replicated)."""

    def __init__(self, input_dims: int, output_dims: int, bias: bool = True,
                 parallel: Parallel | None = None) -> None:
        super().__init__(input_dims, output_dims, bias=bias)
        self.parallel = parallel

    def __call__(self, x: mx.array, residual: mx.array | None = None) -> mx.array:
        return apply_linear(self, x, residual)

    def to_quantized(self, group_size: int | None = None, bits: int | None = None,
                     mode: str = "affine", quantize_input: bool = False,
                     **_: Any) -> QuantizedLinear:
        # mlx annotates from_linear's group_size and bits `int = None`
        return QuantizedLinear.from_linear(self, group_size, bits,  # type: ignore[arg-type]
                                           mode=mode)


class QuantizedLinear(nn.QuantizedLinear):
    """``mlx.nn.QuantizedLinear`` that takes a residual like :class:`Linear` (and runs on
    the host where :class:`Linear` does, from a dequantized copy: see the module)."""

    def __call__(self, x: mx.array, residual: mx.array | None = None) -> mx.array:
        return apply_linear(self, x, residual)


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
        if len(layers) != len(self.layers):
            return False
        for layer, mine, source in zip(layers, self.layers, self.sources):
            if layer is not mine or layer["weight"] is not source:
                return False
        return True

    def __call__(self, x: mx.array) -> tuple[mx.array | None, list[mx.array]]:
        if self.joined is None:
            return None, [apply_linear(layer, x) for layer in self.layers]
        y = apply_linear(self.joined, x)
        if not self.cuts:
            return y, [y]
        hosted = host_split(y, self.cuts)
        # (mx.split's stub says it returns an array: it returns a list)
        return y, (mx.split(y, self.cuts, axis=-1)  # type: ignore[return-value]
                   if hosted is None else hosted)


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


def packed(*layers: nn.Module) -> nn.Module | None:
    """The one layer whose product :func:`linears` runs for ``layers`` (their weights
    joined along the output rows), or None where they cannot share one."""
    return _pack(layers).joined


def _pack(layers: tuple[nn.Module, ...]) -> _Pack:
    first = layers[0]
    pack = first.__dict__.get(_PACK)
    if pack is None or not pack.current(layers):
        pack = _Pack(layers)
        if pack.joined is not None or _pack_kind(layers) is None:
            object.__setattr__(first, _PACK, pack)
    return pack


def linears(x: mx.array, *layers: nn.Module) -> list[mx.array]:
    """The outputs of linear ``layers`` that all read ``x``, from one product where they can
    share one (same kind and quantization): ``q, k, v = linears(x, self.q_proj,
    self.k_proj, self.v_proj)``. On CUDA, one sequence's rows past a fused product's (a
    prompt chunk, a verify block) take a product each: each output then lies whole in
    memory, as the heads kernel after it reads it, where each slice of one product's rows
    would first be copied (three copies to save two launches)."""
    if len(layers) > 1 and x.ndim == 3 and x.shape[0] == 1 and x.shape[1] > PRODUCT_ROWS \
            and kernel_allowed("norms"):
        _pack(layers)  # (joined all the same: each layer's weight a view of the join, not
        return [apply_linear(layer, x) for layer in layers]  # a second copy beside it)
    return joined_linears(x, *layers)[1]


def joined_linears(x: mx.array, *layers: nn.Module) -> tuple[mx.array | None, list[mx.array]]:
    """:func:`linears`, and the one product's output the outputs are consecutive slices of
    (None where the layers could not share one): a fused kernel may read it in place."""
    if len(layers) == 1:
        y = apply_linear(layers[0], x)
        return y, [y]
    return _pack(layers)(x)
