"""Reading one media file the user names, bounded (:func:`mlxrunner.files.read_regular`)."""

from __future__ import annotations

import os
from pathlib import Path

from ..errors import MediaError
from ..files import NotRegularFile, read_regular


def read_media_file(path: str | os.PathLike[str], max_bytes: int, kind: str) -> bytes:
    """The bytes of the ``kind`` (image, audio) file ``path``: at most ``max_bytes`` are
    read, from a regular file only (a FIFO or device is refused unread); each failure one
    :class:`MediaError` line naming the file."""
    where = Path(path)
    try:
        data = read_regular(where, max_bytes)
    except NotRegularFile:
        raise MediaError(f"{where}: not a regular file") from None
    except FileNotFoundError:
        raise MediaError(f"{where}: no such {kind} file") from None
    except OSError as exc:
        raise MediaError(f"{where}: cannot be read ({exc.strerror or exc})") from None
    if len(data) > max_bytes:
        raise MediaError(f"{where}: larger than the limit of {max_bytes} bytes")
    return data
