'''Reading a Modelfile: the subset of Ollama's syntax that applies to mlxrunner.

Instructions (case-insensitive), one per line; blank lines and lines starting
with ``#`` are skipped::

    FROM ./model            # model folder (relative: to the Modelfile's folder) or name
    DRAFT ./draft           # draft model folder
    RENDERER gemma4         # chat-format renderer name
    PARSER gemma4           # output parser name
    PARAMETER temperature 0.7
    PARAMETER stop "<|im_end|>"   # stop may repeat; it collects into a list
    SYSTEM You are terse.   # or "quoted", or """multi
                            # line""" (as in Ollama, quotes may span lines)

Values are the rest of the line, trimmed; a value that starts with ``"`` or
``"""`` runs to the line that ends with the same quote, and the text between
the quotes is kept exactly. A PARAMETER value is typed as Ollama types it
(int, float, bool; ``stop`` a list of strings); a repeated PARAMETER other
than ``stop`` keeps the last value, as Ollama does. Every problem raises
:class:`~mlxrunner.errors.ModelfileError` as ``"<file>:<line>: <problem>"``.
'''

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field, replace
from os import PathLike
from pathlib import Path
from typing import Any

from ..errors import ModelfileError
from ..files import NotRegularFile, read_regular

__all__ = ["Modelfile", "read_modelfile", "parse_modelfile", "inherit_modelfile",
           "PARAMETER_TYPES"]

#: PARAMETER names mlxrunner accepts and the type each value is read as.
PARAMETER_TYPES: dict[str, type] = {
    "temperature": float,
    "top_k": int,
    "top_p": float,
    "min_p": float,
    "repeat_last_n": int,
    "repeat_penalty": float,
    "presence_penalty": float,
    "frequency_penalty": float,
    "seed": int,
    "num_predict": int,
    "stop": list,
    "num_ctx": int,
}

#: a Modelfile is a few lines; one this large is not one
MAX_MODELFILE_BYTES = 1 << 20
_SUPPORTED = ("FROM", "DRAFT", "RENDERER", "PARSER", "PARAMETER", "SYSTEM")
# Ollama instructions that mean nothing here: named in the error so users know why.
_OLLAMA_ONLY = {
    "TEMPLATE": "use RENDERER, or the folder's chat template",
    "ADAPTER": "LoRA adapters are not supported",
    "LICENSE": "licenses are not read",
    "MESSAGE": "put example messages in the conversation instead",
    "REQUIRES": "there is no version requirement",
}

_INSTRUCTION = re.compile(r"([A-Za-z]+)(?:[ \t]+|$)")
_PARAMETER_NAME = re.compile(r"([A-Za-z0-9_]+)(?:[ \t]+|$)")
# Go's strconv.ParseInt(s, 10, 64) and ParseFloat(s, 32), which Ollama uses.
_INT = re.compile(r"[+-]?[0-9]+")
_FLOAT = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")
_BOOLS = {
    "1": True, "t": True, "T": True, "true": True, "TRUE": True, "True": True,
    "0": False, "f": False, "F": False, "false": False, "FALSE": False, "False": False,
}  # fmt: skip


@dataclass(frozen=True)
class Modelfile:
    """What a Modelfile says. Unset instructions are None; ``parameters`` holds
    typed PARAMETER values (``stop`` as a list)."""

    path: Path | None = None
    from_: str | None = None
    #: FROM resolved against the Modelfile's folder (``~`` expanded); None without FROM
    from_path: Path | None = None
    draft: str | None = None
    #: DRAFT resolved like ``from_path``
    draft_path: Path | None = None
    renderer: str | None = None
    parser: str | None = None
    parameters: dict[str, Any] = field(default_factory=dict)
    system: str | None = None


def inherit_modelfile(own: Modelfile, base: Modelfile) -> Modelfile:
    """``own`` over ``base`` (the Modelfile of the folder ``own`` names in FROM): what
    ``own`` leaves unset comes from ``base``, each PARAMETER on its own; FROM is ``base``'s,
    the folder the weights are in."""
    draft, draft_path = own.draft, own.draft_path
    if draft is None and base.draft is not None:
        # resolved against base's folder, not own's
        draft = str(base.draft_path) if base.draft_path is not None else base.draft
        draft_path = base.draft_path
    return replace(
        own, from_=base.from_, from_path=base.from_path, draft=draft, draft_path=draft_path,
        renderer=own.renderer if own.renderer is not None else base.renderer,
        parser=own.parser if own.parser is not None else base.parser,
        parameters={**base.parameters, **own.parameters},
        system=own.system if own.system is not None else base.system)


def read_modelfile(path: str | PathLike[str]) -> Modelfile:
    """Read and check the Modelfile at ``path``."""
    path = Path(path)
    try:
        data = read_regular(path, MAX_MODELFILE_BYTES)  # (a FIFO, a device: never read)
    except NotRegularFile:
        raise ModelfileError(f"{path}: not a regular file") from None
    except FileNotFoundError:
        raise ModelfileError(f"{path}: no such file") from None
    except OSError as err:
        raise ModelfileError(f"{path}: cannot be read ({err.strerror or err})") from None
    if len(data) > MAX_MODELFILE_BYTES:
        raise ModelfileError(f"{path}: larger than {MAX_MODELFILE_BYTES} bytes")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise ModelfileError(f"{path}:{line}: not UTF-8 text") from None
    return parse_modelfile(text, path=path)


def _resolve(raw: str, base: Path) -> Path:
    candidate = Path(raw).expanduser()
    if not candidate.is_absolute():
        candidate = base / candidate
    return Path(str(candidate.absolute()))


