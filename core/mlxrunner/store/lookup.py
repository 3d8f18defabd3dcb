"""Model names to folders through the store, for ``resolve_model_path``: an entry the store
holds, else a registered source pulled on first use (its fallback when that fails)."""

from __future__ import annotations

import logging
from pathlib import Path

from ..host import manager as plugins
from ..model.loading import resolve_model_path
from .fetch import pull, refresh_modelfile
from .sources import SOURCE_TYPES, HubModel, PackagedModel, Source
from .store import FetchError, Store, StoreError, check_name, default_store

log = logging.getLogger("mlxrunner.store")


def registered_source(name: str) -> Source | None:
    """The source a plugin registered under ``name`` (None: none, or a folder)."""
    reg = plugins.host().registry("models").get(name)
    return reg.obj if reg is not None and isinstance(reg.obj, SOURCE_TYPES) else None


def source_for(name: str) -> Source:
    """What ``pull NAME`` fetches: the registered source, else the Hub repository ``org/repo``."""
    source = registered_source(name)
    if source is not None:
        return source
    try:
        return HubModel(name)
    except ValueError:
        pass
    known = [n for n, reg in plugins.host().registry("models").items()
             if isinstance(reg.obj, SOURCE_TYPES)]
    raise StoreError(f"{name}: no registered model source by that name (pullable: "
                     f"{', '.join(sorted(known)) or 'none'}) and not a Hugging Face repository "
                     "id (owner/name)")


def stored_names(store: Store | None = None) -> list[str]:
    """The store's model names (none when it cannot be read)."""
    try:
        return sorted(e.name for e in (store if store is not None else default_store()).entries())
    except (StoreError, OSError):
        return []


def find_model(name: str, store: Store | None = None) -> Path | None:
    """The folder of model ``name``: the store's entry, else a registered source's, pulled
    now; None when neither the store nor a registered source knows the name."""
    try:
        check_name(name)
    except StoreError:
        return None
    store = store if store is not None else default_store()
    entry = store.get(name)
    source = registered_source(name)
    if entry is not None:
        if isinstance(source, PackagedModel) and entry.manifest.source == source.describe():
            refresh_modelfile(entry, source)  # (the plugin's parameters may have changed)
        return entry.path
    if source is None:
        return None
    try:
        return pull(store, name, source).path
    except FetchError as exc:
        if not source.fallback:
            raise
        log.warning("mlxrunner: could not fetch %s (%s); running %s instead", name, exc,
                    source.fallback)
        if source.fallback == name:
            raise
        return resolve_model_path(source.fallback)
