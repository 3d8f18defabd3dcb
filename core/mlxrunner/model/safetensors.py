"""Cheap structural checks of safetensors files before MLX maps them.

A truncated or corrupt file must become one clear line, not a crash deep in a
loader: read the header, check that every tensor's byte range lies inside the
file.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

from ..errors import ModelFolderError

_MAX_HEADER = 100 * 1024 * 1024


def check_safetensors(path: Path) -> list[str]:
    """Validate ``path`` and return its tensor names (raises ModelFolderError)."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ModelFolderError(f"{path}: not a safetensors file (truncated header)")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER or 8 + n > size:
                raise ModelFolderError(f"{path}: corrupt or truncated safetensors header")
            header = json.loads(f.read(n))
    except OSError as exc:
        raise ModelFolderError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise ModelFolderError(f"{path}: corrupt safetensors header (not JSON)") from None
    if not isinstance(header, dict):
        raise ModelFolderError(f"{path}: corrupt safetensors header")
    data_size = size - 8 - n
    names = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            start, end = info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ModelFolderError(f"{path}: corrupt entry for tensor {name!r}") from None
        if not (0 <= start <= end <= data_size):
            raise ModelFolderError(
                f"{path}: truncated: tensor {name!r} needs bytes up to {end}, "
                f"file holds {data_size}")
        names.append(name)
    return names
