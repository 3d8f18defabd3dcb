"""Reading a rank's part of a checkpoint: whole tensors lazily, slices from the file itself.

MLX maps a safetensors file lazily, but evaluating a slice of one of its tensors reads the
whole tensor first. A rank of a tensor-parallel group wants a slice of most tensors, so a
tensor that reaches the model under its own array (``sanitize`` renamed it at most) is read
here, straight from the file's bytes: the ranges of the split axis through a memory map, so
the pages the rank does not keep are not read (rows of a row-major tensor are contiguous; a
column slice reads its share of every row). A tensor ``sanitize`` computed (a transposed
convolution, a concatenation) is sliced after it was computed.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from pathlib import Path

import mlx.core as mx
import numpy as np

from ..model.loading import read_weights

#: numpy's dtype for each safetensors dtype read by bytes (bfloat16 as its 16-bit pattern)
_NUMPY = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "F64": np.float64,
          "U8": np.uint8, "I8": np.int8, "U16": np.uint16, "I16": np.int16,
          "U32": np.uint32, "I32": np.int32, "U64": np.uint64, "I64": np.int64,
          "BOOL": np.bool_}


@dataclass(frozen=True)
class Origin:
    """Where a checkpoint tensor's bytes are: file, data offset, dtype and shape."""

    path: Path
    offset: int
    dtype: str
    shape: tuple[int, ...]


def _origins(path: Path) -> dict[str, Origin]:
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    return {name: Origin(path, 8 + n + int(info["data_offsets"][0]), str(info["dtype"]),
                         tuple(int(d) for d in info["shape"]))
            for name, info in header.items() if name != "__metadata__"}


def lazy_weights(files: list[Path]) -> tuple[dict[str, mx.array], dict[int, Origin]]:
    """The checkpoint's tensors, lazily (nothing is read yet), and where each one's bytes
    are, keyed by the array's ``id`` (the arrays stay alive as long as the dict does)."""
    weights = read_weights(files)  # checks each file's structure first
    origins: dict[int, Origin] = {}
    for f in files:
        for name, origin in _origins(f).items():
            if name in weights and origin.dtype in _NUMPY:
                origins[id(weights[name])] = origin
    return weights, origins


def read_ranges(origin: Origin, axis: int, ranges: list[tuple[int, int]]) -> mx.array:
    """The ``ranges`` of ``axis`` of a tensor, read from its file (only those bytes)."""
    mapped = np.memmap(origin.path, dtype=_NUMPY[origin.dtype], mode="r",
                       offset=origin.offset, shape=origin.shape)
    axis = axis % len(origin.shape)
    index = [slice(None)] * len(origin.shape)
    parts = []
    for start, stop in ranges:
        index[axis] = slice(start, stop)
        parts.append(np.array(mapped[tuple(index)]))
    data = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=axis)
    del mapped
    array = mx.array(data)
    return array.view(mx.bfloat16) if origin.dtype == "BF16" else array


def slice_ranges(value: mx.array, axis: int, ranges: list[tuple[int, int]]) -> mx.array:
    """The ``ranges`` of ``axis`` of an array (computed: evaluated in full, then cut)."""
    axis = axis % value.ndim
    parts = []
    for start, stop in ranges:
        index = [slice(None)] * value.ndim
        index[axis] = slice(start, stop)
        parts.append(value[tuple(index)])
    return parts[0] if len(parts) == 1 else mx.concatenate(parts, axis=axis)


def scaled(ranges: list[tuple[int, int]], declared: int, stored: int,
           what: str) -> list[tuple[int, int]]:
    """Ranges over a layer's own axis length moved to a stored tensor's (a quantized
    tensor packs its last axis: 8 4-bit values per uint32, a scale per group)."""
    if declared == stored:
        return ranges
    out = []
    for start, stop in ranges:
        if (start * stored) % declared or (stop * stored) % declared:
            raise ValueError(f"{what}: its slice does not fall on the packed tensor's "
                             f"boundaries ({declared} features stored in {stored})")
        out.append((start * stored // declared, stop * stored // declared))
    return out
