"""The reply as the CLI streams it on stdout, and whether its last line is still open: an
error printed on stderr mid-reply then starts a line of its own where both streams go to one
terminal."""

from __future__ import annotations

import re
import sys

_line_open = False
_TRAILING_CODES = re.compile(r"(\x1b\[[0-9;]*m)+$")


def write(piece: str) -> None:
    """Show ``piece`` of a reply now (a reply streams: each piece shows as it comes)."""
    global _line_open
    if piece:
        sys.stdout.write(piece)
        sys.stdout.flush()
        # (a coloured line ends with its reset code after the newline)
        visible = _TRAILING_CODES.sub("", piece)
        if visible:
            _line_open = not visible.endswith("\n")


def end_line() -> None:
    """End the reply's open line, if any, before something else is printed."""
    global _line_open
    if _line_open:
        _line_open = False
        try:
            sys.stdout.write("\n")
            sys.stdout.flush()
        except (OSError, ValueError):  # a closed or broken stdout: nothing to end
            pass
