"""Bounds on config.json values, checked before a model or draft is built.

A model folder is untrusted: ``vocab_size: 10**12``, ``num_attention_heads: 0`` or
``rope_theta: "abc"`` must be one ModelFolderError line naming the key and its bound, before
any module or array exists. :func:`check_config` checks the keys Hugging Face architectures
share (:data:`STANDARD_BOUNDS`, also inside ``rope_parameters`` / ``rope_scaling``) and those
the class declares in its ``config_bounds`` and ``config_multiples`` attributes. Keys that
are absent or null are left to the architecture's defaults.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..errors import ModelFolderError


@dataclass(frozen=True)
class ConfigBound:
    """What one config value may be: ``kind`` (int, float or bool) from ``low`` to ``high``
    (inclusive; ``above_low`` makes ``low`` exclusive); ``per_layer`` also allows a list of
    such values."""

    kind: type
    low: float | None = None
    high: float | None = None
    above_low: bool = False
    per_layer: bool = False

    def describe(self) -> str:
        what = {int: "an integer", float: "a number", bool: "a boolean"}[self.kind]
        low, high = _number(self.low), _number(self.high)
        if self.low is not None and self.high is not None:
            lowest = f"above {low}" if self.above_low else f"from {low}"
            to = "and at most" if self.above_low else "to"
            return f"{what} {lowest} {to} {high}"
        if self.low is not None:
            return f"{what} {'above' if self.above_low else 'at least'} {low}"
        if self.high is not None:
            return f"{what} at most {high}"
        return what


def _number(value: float | None) -> str:
    if value is not None and float(value).is_integer() and abs(value) < 1e16:
        return str(int(value))
    return f"{value:g}" if value is not None else ""


@dataclass(frozen=True)
class ConfigMultiple:
    """``config[key]`` must be a multiple of ``config[of]`` (when both are given, and
    ``unless`` names a key that is absent or null)."""

    key: str
    of: str
    unless: str | None = None


def _ints(low: int, high: int, per_layer: bool = False) -> ConfigBound:
    return ConfigBound(int, low, high, per_layer=per_layer)


def _positive(high: float) -> ConfigBound:
    return ConfigBound(float, 0, high, above_low=True)


_FLAG = ConfigBound(bool)
_COUNT = _ints(1, 1024)
_WIDTH = _ints(1, 2**20, per_layer=True)
_LENGTH = _ints(0, 2**26)

#: Keys every architecture reads the same way, bounded far above any published model.
STANDARD_BOUNDS: Mapping[str, ConfigBound] = {
    "vocab_size": _ints(1, 2**24),
    "hidden_size": _ints(1, 2**17),
    "intermediate_size": _WIDTH,
    "moe_intermediate_size": _ints(0, 2**20),
    "shared_expert_intermediate_size": _ints(0, 2**20),
    "num_hidden_layers": _COUNT,
    "num_attention_heads": _COUNT,
    "num_key_value_heads": _COUNT,
    "head_dim": _ints(1, 8192),
    "num_experts": _ints(0, 2**14),
    "num_local_experts": _ints(0, 2**14),
    "num_experts_per_tok": _ints(0, 2**14),
    "max_position_embeddings": _LENGTH,
    "original_max_position_embeddings": _LENGTH,
    "sliding_window": _LENGTH,
    "rope_theta": _positive(1e15),
    "partial_rotary_factor": _positive(1),
    "factor": _positive(1e6),
    "rms_norm_eps": _positive(1),
    "layer_norm_eps": _positive(1),
    "tie_word_embeddings": _FLAG,
    "attention_bias": _FLAG,
    "mlp_bias": _FLAG,
}

STANDARD_MULTIPLES: tuple[ConfigMultiple, ...] = (
    ConfigMultiple("num_attention_heads", "num_key_value_heads"),
    # without head_dim, the heads split hidden_size evenly (transformers' default)
    ConfigMultiple("hidden_size", "num_attention_heads", unless="head_dim"),
)

_NESTED_SECTIONS = ("rope_parameters", "rope_scaling")


def _fits(value: Any, bound: ConfigBound) -> bool:
    if bound.kind is bool:
        return isinstance(value, bool) or (type(value) is int and value in (0, 1))
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if isinstance(value, float) and not math.isfinite(value):
        return False
    if bound.kind is int and isinstance(value, float) and not value.is_integer():
        return False
    if bound.low is not None and (value <= bound.low if bound.above_low else value < bound.low):
        return False
    return bound.high is None or value <= bound.high


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def check_value(where: str, key: str, value: Any, bound: ConfigBound) -> None:
    """One value against its bound (a list element by element when ``per_layer``)."""
    values = value if bound.per_layer and isinstance(value, list) else [value]
    if bound.per_layer and len(values) > 2 ** 16:
        raise ModelFolderError(f"{where}: {key} lists {len(values)} entries")
    for item in values:
        if not _fits(item, bound):
            raise ModelFolderError(f"{where}: {key} must be {bound.describe()}, "
                                   f"got {_shown(item)}")


def _sections(config: Mapping[str, Any]) -> Iterable[tuple[str, Mapping[str, Any]]]:
    yield "", config
    for name in _NESTED_SECTIONS:
        section = config.get(name)
        if not isinstance(section, Mapping):
            continue
        yield f"{name}.", section
        for inner_name, inner in section.items():  # per layer type (Gemma 4)
            if isinstance(inner, Mapping):
                yield f"{name}.{inner_name}.", inner


def check_config(config: Mapping[str, Any], cls: type | None = None,
                 where: str = "config.json") -> None:
    """Raise ModelFolderError for the first value of ``config`` outside its bound: the
    standard ones and those ``cls`` declares (``config_bounds``, ``config_multiples``)."""
    bounds = {**STANDARD_BOUNDS, **getattr(cls, "config_bounds", {})}
    for prefix, section in _sections(config):
        for key, bound in bounds.items():
            value = section.get(key)
            if value is not None:
                check_value(where, prefix + key, value, bound)
    for rule in (*STANDARD_MULTIPLES, *getattr(cls, "config_multiples", ())):
        value, of = config.get(rule.key), config.get(rule.of)
        if rule.unless is not None and config.get(rule.unless) is not None:
            continue
        if type(value) is int and type(of) is int and of > 0 and value % of:
            raise ModelFolderError(f"{where}: {rule.key} ({value}) must be a multiple of "
                                   f"{rule.of} ({of})")
