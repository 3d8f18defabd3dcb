"""The Model interface every target architecture provides.

An architecture plugin subclasses :class:`Model` (an ``mlx.nn.Module``) and
registers the class by name. The core builds it from the parsed ``config.json``
(its ``text_config`` when there is one), lets it ``sanitize`` the checkpoint's
tensors, loads them strictly, and then only ever calls the members below.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar, cast

import mlx.core as mx
import mlx.nn as nn

from ..cache import Cache
from ..media.prompt import Encoder
from .config_bounds import ConfigBound, ConfigMultiple


class Model(nn.Module):
    """Base class of target architectures.

    Subclasses implement ``__init__(config)``, ``__call__``, ``make_cache``,
    ``embed_tokens``, ``raw_logits`` and the ``num_layers`` / ``vocab_size`` /
    ``hidden_size`` properties. Keep the parsed config in a dataclass (an
    ``nn.Module`` treats plain dict attributes as parameter trees).
    """

    # -- what a subclass may offer (the core reads these; override what applies, on the class
    # or in __init__) -------------------------------------------------------------------
    #: whether ``__call__`` honours ``taps`` (drafts need it)
    supports_taps: bool = True
    #: the chat format used when the user names none (if a plugin provides that name; else
    #: the folder's own Jinja template renders)
    default_renderer: str | None = None
    #: the output parser used when the user names none (if a plugin provides that name)
    default_parser: str | None = None
    #: token ids that end a reply besides the tokenizer's own end-of-sequence ids
    eos_token_ids: Sequence[int] = ()
    #: the registered draft architecture a checkpoint of this model may carry beside its
    #: weights (an MTP head), loaded as its draft when the checkpoint has one
    checkpoint_draft: ClassVar[str | None] = None
    #: bounds of the config keys this architecture reads beyond the standard ones
    #: (:data:`mlxrunner.model.config_bounds.STANDARD_BOUNDS`), checked before ``__init__``
    config_bounds: ClassVar[Mapping[str, ConfigBound]] = {}
    #: config keys that must be multiples of others, checked before ``__init__``
    config_multiples: ClassVar[tuple[ConfigMultiple, ...]] = ()

    def __init__(self, config: dict[str, Any]) -> None:  # noqa: ARG002
        super().__init__()

    def __setattr__(self, key: str, value: Any) -> None:
        # A capability set in __init__ is a plain attribute: mlx's Module would file a list
        # or tuple as a child of the parameter tree, first deleting what the class declares.
        if key == "layer_kv_sources" and type(self).layer_kv_sources is \
                Model.layer_kv_sources:
            object.__setattr__(self, "_layer_kv_sources", value)
        elif key in _CAPABILITIES:
            object.__setattr__(self, key, value)
        else:
            super().__setattr__(key, value)

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

        A model with encoders (:meth:`load_encoders`) also takes ``embeddings=``: the
        input embeddings ``[B, L, hidden]`` to run instead of ``embed_tokens(ids)`` (the
        core placed media rows in them; ``ids`` still hold the media tokens); and, where its
        encoders give items positions (:class:`mlxrunner.plugin.MediaItem`),
        ``positions=``: ``[C, B, L]`` int32, the tokens' positions per component, in place
        of the cache's offset onward (only while a prompt holding such media is prefilled).
        """
        raise NotImplementedError

    def load_encoders(self, folder: Path) -> Mapping[str, Encoder]:
        """The media encoders this model's checkpoint ``folder`` holds, by modality
        (``image``, ``audio``; :class:`mlxrunner.plugin.Encoder`): none by default. Called
        once, when a prompt first holds media; a model that returns any takes
        ``embeddings=`` in ``__call__``."""
        return {}

    def embed_tokens(self, ids: mx.array) -> mx.array:
        """The input embedding exactly as the model applies it (scales included)."""
        raise NotImplementedError

    def raw_logits(self, hidden: mx.array) -> mx.array:
        """The output head alone on already-normalised hidden states (no softcap)."""
        raise NotImplementedError

    @property
    def layer_kv_sources(self) -> Sequence[int] | None:
        """For each layer, the layer whose keys and values it attends over (its own index,
        or an earlier layer's where layers share them); None: every layer its own. A
        pipeline split (``--distributed pipeline``) never separates the two."""
        # (set in __init__: Model.__setattr__ keeps it here)
        return self.__dict__.get("_layer_kv_sources")

    @classmethod
    def from_gguf(cls, metadata: dict[str, Any], tensors: dict[str, mx.array]
                  ) -> tuple[dict[str, Any], dict[str, mx.array]]:
        """Read llama.cpp's GGUF files of this architecture: ``metadata`` (plain Python
        values) and ``tensors`` (MLX arrays under llama.cpp's names) to the ``config.json``
        they amount to and the tensors under checkpoint names. Not overridden: the
        architecture reads no GGUF files (:func:`reads_gguf`)."""
        raise NotImplementedError(f"{cls.__name__} does not read GGUF files")

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


#: what Model.__setattr__ keeps as plain attributes
_CAPABILITIES = frozenset({"supports_taps", "default_renderer", "default_parser",
                           "eos_token_ids", "checkpoint_draft", "layer_kv_sources"})


def reads_gguf(cls: type) -> bool:
    """Whether the architecture overrides :meth:`Model.from_gguf`."""
    own = getattr(getattr(cls, "from_gguf", None), "__func__", None)
    return own is not None and own is not vars(Model)["from_gguf"].__func__


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
