"""Structural checks of safetensors files before MLX maps them.

A model folder is untrusted: a truncated, corrupt or crafted file must become one clear
line naming it, not a crash deep in a loader or tensors read from each other's bytes. The
header is read here (8-byte little-endian length, a bounded JSON object), and the tensors'
byte ranges must tile the data region exactly, as the reference implementation requires:
each range as long as its dtype and shape say, no overlap, no gap, nothing past the end.
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path
from typing import Any

from ..errors import ModelFolderError

_MAX_HEADER = 100 * 1024 * 1024

#: bytes per element of the dtypes MLX loads
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "U16": 2, "I16": 2, "F16": 2, "BF16": 2,
               "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8, "C64": 8}


def _read_header(path: Path) -> tuple[dict[str, Any], int]:
    """The header object and the size of the data region after it."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ModelFolderError(f"{path}: not a safetensors file (truncated header)")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER:
                raise ModelFolderError(f"{path}: corrupt safetensors header (declares "
                                       f"{n} bytes, the limit is {_MAX_HEADER})")
            if 8 + n > size:
                raise ModelFolderError(f"{path}: corrupt or truncated safetensors header")
            header = json.loads(f.read(n))
    except OSError as exc:
        raise ModelFolderError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError):
        raise ModelFolderError(f"{path}: corrupt safetensors header (not JSON)") from None
    if not isinstance(header, dict):
        raise ModelFolderError(f"{path}: corrupt safetensors header (not a JSON object)")
    return header, size - 8 - n


def _tensor_range(path: Path, name: str, info: Any) -> tuple[int, int]:
    """A header entry's byte range, checked against its dtype and shape."""
    try:
        dtype, shape, (start, end) = info["dtype"], info["shape"], info["data_offsets"]
    except (KeyError, TypeError, ValueError):
        raise ModelFolderError(f"{path}: corrupt entry for tensor {name!r}") from None
    if dtype not in DTYPE_BYTES:
        raise ModelFolderError(f"{path}: tensor {name!r} has unsupported dtype {dtype!r:.40}")
    if (not isinstance(shape, list)
            or not all(type(d) is int and d >= 0 for d in shape)
            or not all(type(o) is int for o in (start, end)) or not 0 <= start <= end):
        raise ModelFolderError(f"{path}: corrupt entry for tensor {name!r}")
    expected = math.prod(shape) * DTYPE_BYTES[dtype]
    if end - start != expected:
        raise ModelFolderError(f"{path}: tensor {name!r} ({dtype} {shape}) needs {expected} "
                               f"bytes, its range holds {end - start}")
    return start, end


def check_safetensors(path: Path) -> list[str]:
    """Validate ``path`` and return its tensor names (raises ModelFolderError)."""
    header, data_size = _read_header(path)
    ranges = sorted((_tensor_range(path, name, info), name)
                    for name, info in header.items() if name != "__metadata__")
    covered = 0
    for (start, end), name in ranges:
        if end > data_size:
            raise ModelFolderError(
                f"{path}: truncated: tensor {name!r} needs bytes up to {end}, "
                f"file holds {data_size}")
        if start < covered:
            raise ModelFolderError(f"{path}: tensor {name!r} overlaps another tensor's bytes")
        if start > covered:
            raise ModelFolderError(f"{path}: {start - covered} bytes before tensor {name!r} "
                                   "belong to no tensor")
        covered = end
    if covered != data_size:
        raise ModelFolderError(f"{path}: {data_size - covered} bytes after the last tensor "
                               "belong to no tensor")
    return [name for _, name in ranges]


#: MLX's names of the float dtypes a safetensors header names
FLOAT_DTYPES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64"}


def stored_dtypes(path: Path) -> dict[str, str]:
    """Each tensor's dtype as ``path`` stores it (``BF16``, ``U32`` ...), read from the header."""
    header, _ = _read_header(path)
    return {name: str(info.get("dtype")) for name, info in header.items()
            if name != "__metadata__" and isinstance(info, dict)}