def _quoted_value(lines: list[str], start: int, first: str) -> tuple[str, int]:
    '''A value that opens with ``"""`` or ``"``: find the line whose end closes it.

    Returns the text between the quotes and the index of the closing line.
    ``first`` is the (left-trimmed) value text on line ``start``.
    '''
    quote = '"""' if first.startswith('"""') else '"'
    collected = first
    index = start
    while True:
        trimmed = collected.rstrip(" \t")
        if len(trimmed) >= 2 * len(quote) and trimmed.endswith(quote):
            return trimmed[len(quote) : -len(quote)], index
        index += 1
        if index >= len(lines):
            kind = "triple-quoted" if quote == '"""' else "quoted"
            raise _QuoteError(f"unterminated {kind} value (no closing {quote})")
        collected += "\n" + lines[index]


class _QuoteError(Exception):
    pass


def _typed_parameter(name: str, value: str) -> Any:
    kind = PARAMETER_TYPES[name]
    if kind is int:
        if not _INT.fullmatch(value):
            raise ValueError(f"PARAMETER {name} needs an integer, got {value!r}")
        return int(value)
    if kind is float:
        if not _FLOAT.fullmatch(value):
            raise ValueError(f"PARAMETER {name} needs a number, got {value!r}")
        number = float(value)
        if not math.isfinite(number):
            raise ValueError(f"PARAMETER {name} needs a finite number, got {value!r}")
        return number
    if kind is bool:
        if value not in _BOOLS:
            raise ValueError(f"PARAMETER {name} needs true or false, got {value!r}")
        return _BOOLS[value]
    if not value:
        raise ValueError(f"PARAMETER {name} needs a non-empty string")
    return value


def parse_modelfile(
    text: str,
    *,
    path: str | PathLike[str] | None = None,
    base_dir: str | PathLike[str] | None = None,
) -> Modelfile:
    """Parse Modelfile text. ``path`` names it in errors; relative FROM/DRAFT
    resolve against ``base_dir`` (default: ``path``'s folder, else the current folder)."""
    where = str(path) if path is not None else "<Modelfile>"
    base = (
        Path(base_dir)
        if base_dir is not None
        else (Path(path).parent if path is not None else Path.cwd())
    )
    lines = [line[:-1] if line.endswith("\r") else line for line in text.split("\n")]

    single: dict[str, tuple[str, int]] = {}  # instruction -> (value, line number)
    parameters: dict[str, Any] = {}
    index = 0
    while index < len(lines):
        line_no = index + 1
        # Trailing blanks stay: they belong to a quoted value that continues.
        stripped = lines[index].lstrip(" \t")
        if not stripped.rstrip(" \t") or stripped.startswith("#"):
            index += 1
            continue

        def fail(problem: str, at: int = line_no) -> ModelfileError:
            return ModelfileError(f"{where}:{at}: {problem}")

        match = _INSTRUCTION.match(stripped)
        if match is None:
            word = stripped.split(None, 1)[0]
            raise fail(f"expected an instruction ({', '.join(_SUPPORTED)}), got {word!r}")
        instruction = match.group(1).upper()
        rest = stripped[match.end() :]
        if instruction in _OLLAMA_ONLY:
            raise fail(f"{instruction} is not supported by mlxrunner ({_OLLAMA_ONLY[instruction]})")
        if instruction not in _SUPPORTED:
            raise fail(
                f"unknown instruction {match.group(1)!r} (supported: {', '.join(_SUPPORTED)})"
            )

        name = None
        if instruction == "PARAMETER":
            name_match = _PARAMETER_NAME.match(rest)
            if not rest.rstrip(" \t"):
                raise fail("PARAMETER needs a name and a value")
            if name_match is None:
                raise fail(f"PARAMETER name must be letters, digits and _, got {rest.split()[0]!r}")
            name = name_match.group(1).lower()
            rest = rest[name_match.end() :]
            if name not in PARAMETER_TYPES:
                raise fail(
                    f"unknown PARAMETER {name_match.group(1)!r} "
                    f"(known: {', '.join(sorted(PARAMETER_TYPES))})"
                )

        if not rest.rstrip(" \t"):
            what = f"PARAMETER {name}" if name else instruction
            raise fail(f"{what} needs a value")
        end = index
        if rest.startswith('"'):
            try:
                value, end = _quoted_value(lines, index, rest)
            except _QuoteError as err:
                raise fail(str(err)) from None
        else:
            value = rest.rstrip(" \t")

        if name is not None:
            try:
                typed = _typed_parameter(name, value)
            except ValueError as err:
                raise fail(str(err)) from None
            if name == "stop":
                parameters.setdefault("stop", []).append(typed)
            else:
                parameters[name] = typed
        else:
            if instruction in single:
                raise fail(f"{instruction} given twice (first on line {single[instruction][1]})")
            if instruction != "SYSTEM" and not value.strip():
                raise fail(f"{instruction} needs a value")
            single[instruction] = (value, line_no)
        index = end + 1

    def get(instruction: str) -> str | None:
        entry = single.get(instruction)
        return entry[0] if entry else None

    from_, draft = get("FROM"), get("DRAFT")
    return Modelfile(
        path=Path(path) if path is not None else None,
        from_=from_,
        from_path=_resolve(from_, base) if from_ is not None else None,
        draft=draft,
        draft_path=_resolve(draft, base) if draft is not None else None,
        renderer=get("RENDERER"),
        parser=get("PARSER"),
        parameters=parameters,
        system=get("SYSTEM"),
    )
