"""Models: the Model and draft interfaces, loading a folder's target and draft, its
tokenizer and Modelfile. Names resolve lazily (a Modelfile needs no MLX)."""

from __future__ import annotations

from ..lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    # the interfaces
    "Model": "interface",
    "compute_dtype_of": "interface",
    "weight_precision_of": "interface",
    "Distribution": "distribution",
    "DraftModel": "draft",
    "DraftProposal": "draft",
    "DraftSession": "draft",
    "BlockSettings": "block_draft",
    "BUNDLE_PREFIX": "draft",
    "build_draft": "draft",
    "load_draft": "draft",
    # the target's weights
    "DTYPES": "loading",
    "build_model": "loading",
    "declared_dtype": "loading",
    "host_dtype": "loading",
    "install_weights": "loading",
    "load_model": "loading",
    "read_config": "loading",
    "read_weights": "loading",
    "resolve_model_path": "loading",
    "text_config": "loading",
    "weight_files": "loading",
    "check_safetensors": "safetensors",
    "read_gguf": "gguf",
    "read_gguf_tensors": "gguf",
    "stored_dtypes": "safetensors",
    # the rest of a folder
    "Tokenizer": "tokenizer",
    "Modelfile": "modelfile",
    "PARAMETER_TYPES": "modelfile",
    "inherit_modelfile": "modelfile",
    "parse_modelfile": "modelfile",
    "read_modelfile": "modelfile",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
