"""The Model interface every target architecture provides.

An architecture plugin subclasses :class:`Model` (an ``mlx.nn.Module``) and
registers the class by name. The core builds it from the parsed ``config.json``
(its ``text_config`` when there is one), lets it ``sanitize`` the checkpoint's
tensors, loads them strictly, and then only ever calls the members below.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, cast

import mlx.core as mx
import mlx.nn as nn

from ..cache import Cache
from .config_bounds import ConfigBound, ConfigMultiple


class Model(nn.Module):
    """Base class of target architectures.

    Subclasses implement ``__init__(config)``, ``__call__``, ``make_cache``,
    ``embed_tokens``, ``raw_logits`` and the ``num_layers`` / ``vocab_size`` /
    ``hidden_size`` properties. Keep the parsed config in a dataclass (an
    ``nn.Module`` treats plain dict attributes as parameter trees).
    """

    #: whether ``__call__`` honours ``taps`` (drafts need it)
    supports_taps: bool = True
    #: bounds of the config keys this architecture reads beyond the standard ones
    #: (:data:`mlxrunner.model.config_bounds.STANDARD_BOUNDS`), checked before ``__init__``
    config_bounds: ClassVar[Mapping[str, ConfigBound]] = {}
    #: config keys that must be multiples of others, checked before ``__init__``
    config_multiples: ClassVar[tuple[ConfigMultiple, ...]] = ()

    def __init__(self, config: dict[str, Any]) -> None:  # noqa: ARG002
        super().__init__()

    # -- weights ------------------------------------------------------------
    # The core traces this model's decode steps (mlxrunner.decode.step); a trace holds the
    # weight arrays it read, so new weights drop the traces.
    # (mlx's Module is a dict whose update takes other arguments: hence the ignore)
    def update(self, parameters: dict, strict: bool = True) -> Model:  # type: ignore[override]
        self.__dict__.pop("_mlxrunner_steps", None)
        super().update(parameters, strict=strict)
        return self

    def update_modules(self, modules: dict, strict: bool = True) -> Model:
        self.__dict__.pop("_mlxrunner_steps", None)
        super().update_modules(modules, strict=strict)
        return self

    # -- loading -----------------------------------------------------------
    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        """Map checkpoint names to this module's names; drop what is not used."""
        return weights

    def quantize_predicate(self, path: str, module: nn.Module) -> bool:
        """Which modules a quantized checkpoint quantizes (default: those with ``.scales``)."""
        return hasattr(module, "to_quantized")

    # -- running -----------------------------------------------------------
    def make_cache(self) -> list[Cache | None]:
        """One cache per layer that keeps state (``None`` for KV-sharing layers)."""
        raise NotImplementedError

    def __call__(self, ids: mx.array, cache: Sequence[Cache | None] | None = None, *,
                 taps: Sequence[int] | None = None) -> mx.array | tuple[mx.array, mx.array]:
        """Token ids ``[B, L]`` to logits ``[B, L, V]``.

        With ``taps`` (layer indices, ascending), return ``(logits, tapped)``
        where ``tapped`` is ``[B, L, len(taps) * hidden]``: the residual stream
        after each tapped layer, concatenated in tap order, from this same pass.
        """
        raise NotImplementedError

    def embed_tokens(self, ids: mx.array) -> mx.array:
        """The input embedding exactly as the model applies it (scales included)."""
        raise NotImplementedError

    def raw_logits(self, hidden: mx.array) -> mx.array:
        """The output head alone on already-normalised hidden states (no softcap)."""
        raise NotImplementedError

    # -- facts -------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        raise NotImplementedError

    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    @property
    def hidden_size(self) -> int:
        raise NotImplementedError

    @property
    def dtype(self) -> mx.Dtype:
        """The dtype activations are computed in (that of the first float parameter)."""
        return compute_dtype_of(self)

    @property
    def weight_precision(self) -> str:
        """A short description of the weights' precision: ``bfloat16``, ``4-bit affine`` ..."""
        return weight_precision_of(self)


def compute_dtype_of(module: nn.Module) -> mx.Dtype:
    """The dtype of a module's first floating-point parameter (float32 when it has none)."""
    flat = cast("list[tuple[str, mx.array]]", nn.utils.tree_flatten(module.parameters()))
    for _, value in flat:
        if mx.issubdtype(value.dtype, mx.floating):
            return value.dtype
    return mx.float32


def weight_precision_of(module: nn.Module) -> str:
    """``4-bit affine`` (or ``mxfp4``, ``nvfp4``, ...) for quantized modules, several joined
    by ``/``; else the float dtype's name."""
    kinds = set()
    for _, m in module.named_modules():
        if hasattr(m, "bits"):
            mode = getattr(m, "mode", "affine") or "affine"
            kinds.add((m.bits, mode))
    if kinds:
        return "/".join(f"{bits}-bit affine" if mode == "affine" else str(mode)
                        for bits, mode in sorted(kinds))
    return str(compute_dtype_of(module)).replace("mlx.core.", "")
