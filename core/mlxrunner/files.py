"""Reading a file bounded: a regular file only, at most a limit of bytes read (what a model
folder's files, a Modelfile and a media file the user names are read through). Plain
Python: a Modelfile is read without MLX."""

from __future__ import annotations

import os
import stat
from pathlib import Path


class NotRegularFile(OSError):
    """The path names a FIFO, a device or a folder: it is never read."""


def read_regular(path: str | os.PathLike[str], limit: int) -> bytes:
    """At most ``limit + 1`` bytes of the regular file ``path`` (more than ``limit`` is the
    caller's to refuse). A FIFO or device is refused unread (:class:`NotRegularFile`): it
    is opened without blocking and checked again, so one swapped in since the first check
    is refused too. A missing file is FileNotFoundError, other failures OSError."""
    if not stat.S_ISREG(Path(path).stat().st_mode):
        raise NotRegularFile(f"{path}: not a regular file")
    descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    with os.fdopen(descriptor, "rb") as handle:
        if not stat.S_ISREG(os.fstat(handle.fileno()).st_mode):
            raise NotRegularFile(f"{path}: not a regular file")
        return handle.read(limit + 1)
