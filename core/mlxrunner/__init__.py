"""mlxrunner: run language models on MLX, extended by plugins.

This module is the public API: plugins and users import names from here (and
from ``mlxrunner.testing``) only. Names resolve lazily so that ``mlxrunner
--help`` starts without importing MLX.
"""

from __future__ import annotations

import os
import sys
from importlib import import_module
from typing import TYPE_CHECKING, Any

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

# public name -> module that defines it
_EXPORTS: dict[str, str] = {
    # plugins
    "hookimpl": "hookspecs",
    "register": "plugins",
    "registered": "plugins",
    # errors
    "MLXRunnerError": "errors",
    "ModelFolderError": "errors",
    "UnknownNameError": "errors",
    "PluginError": "errors",
    "ModelfileError": "errors",
    "ConversationError": "errors",
    "DraftConfigError": "errors",
    # models and caches
    "Model": "model",
    "Cache": "caches",
    "KVCache": "caches",
    "RingCache": "caches",
    "RecurrentCache": "caches",
    # loading
    "load_model": "loading",
    "build_model": "loading",
    "load": "loading",
    "Bundle": "loading",
    "read_config": "loading",
    "Tokenizer": "tokenizer",
    "Modelfile": "modelfile",
    "read_modelfile": "modelfile",
    # sampling
    "topk_indices": "topk",
    "attend": "attention",
    "prepare_attend": "attention",
    "check_kernel": "kernels",
    "outputs_agree": "kernels",
    "switch_allows": "kernels",
    "on_cuda": "kernels",
    "constant": "kernels",
    "arange_constant": "kernels",
    "project": "kernels",
    "prepare_topk_indices": "topk",
    "SamplerOptions": "options",
    "Sampler": "sampler",
    "Distribution": "sampler",
    "SamplerOptionError": "options",
    # generation
    "generate": "generation",
    "GenerationResult": "generation",
    # chat formats
    "RenderContext": "chat",
    "Renderer": "chat",
    "Parser": "chat",
    "ParsedMessage": "chat",
    "ToolCall": "chat",
    "validate_conversation": "chat",
    "get_renderer": "chat",
    "get_parser": "chat",
    "MarkerScanner": "parsing",
    "ParseEvents": "parsing",
    "TrimmedText": "parsing",
    "ReplyParser": "parsing",
    # drafts
    "DraftModel": "drafts",
    "DraftSession": "drafts",
    "DraftProposal": "drafts",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mlxrunner' has no attribute {name!r}")
    value = getattr(import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__


if TYPE_CHECKING:  # pragma: no cover
    from .caches import Cache, KVCache, RecurrentCache, RingCache  # noqa: F401
    from .chat import (  # noqa: F401
        ParsedMessage,
        Parser,
        RenderContext,
        Renderer,
        ToolCall,
        get_parser,
        get_renderer,
        validate_conversation,
    )
    from .drafts import DraftModel, DraftProposal, DraftSession  # noqa: F401
    from .errors import (  # noqa: F401
        ConversationError,
        DraftConfigError,
        MLXRunnerError,
        ModelfileError,
        ModelFolderError,
        PluginError,
        UnknownNameError,
    )
    from .generation import GenerationResult, generate  # noqa: F401
    from .hookspecs import hookimpl  # noqa: F401
    from .loading import Bundle, build_model, load, load_model, read_config  # noqa: F401
    from .model import Model  # noqa: F401
    from .modelfile import Modelfile, read_modelfile  # noqa: F401
    from .options import SamplerOptionError, SamplerOptions  # noqa: F401
    from .parsing import MarkerScanner, ParseEvents, ReplyParser, TrimmedText  # noqa: F401
    from .plugins import register, registered  # noqa: F401
    from .sampler import Distribution, Sampler  # noqa: F401
    from .tokenizer import Tokenizer  # noqa: F401
    from .topk import topk_indices  # noqa: F401
