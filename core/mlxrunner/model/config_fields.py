"""An architecture's config.json fields, each declared once with its bounds.

A subclass of :class:`ConfigFields` is a frozen dataclass whose fields are the config keys
the architecture reads; :func:`config_field` gives one its default and bounds.
``from_config`` reads them from a parsed config.json: a missing required key, a value of
the wrong kind or out of its bounds is one :class:`~mlxrunner.errors.ModelFolderError`
line naming the key (the folder is untrusted); keys it does not declare are ignored::

    class MyConfig(ConfigFields):
        vocab_size: int = config_field(low=1, high=2**24)
        num_key_value_heads: int | None = config_field(None, low=1, high=1024)
        rms_norm_eps: float = config_field(1e-6, low=0, above_low=True, high=1)
        tie_word_embeddings: bool = config_field(False)

    cfg = MyConfig.from_config(config)   # in Model.__init__
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any, TypeVar

from typing_extensions import dataclass_transform

from ..errors import ModelFolderError
from .config_bounds import ConfigBound, check_value

_SPEC = "mlxrunner.config_field"
_KINDS = (bool, int, float, str)

C = TypeVar("C", bound="ConfigFields")


@dataclasses.dataclass(frozen=True)
class _FieldSpec:
    key: str | None
    low: float | None
    high: float | None
    above_low: bool
    per_layer: bool


def config_field(default: Any = dataclasses.MISSING, *, low: float | None = None,
                 high: float | None = None, above_low: bool = False, per_layer: bool = False,
                 key: str | None = None) -> Any:
    """A config.json field: ``default`` when the key is absent or null (none: required),
    bounds ``low`` to ``high`` inclusive (``above_low``: ``low`` exclusive), ``per_layer``
    also allows a list of such values (one per layer), ``key`` the config key when it is
    not the field's name. The field's annotation (``int``, ``float``, ``bool``, ``str``,
    optionally ``| None``) is the kind the value must be."""
    return dataclasses.field(default=default, metadata={
        _SPEC: _FieldSpec(key, low, high, above_low, per_layer)})


@dataclass_transform(field_specifiers=(config_field,), frozen_default=True)
class ConfigFields:
    """Base of an architecture's config dataclass (see the module)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        dataclasses.dataclass(frozen=True)(cls)

    @classmethod
    def from_config(cls: type[C], config: Mapping[str, Any], where: str = "config.json") -> C:
        """The declared fields read from ``config`` (see the module)."""
        kinds = typing.get_type_hints(cls)
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]  # (a dataclass: see above)
            spec = f.metadata.get(_SPEC)
            if spec is None:
                continue  # (a field the subclass fills itself)
            key = spec.key or f.name
            value = config.get(key)
            if value is None:
                if f.default is dataclasses.MISSING and \
                        f.default_factory is dataclasses.MISSING:
                    raise ModelFolderError(f"{where} lacks {key!r}, which {cls.__name__} "
                                           "needs")
                continue
            values[f.name] = _checked(where, key, value, _kind(kinds.get(f.name)), spec)
        return cls(**values)

    @classmethod
    def bounds(cls) -> dict[str, ConfigBound]:
        """The declared bounds by config key (for ``Model.config_bounds``)."""
        kinds = typing.get_type_hints(cls)
        found = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            spec, kind = f.metadata.get(_SPEC), _kind(kinds.get(f.name))
            if spec is not None and kind in (bool, int, float):
                found[spec.key or f.name] = _bound(kind, spec)
        return found


def _kind(annotation: Any) -> type | None:
    """``int`` of ``int``, ``int | None`` and ``Optional[int]``; None for other types."""
    if annotation in _KINDS:
        return typing.cast(type, annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        kinds = [a for a in typing.get_args(annotation) if a is not type(None)]
        if len(kinds) == 1 and kinds[0] in _KINDS:
            return typing.cast(type, kinds[0])
    return None


def _bound(kind: type, spec: _FieldSpec) -> ConfigBound:
    return ConfigBound(kind, spec.low, spec.high, spec.above_low, spec.per_layer)


def _checked(where: str, key: str, value: Any, kind: type | None, spec: _FieldSpec) -> Any:
    if kind is str:
        if not isinstance(value, str) or len(value) > 4096:
            raise ModelFolderError(f"{where}: {key} must be a string, got "
                                   f"{type(value).__name__}")
        return value
    if kind is None:  # (a structure the architecture checks itself)
        return value
    check_value(where, key, value, _bound(kind, spec))
    if spec.per_layer and isinstance(value, list):
        return tuple(kind(v) for v in value)
    return kind(value)
