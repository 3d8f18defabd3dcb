"""Tensor parallelism: every layer on every rank, each with its share of the heads.

The layers declare how they split (:mod:`mlxrunner.nn.parallel`); this module applies those
declarations to a freshly built model: parameters take their local shapes and layers their
local head counts before the weights are read, each rank reads its slices, and the
row-parallel layers then sum their products over the group. Every rank ends a forward
with the same logits (an ``all_sum`` gives each rank the same sum), so every rank chooses
the same tokens and runs the same generation loop as one process would. Summing partial
products changes the order of additions: logits differ from one process's by rounding
(about 1e-6 in float32).
"""

from __future__ import annotations

from typing import Any

import mlx.nn as nn

from ..nn.parallel import Split, is_row_parallel, set_reduce, sharded_modules, shrink


class TensorPlan:
    """What sharding changed: each sharded parameter's split, by its full name, and the
    row-parallel layers' paths."""

    def __init__(self) -> None:
        self.splits: dict[str, Split] = {}
        self.modules: dict[str, dict[str, Split]] = {}
        self.rows: list[str] = []

    def split_of(self, name: str) -> Split | None:
        """The split of a checkpoint tensor (a quantized layer's ``scales`` and ``biases``
        follow its ``weight``)."""
        found = self.splits.get(name)
        if found is not None:
            return found
        path, _, leaf = name.rpartition(".")
        if leaf in ("scales", "biases"):
            return self.splits.get(f"{path}.weight")
        return None


def apply_tensor(model: nn.Module, rank: int, size: int) -> TensorPlan:
    """Give every declared layer of ``model`` its local shapes and head counts."""
    plan = TensorPlan()
    found = list(sharded_modules(model))
    for path, module, splits in found:
        plan.modules[path] = splits
        for name, split in splits.items():
            plan.splits[f"{path}.{name}" if path else name] = split
        if is_row_parallel(module):
            plan.rows.append(path)
    for path, module, splits in found:
        shrink(module, splits, rank, size, path)
    return plan


def connect_rows(model: nn.Module, plan: TensorPlan, group: Any) -> None:
    """Make the row-parallel layers (quantized by now, perhaps) sum over ``group``."""
    modules = dict(model.named_modules())
    for path in plan.rows:
        set_reduce(modules[path], group)
