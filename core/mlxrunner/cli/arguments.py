"""Argument types the commands share: a usage error is one line naming the flag."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


def count(minimum: int) -> Callable[[str], int]:
    """An argparse type: a whole number of at least ``minimum``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = minimum - 1
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number >= {minimum}")
        return value
    return parse


def at_least(minimum: float) -> Callable[[str], float]:
    """An argparse type: a finite number of at least ``minimum``."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = float("nan")
        if not minimum <= value < float("inf"):
            raise argparse.ArgumentTypeError(f"{text!r} is not a number >= {minimum:g}")
        return value
    return parse


def port(text: str) -> int:
    """An argparse type: a TCP port (0: any free one)."""
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (0-65535)")
    return port


def output_format(text: str) -> Any:
    """An argparse type: ``json`` (any JSON object) or a JSON Schema file (its object)."""
    if text == "json":
        return text
    path = Path(text)
    try:
        schema = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither 'json' nor a schema file "
                                         "that exists") from None
    except (OSError, UnicodeDecodeError) as err:
        raise argparse.ArgumentTypeError(f"{text!r} cannot be read ({err})") from None
    except json.JSONDecodeError as err:
        raise argparse.ArgumentTypeError(f"{text!r} is not JSON ({err.msg} at line "
                                         f"{err.lineno} column {err.colno})") from None
    if not isinstance(schema, dict):
        raise argparse.ArgumentTypeError(f"{text!r} holds a {type(schema).__name__}, not a "
                                         "JSON Schema object")
    return schema
