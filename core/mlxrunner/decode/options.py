"""Sampling options: names, Ollama's defaults, validation, layering.

Plain Python (no MLX), so the CLI can build its flags from them without importing MLX.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

from ..errors import MLXRunnerError


class SamplerOptionError(MLXRunnerError, ValueError):
    """A sampling option with a bad value (one clear line)."""


OPTION_HELP: dict[str, str] = {
    "temperature": "softmax temperature; 0 or less is greedy (argmax)",
    "top_k": "keep only the k most likely tokens (0: all)",
    "top_p": "keep the smallest set of likeliest tokens whose mass reaches p (1: all)",
    "min_p": "drop tokens less likely than min_p times the likeliest (0: off)",
    "repeat_last_n": "how many recent tokens the penalties look at (0: off, -1: all)",
    "repeat_penalty": "divide positive / multiply negative logits of recent tokens (1: off)",
    "presence_penalty": "subtract from the logit of each token seen recently (0: off)",
    "frequency_penalty": "subtract this times the recent count of each token (0: off)",
    "seed": "seed for reproducible sampling (unset: random)",
    "logprobs": "report the log-probability of each chosen token",
    "top_logprobs": "also report this many most likely tokens per step",
}

# generation_config.json names that differ from ours
_ALIASES = {"repetition_penalty": "repeat_penalty"}


def _as_float(name: str, value: Any) -> float:
    if isinstance(value, bool):
        raise SamplerOptionError(f"sampling option {name} must be a number, got {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise SamplerOptionError(
            f"sampling option {name} must be a number, got {value!r}"
        ) from None
    if not math.isfinite(number):
        raise SamplerOptionError(f"sampling option {name} must be finite, got {value!r}")
    return number


def _as_int(name: str, value: Any) -> int:
    if isinstance(value, bool):
        raise SamplerOptionError(f"sampling option {name} must be an integer, got {value!r}")
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            pass
    raise SamplerOptionError(f"sampling option {name} must be an integer, got {value!r}")


def _as_bool(name: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in ("true", "false", "1", "0"):
        return value.strip().lower() in ("true", "1")
    raise SamplerOptionError(f"sampling option {name} must be true or false, got {value!r}")


def _check_range(name: str, value: float, low: float, high: float | None = None) -> None:
    if value < low or (high is not None and value > high):
        bound = f"between {low} and {high}" if high is not None else f"at least {low}"
        raise SamplerOptionError(f"sampling option {name} must be {bound}, got {value}")


@dataclass(frozen=True)
class SamplerOptions:
    """Sampling options with Ollama's defaults. See ``OPTION_HELP`` for each one."""

    temperature: float = 0.8
    top_k: int = 40
    top_p: float = 0.9
    min_p: float = 0.0
    repeat_last_n: int = 64
    repeat_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0

    def __post_init__(self) -> None:
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        if values["seed"] is None:
            del values["seed"]
        for name, value in _validated(values).items():
            object.__setattr__(self, name, value)  # normalised: 1 -> 1.0, -2 -> 0.0

    @classmethod
    def from_mapping(cls, mapping: Mapping[str, Any]) -> SamplerOptions:
        """Defaults overridden by ``mapping``: our option names or generation_config.json keys.

        ``do_sample: false`` means temperature 0; ``repetition_penalty`` is
        ``repeat_penalty``. Unknown keys and None values are ignored; a bad value
        raises :class:`SamplerOptionError` (a ``ValueError``).
        """
        return cls().merged(mapping)

    def merged(self, overrides: Mapping[str, Any]) -> SamplerOptions:
        """A copy with ``overrides`` applied (later layers win); None values are ignored.

        Layers, in order: generation_config.json, Modelfile PARAMETERs, request.
        """
        known = {f.name for f in fields(self)}
        changes: dict[str, Any] = {}
        for key, value in overrides.items():
            name = _ALIASES.get(key, key)
            if value is None or name not in known:
                continue
            changes[name] = value
        if "do_sample" in overrides and overrides["do_sample"] is not None:
            if not _as_bool("do_sample", overrides["do_sample"]):
                changes["temperature"] = 0.0
        return replace(self, **_validated(changes))

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


def _validated(changes: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in changes.items():
        if name in ("temperature", "top_p", "min_p", "repeat_penalty"):
            number = _as_float(name, value)
            if name == "temperature":
                number = max(number, 0.0)  # any temperature <= 0 means greedy
            elif name in ("top_p", "min_p"):
                _check_range(name, number, 0.0, 1.0)
            elif number <= 0:
                raise SamplerOptionError(f"sampling option {name} must be > 0, got {number}")
            out[name] = number
        elif name in ("presence_penalty", "frequency_penalty"):
            out[name] = _as_float(name, value)
        elif name in ("top_k", "top_logprobs"):
            number = _as_int(name, value)
            _check_range(name, number, 0)
            out[name] = number
        elif name == "repeat_last_n":
            number = _as_int(name, value)
            _check_range(name, number, -1)
            out[name] = number
        elif name == "seed":
            out[name] = _as_int(name, value)
        elif name == "logprobs":
            out[name] = _as_bool(name, value)
    return out
