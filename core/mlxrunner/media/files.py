"""Reading one media file the user names, bounded: a regular file only, at most a limit of
bytes read."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from ..errors import MediaError


def read_media_file(path: str | os.PathLike[str], max_bytes: int, kind: str) -> bytes:
    """The bytes of the ``kind`` (image, audio) file ``path``: at most ``max_bytes`` are
    read, from a regular file only (a FIFO or device is refused unread); each failure one
    :class:`MediaError` line naming the file."""
    where = Path(path)
    try:
        if not stat.S_ISREG(where.stat().st_mode):
            raise MediaError(f"{where}: not a regular file")
        # opened without blocking and checked again: a FIFO swapped in since is refused
        descriptor = os.open(where, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
        with os.fdopen(descriptor, "rb") as handle:
            if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
                raise MediaError(f"{where}: not a regular file")
            data = handle.read(max_bytes + 1)
    except FileNotFoundError:
        raise MediaError(f"{where}: no such {kind} file") from None
    except OSError as exc:
        raise MediaError(f"{where}: cannot be read ({exc.strerror or exc})") from None
    if len(data) > max_bytes:
        raise MediaError(f"{where}: larger than the limit of {max_bytes} bytes")
    return data
