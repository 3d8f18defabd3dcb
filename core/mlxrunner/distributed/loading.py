"""Loading a model folder's target as one rank of a tensor- or pipeline-parallel job."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import mlx.core as mx

from .. import settings
from ..errors import ModelFolderError
from ..model.interface import Model
from ..model.loading import (
    assign_weights,
    build_model,
    cast_floats,
    declared_dtype,
    host_dtype,
    parse_dtype,
    quantize_for_checkpoint,
    read_config,
    resolve_model_path,
    weight_files,
)
from ..nn.parallel import ShardError
from .group import DistributedError, check_mode
from .pipeline import apply_pipeline
from .reading import lazy_weights, read_ranges, scaled, slice_ranges
from .tensor import TensorPlan, apply_tensor, connect_rows


def load_sharded(path: str | Path, mode: str, group: Any,
                 dtype: str | mx.Dtype | None = None) -> Model:
    """This rank's part of a folder's target (``mode``: ``tensor`` or ``pipeline``), its
    weights read from the checkpoint: in pipeline mode only its layers' tensors (and the
    replicated embedding, norm and head), in tensor mode its slice of each split tensor.
    A group of one rank loads the whole model."""
    check_mode(mode)
    folder = resolve_model_path(path)
    config = read_config(folder)
    model = build_model(config, str(folder / "config.json"))
    rank, size = group.rank(), group.size()
    if size > 1:
        # A rank runs its forwards eagerly: a traced graph holding send/recv never returns
        # on MLX 0.32's ring backend, and a trace that one rank declined and another kept
        # would part their sequences of collectives; no decision may rest on a rank's own
        # timing (lockstep: the speculative depth follows acceptance alone).
        settings.configure(compile=False, lockstep=True)
    plan: TensorPlan | None = None
    dropped: tuple[str, ...] = ()
    try:
        if size > 1 and mode == "tensor":
            plan = apply_tensor(model, rank, size)
        elif size > 1:
            dropped = apply_pipeline(model, group)
    except ShardError as exc:
        raise DistributedError(f"{folder}: cannot shard over {size} ranks: {exc}") from None
    weights, origins = lazy_weights(weight_files(folder))
    weights = {k: v for k, v in weights.items() if not k.startswith("draft.")}
    try:
        weights = model.sanitize(weights)
    except (KeyError, ValueError, IndexError) as exc:
        raise ModelFolderError(f"{folder}: checkpoint does not fit the architecture "
                               f"({exc})") from None
    # judged on the whole model's weights (ranks sharing a machine share its memory), and
    # agreed: every rank must compute in one dtype for its collectives to match
    target = parse_dtype(dtype) if dtype is not None else \
        _agreed_dtype(declared_dtype(config), weights, group)
    if dropped:
        weights = {k: v for k, v in weights.items() if not k.startswith(dropped)}
    if plan is not None:
        weights = _slices(weights, origins, plan, rank, size)
    quantize_for_checkpoint(model, config, weights)
    if target is not None:
        weights = cast_floats(weights, target)
    assign_weights(model, weights, folder)
    mx.eval(model.parameters())
    model.eval()
    if plan is not None:
        connect_rows(model, plan, group)
    return model


def _agreed_dtype(declared: mx.Dtype | None, weights: dict[str, mx.array],
                  group: Any) -> mx.Dtype | None:
    """:func:`~mlxrunner.model.loading.host_dtype` where every rank of ``group`` chose it
    (each asks of its own device and memory), else ``declared``."""
    chosen = host_dtype(declared, weights)
    if group.size() == 1:
        return chosen
    votes = mx.distributed.all_sum(mx.array(int(chosen != declared), dtype=mx.int32),
                                   group=group)
    return chosen if votes.item() == group.size() else declared


def _slices(weights: dict[str, mx.array], origins: dict[int, Any], plan: TensorPlan,
            rank: int, size: int) -> dict[str, mx.array]:
    """Each split tensor's slice for ``rank`` (read from its file where ``sanitize`` passed it
    on as it was, else cut from what ``sanitize`` computed), evaluated one by one."""
    out: dict[str, mx.array] = {}
    for name, value in weights.items():
        split = plan.split_of(name)
        if split is None:
            out[name] = value
            continue
        declared = sum(length for length, _ in split.segments)
        try:
            ranges = scaled(split.ranges(rank, size, name), declared,
                            value.shape[split.axis], name)
        except ValueError as exc:
            raise DistributedError(f"cannot shard over {size} ranks: {exc}") from None
        origin = origins.get(id(value))
        if origin is not None and tuple(origin.shape) == tuple(value.shape):
            out[name] = read_ranges(origin, split.axis, ranges)
        else:
            out[name] = slice_ranges(value, split.axis, ranges)
        mx.eval(out[name])
    return out
