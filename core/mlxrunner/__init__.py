"""mlxrunner: run language models on MLX, extended by plugins.

This module is the user API (``__all__``): load a model folder, generate, sampler
options, tokenizer, Modelfile, chat formats by name, ``mlxrunner.errors``. Plugin
authors import from :mod:`mlxrunner.plugin` (and :mod:`mlxrunner.nn`); those names still
resolve here for plugins written before those modules (``from mlxrunner import KVCache``
keeps working, with a DeprecationWarning). Names resolve lazily so that ``mlxrunner
--help`` starts without importing MLX.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

__version__ = "0.1.0"

#: MLX settings mlxrunner runs with unless the environment already sets them. MLX reads
#: each once, on first use, so they are set here, before any array is evaluated.
#: - MLX_ENABLE_TF32=0: float32 means float32. MLX's CUDA build otherwise runs float32
#:   matrix products in TF32 (about 1e-3 relative error), so a model that declares float32
#:   would round a verify block and a decode step differently and greedy speculative output
#:   could drift from plain decoding.
#: - MLX_MAX_OPS_PER_BUFFER=200 (CUDA): MLX's CUDA backend launches a CUDA graph every 20
#:   operations by default; one graph per decode step's few hundred kernels measured 17%
#:   faster decoding on an H200 for Qwen3.5-0.8B and Gemma 4 E2B (bench/results). MLX
#:   documents the value as below 255. Metal reads the same variable with other defaults;
#:   it is left alone there.
MLX_DEFAULTS = {"MLX_ENABLE_TF32": "0"}
if sys.platform.startswith("linux"):
    MLX_DEFAULTS["MLX_MAX_OPS_PER_BUFFER"] = "200"
for _name, _value in MLX_DEFAULTS.items():
    os.environ.setdefault(_name, _value)

# The user API: what ``__all__``, ``dir()`` and the docs list.
_USER_API: dict[str, str] = {
    "load": "bundle",
    "Bundle": "bundle",
    "load_model": "model.loading",
    "build_model": "model.loading",
    "read_config": "model.loading",
    "generate": "batch.generation",
    "generate_batch": "batch.scheduler",
    "GenerationResult": "decode.plain",
    "MediaPrompt": "media",
    "place_media": "media",
    "SamplerOptions": "decode.options",
    "SamplerOptionError": "decode.options",
    "Tokenizer": "model.tokenizer",
    "Modelfile": "model.modelfile",
    "read_modelfile": "model.modelfile",
    "get_renderer": "chat.formats",
    "get_parser": "chat.formats",
}

# Names for plugin authors (:mod:`mlxrunner.plugin`, :mod:`mlxrunner.nn`), resolved here too
# for plugins written before those modules: name -> module that defines it.
_PLUGIN_API: dict[str, str] = {
    "hookimpl": "host.hookspecs",
    "register": "host.manager",
    "registered": "host.manager",
    "MLXRunnerError": "errors",
    "ModelFolderError": "errors",
    "UnknownNameError": "errors",
    "PluginError": "errors",
    "ModelfileError": "errors",
    "ConversationError": "errors",
    "PromptError": "errors",
    "DraftConfigError": "errors",
    "Model": "model.interface",
    "Cache": "cache",
    "KVCache": "cache",
    "RingCache": "cache",
    "RecurrentCache": "cache",
    "DraftModel": "model.draft",
    "DraftSession": "model.draft",
    "DraftProposal": "model.draft",
    "Sampler": "decode.sampler",
    "Distribution": "model.distribution",
    "topk_indices": "decode.topk",
    "prepare_topk_indices": "decode.topk",
    "attend": "nn.attention",
    "prepare_attend": "nn.attention",
    "check_kernel": "nn.kernels",
    "outputs_agree": "nn.kernels",
    "switch_allows": "nn.kernels",
    "on_cuda": "nn.kernels",
    "constant": "constants",
    "arange_constant": "constants",
    "project": "nn.kernels",
    "RenderContext": "chat.formats",
    "Renderer": "chat.formats",
    "Parser": "chat.formats",
    "ParsedMessage": "chat.formats",
    "ToolCall": "chat.formats",
    "validate_conversation": "chat.formats",
    "MarkerScanner": "chat.parsing",
    "ParseEvents": "chat.parsing",
    "TrimmedText": "chat.parsing",
    "ReplyParser": "chat.parsing",
}

# public name -> module that defines it
_EXPORTS: dict[str, str] = {**_USER_API, **_PLUGIN_API}

__all__ = sorted(_USER_API) + ["__version__", "errors"]

from . import errors  # noqa: E402  (after the MLX settings; plain Python)
from .lazy import lazy_exports  # noqa: E402

#: kernel plumbing a plugin has no use for (mlxrunner.nn's layers choose kernels themselves)
_INTERNAL = frozenset({"prepare_attend", "check_kernel", "outputs_agree", "switch_allows",
                       "on_cuda", "project"})
#: where the plugin names resolved here belong now (the errors stay: users catch them too)
_MOVED = {name: ("internal; kept for plugins written before mlxrunner.nn" if name in _INTERNAL
                 else "import it from mlxrunner.nn" if source.startswith(("nn.", "constants"))
                 else "import it from mlxrunner.plugin")
          for name, source in _PLUGIN_API.items() if source != "errors"}

__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, listed=__all__, moved=_MOVED)

if TYPE_CHECKING:  # pragma: no cover
    from .batch.generation import generate  # noqa: F401
    from .bundle import Bundle, load  # noqa: F401
    from .cache import Cache, KVCache, RecurrentCache, RingCache  # noqa: F401
    from .chat.formats import (  # noqa: F401
        ParsedMessage,
        Parser,
        RenderContext,
        Renderer,
        ToolCall,
        get_parser,
        get_renderer,
        validate_conversation,
    )
    from .chat.parsing import MarkerScanner, ParseEvents, ReplyParser, TrimmedText  # noqa: F401
    from .constants import arange_constant, constant  # noqa: F401
    from .decode.options import SamplerOptionError, SamplerOptions  # noqa: F401
    from .decode.plain import GenerationResult  # noqa: F401
    from .decode.sampler import Sampler  # noqa: F401
    from .decode.topk import prepare_topk_indices, topk_indices  # noqa: F401
    from .errors import (  # noqa: F401
        ConversationError,
        DraftConfigError,
        MLXRunnerError,
        ModelfileError,
        ModelFolderError,
        PluginError,
        PromptError,
        UnknownNameError,
    )
    from .host.hookspecs import hookimpl  # noqa: F401
    from .host.manager import register, registered  # noqa: F401
    from .media import MediaPrompt, place_media  # noqa: F401
    from .model.distribution import Distribution  # noqa: F401
    from .model.draft import DraftModel, DraftProposal, DraftSession  # noqa: F401
    from .model.interface import Model  # noqa: F401
    from .model.loading import build_model, load_model, read_config  # noqa: F401
    from .model.modelfile import Modelfile, read_modelfile  # noqa: F401
    from .model.tokenizer import Tokenizer  # noqa: F401
    from .nn.attention import attend, prepare_attend  # noqa: F401
    from .nn.kernels import (  # noqa: F401
        check_kernel,
        on_cuda,
        outputs_agree,
        project,
        switch_allows,
    )
