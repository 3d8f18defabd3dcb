"""How layers shard for tensor parallelism: declarations only; the core applies them.

A layer says how its parameters split over the ranks of a group; ``mlxrunner.distributed``
reads those declarations when it loads a model sharded, gives each rank its slice of the
checkpoint, shrinks the layer's head counts and makes row-parallel products sum their
partial outputs over the group. An architecture declares nothing else: its math reshapes
heads with ``-1`` (the local count) and runs unchanged.

- a column-parallel linear layer (``Linear(..., parallel=Column(heads=H))``) keeps the rows
  (output features) of its share of ``H`` heads; where ``H`` is smaller than the group
  (key/value heads of grouped-query attention) each rank keeps the one head its query
  heads read, so those heads are replicated;
- a row-parallel one (``parallel=Row()``) keeps its share of the input features; its
  product is summed over the group (``all_sum``) before the bias and the residual;
- :class:`mlxrunner.nn.GatedMLP` splits gate/up by columns and down by rows;
  :class:`mlxrunner.nn.GatedDeltaNet` splits its heads (key heads replicated where fewer
  than the ranks, like attention's); :class:`mlxrunner.nn.GatedExperts` splits its
  experts (each rank runs the routed tokens' experts it holds; the ranks sum).

Anything undeclared (embeddings, norms, heads, routers) is replicated: correct, only not
smaller.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

#: the attribute a row-parallel layer's group is held in once the core sharded it
REDUCE = "_mlxrunner_reduce"


class ShardError(ValueError):
    """A layer cannot split over this many ranks (the message says which and why)."""


@dataclass(frozen=True)
class Split:
    """How one parameter splits along ``axis`` (0: rows, -1: the last axis).

    ``segments``: consecutive blocks along the axis, each ``(length, units)``, cut on its
    own (q | k | v of a packed projection); ``units`` is the number of heads in the block
    (None: the block splits evenly, one share per rank). Lengths are the layer's own; a
    quantized tensor whose axis is packed scales them."""

    axis: int
    segments: tuple[tuple[int, int | None], ...]

    def ranges(self, rank: int, size: int, what: str = "parameter") -> list[tuple[int, int]]:
        """The ``[start, stop)`` ranges of the axis rank ``rank`` of ``size`` keeps."""
        out: list[tuple[int, int]] = []
        start = 0
        for length, units in self.segments:
            u = size if units is None else units
            if u <= 0 or length % u:
                into = f"over {size} ranks" if units is None else f"into {u} heads"
                raise ShardError(f"{what}: {length} features do not split {into}")
            unit = length // u
            if u >= size:
                if u % size:
                    raise ShardError(f"{what}: {u} heads do not split over {size} ranks")
                per = u // size
                out.append((start + rank * per * unit, start + (rank + 1) * per * unit))
            else:  # fewer heads than ranks: each rank keeps the head its share reads
                if size % u:
                    raise ShardError(f"{what}: {u} heads cannot be shared by {size} ranks")
                head = rank * u // size
                out.append((start + head * unit, start + (head + 1) * unit))
            start += length
        return out

    def local_length(self, size: int, what: str = "parameter") -> int:
        return sum(b - a for a, b in self.ranges(0, size, what))

    @staticmethod
    def local_units(units: int, size: int) -> int:
        """How many of ``units`` heads a rank keeps (at least one: replicated)."""
        return max(units // size, 1)


@dataclass(frozen=True)
class Column:
    """Column-parallel: the output features split, ``heads`` heads at a time (None: evenly)."""

    heads: int | None = None


@dataclass(frozen=True)
class Row:
    """Row-parallel: the input features split; the partial products are summed."""


Parallel = Column | Row


def linear_splits(layer: nn.Module, parallel: Parallel) -> dict[str, Split]:
    """The splits of a linear layer's parameters (``weight [out, in]``, ``bias [out]``)."""
    out_dims, in_dims = layer["weight"].shape
    if isinstance(parallel, Column):
        split = Split(0, ((out_dims, parallel.heads),))
        splits = {"weight": split}
        if "bias" in layer:
            splits["bias"] = split
        return splits
    return {"weight": Split(-1, ((in_dims, None),))}  # a row layer's bias is added once


def declared_splits(module: nn.Module) -> dict[str, Split]:
    """A module's own parameters' splits: its ``parallel`` declaration (a linear layer) or
    its ``shard_splits()`` (a layer of several parameters)."""
    own = getattr(module, "shard_splits", None)
    if callable(own):
        return dict(own())
    parallel = getattr(module, "parallel", None)
    if isinstance(parallel, (Column, Row)):
        return linear_splits(module, parallel)
    return {}


def sharded_modules(model: nn.Module) -> Iterator[tuple[str, nn.Module, dict[str, Split]]]:
    """``(path, module, splits)`` for every module of ``model`` that declares a split."""
    for path, module in model.named_modules():
        splits = declared_splits(module)
        if splits:
            yield path, module, splits


def is_row_parallel(module: nn.Module) -> bool:
    """Whether the module's output is a partial sum the ranks add up: a row-parallel linear
    layer, or a layer that says so (``sums_over_ranks``: experts split over the ranks)."""
    return isinstance(getattr(module, "parallel", None), Row) or bool(
        getattr(module, "sums_over_ranks", False))


def shrink(module: nn.Module, splits: dict[str, Split], rank: int, size: int,
           path: str) -> None:
    """Give ``module`` parameters of its local shapes (zeros, replaced by the load) and let
    it shrink its own head counts (``shard_heads(rank, size)``)."""
    current = dict(tree_flatten(module.parameters()))
    local = []
    for name, split in splits.items():  # names may reach into children ("conv1d.weight")
        value = current[name]
        shape = list(value.shape)
        shape[split.axis] = split.local_length(size, f"{path}.{name}" if path else name)
        local.append((name, mx.zeros(shape, dtype=value.dtype)))
    module.update(tree_unflatten(local))
    shard_heads = getattr(module, "shard_heads", None)
    if callable(shard_heads):
        shard_heads(rank, size)


def set_reduce(module: nn.Module, group: Any) -> None:
    """Make a row-parallel layer sum its products over ``group``."""
    object.__setattr__(module, REDUCE, group)


def reduce_group(module: nn.Module) -> Any:
    return module.__dict__.get(REDUCE)
