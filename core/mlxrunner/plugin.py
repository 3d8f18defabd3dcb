"""The plugin author's API: ``from mlxrunner.plugin import Model, KVCache, hookimpl, ...``.

Hooks and registration, the Model and cache interfaces, the draft interfaces, chat-format
interfaces and parsing helpers, the error classes, image decoding (Pillow, optional), the
sampler and top-k (for drafts).
Layers to build architectures from are in :mod:`mlxrunner.nn`. Every name here also
resolves as ``mlxrunner.NAME``. Names resolve lazily, so that a plugin module that only
marks hooks (``mlxrunner --help`` loads it) imports no MLX.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    # hooks and registration
    "hookimpl": "host.hookspecs",
    "Register": "host.hookspecs",
    "Commands": "host.hookspecs",
    "register": "host.manager",
    "registered": "host.manager",
    # target architectures and their caches
    "Model": "model.interface",
    "Cache": "cache",
    "KVCache": "cache",
    "RingCache": "cache",
    "RecurrentCache": "cache",
    # config.json bounds (checked before a model or draft is built)
    "ConfigBound": "model.config_bounds",
    "ConfigMultiple": "model.config_bounds",
    "check_config": "model.config_bounds",
    "ConfigFields": "model.config_fields",
    "read_config": "model.loading",
    "read_json": "model.loading",
    "read_processor_config": "model.loading",
    "weight_files": "model.loading",
    "read_weights": "model.loading",
    "install_weights": "model.loading",
    "load_part": "model.loading",
    "config_field": "model.config_fields",
    # drafts
    "DraftModel": "model.draft",
    "DraftSession": "model.draft",
    "DraftProposal": "model.draft",
    "BlockDraft": "model.block_draft",
    "BlockDraftSession": "model.block_draft",
    "ContextCache": "cache.context",
    "TracedContext": "cache.context",
    "RowContext": "cache.context",
    # chat formats
    "Renderer": "chat.formats",
    "Parser": "chat.formats",
    "RenderContext": "chat.formats",
    "ParsedMessage": "chat.formats",
    "ToolCall": "chat.formats",
    "validate_conversation": "chat.formats",
    "MarkerScanner": "chat.parsing",
    "ParseEvents": "chat.parsing",
    "TrimmedText": "chat.parsing",
    "ReplyParser": "chat.parsing",
    # errors
    "MLXRunnerError": "errors",
    "ModelFolderError": "errors",
    "UnknownNameError": "errors",
    "PluginError": "errors",
    "ModelfileError": "errors",
    "ConversationError": "errors",
    "TemplateError": "errors",
    "TokenizerInputError": "errors",
    "DraftConfigError": "errors",
    "MediaError": "errors",
    # images: untrusted bytes or files to RGB pixels, Pillow's resize (Pillow optional)
    "decode_image": "media",
    "read_image": "media",
    "resize_image": "media",
    "rescale_normalize": "media",
    "pixel_settings": "media",
    "PILLOW_FILTERS": "media",
    "Encoder": "media",
    "MediaItem": "media",
    "content_digest": "media",
    # audio: untrusted bytes or files to float32 mono samples (soundfile optional)
    "decode_audio": "media",
    "read_audio": "media",
    "resample_audio": "media",
    # sampling (a draft draws with the request's sampler)
    "SamplerOptions": "decode.options",
    "Sampler": "decode.sampler",
    "Distribution": "model.distribution",
    "topk_indices": "decode.topk",
    "prepare_topk_indices": "decode.topk",
    # named models (register_models)
    "PackagedModel": "store.sources",
    "HubModel": "store.sources",
    # a command a plugin adds runs models as users do (the user API's own functions)
    "load": "bundle",
    "generate": "batch.generation",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)

if TYPE_CHECKING:  # pragma: no cover
    from .batch.generation import generate  # noqa: F401
    from .bundle import load  # noqa: F401
    from .cache import Cache, KVCache, RecurrentCache, RingCache  # noqa: F401
    from .cache.context import ContextCache, RowContext, TracedContext  # noqa: F401
    from .chat.formats import (  # noqa: F401
        ParsedMessage,
        Parser,
        RenderContext,
        Renderer,
        ToolCall,
        validate_conversation,
    )
    from .chat.parsing import MarkerScanner, ParseEvents, ReplyParser, TrimmedText  # noqa: F401
    from .decode.options import SamplerOptions  # noqa: F401
    from .decode.sampler import Sampler  # noqa: F401
    from .decode.topk import prepare_topk_indices, topk_indices  # noqa: F401
    from .errors import (  # noqa: F401
        ConversationError,
        DraftConfigError,
        MediaError,
        MLXRunnerError,
        ModelfileError,
        ModelFolderError,
        PluginError,
        TemplateError,
        TokenizerInputError,
        UnknownNameError,
    )
    from .host.hookspecs import Commands, Register, hookimpl  # noqa: F401
    from .host.manager import register, registered  # noqa: F401
    from .media import (  # noqa: F401
        Encoder,
        MediaItem,
        content_digest,
        decode_audio,
        decode_image,
        read_audio,
        read_image,
        resample_audio,
        resize_image,
    )
    from .model.block_draft import BlockDraft, BlockDraftSession  # noqa: F401
    from .model.config_bounds import ConfigBound, ConfigMultiple, check_config  # noqa: F401
    from .model.config_fields import ConfigFields, config_field  # noqa: F401
    from .model.distribution import Distribution  # noqa: F401
    from .model.draft import DraftModel, DraftProposal, DraftSession  # noqa: F401
    from .model.interface import Model  # noqa: F401
    from .store.sources import HubModel, PackagedModel  # noqa: F401
