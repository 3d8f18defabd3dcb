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

    #: each config field's kind (int, float, bool, str; None: not checked), by field name
    _config_kinds: typing.ClassVar[dict[str, type | None]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        dataclasses.dataclass(frozen=True)(cls)
        # the annotations resolved now, so that a plugin's mistake fails at its import
        try:
            hints = typing.get_type_hints(cls)
        except (NameError, TypeError) as exc:
            raise TypeError(f"{cls.__name__}: a field's annotation cannot be resolved at "
                            f"run time ({exc})") from None
        kinds: dict[str, type | None] = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]  # (a dataclass: above)
            spec = f.metadata.get(_SPEC)
            if spec is None:
                continue
            kind = _kind(hints.get(f.name), spec.per_layer)
            bounded = spec.low is not None or spec.high is not None or spec.per_layer
            if bounded and kind not in (int, float):
                raise TypeError(f"{cls.__name__}.{f.name}: bounds need an int or float "
                                f"annotation, got {hints.get(f.name)!r}")
            kinds[f.name] = kind
        cls._config_kinds = kinds

    @classmethod
    def from_config(cls: type[C], config: Mapping[str, Any], where: str = "config.json") -> C:
        """The declared fields read from ``config`` (see the module)."""
        kinds = cls._config_kinds
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
            values[f.name] = _checked(where, key, value, kinds.get(f.name), spec)
        return cls(**values)

    @classmethod
    def bounds(cls) -> dict[str, ConfigBound]:
        """The declared bounds by config key (for ``Model.config_bounds``)."""
        found = {}
        for f in dataclasses.fields(cls):  # type: ignore[arg-type]
            spec, kind = f.metadata.get(_SPEC), cls._config_kinds.get(f.name)
            if spec is not None and kind in (bool, int, float):
                found[spec.key or f.name] = _bound(kind, spec)
        return found


def _kind(annotation: Any, per_layer: bool = False) -> type | None:
    """``int`` of ``int``, ``int | None`` and ``Optional[int]`` (per layer also of ``int |
    tuple[int, ...]``); None for other types."""
    if annotation in _KINDS:
        return typing.cast(type, annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        kinds = [a for a in typing.get_args(annotation) if a is not type(None)]
        if per_layer:  # the list of per-layer values beside the one value
            kinds = [a for a in kinds if typing.get_origin(a) not in (tuple, list)]
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
    try:
        if spec.per_layer and isinstance(value, list):
            return tuple(kind(v) for v in value)
        return kind(value)
    except OverflowError:
        raise ModelFolderError(f"{where}: {key} is too large") from None
