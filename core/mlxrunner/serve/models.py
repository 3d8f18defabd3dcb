"""The models a server answers to by name: the one it started with (always loaded) and, on
demand, registered models and the folders of a models directory. A model loaded on demand
stays for its ``keep_alive`` after its last request (Ollama's rule: a duration, seconds, a
negative value for ever, 0 to unload at once), and at most ``max_loaded`` of them stay."""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from typing import Any

from ..bundle import Bundle, load
from ..host import manager as plugins
from .engine import RequestError, Service

log = logging.getLogger("mlxrunner.serve")
DEFAULT_KEEP_ALIVE = 300.0
_DURATION = re.compile(r"^\s*(-?\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$")
_UNIT = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def keep_alive_seconds(value: str | int | float | None, default: float) -> float:
    """Ollama's ``keep_alive`` in seconds (``inf`` for ever)."""
    if value is None:
        return default
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        match = _DURATION.match(str(value))
        if match is None:
            raise RequestError(f"keep_alive {value!r} is not a duration (e.g. '5m', 30, -1)",
                               param="keep_alive")
        seconds = float(match.group(1)) * _UNIT[match.group(2)]
    return float("inf") if seconds < 0 else seconds


@dataclass
class _Loaded:
    service: Service
    pinned: bool
    expires: float = float("inf")


class Models:
    """Services by name, loading and unloading as requests ask."""

    def __init__(self, first: Service, *, models_dir: str | Path | None = None,
                 max_loaded: int = 1, keep_alive: float = DEFAULT_KEEP_ALIVE,
                 make_service: Callable[[Bundle, str], Service] | None = None,
                 load_bundle: Callable[[str], Bundle] | None = None) -> None:
        """``first`` stays loaded; ``max_loaded`` bounds the others; ``models_dir``: a folder
        whose model folders (with a config.json) are served by their folder names."""
        self.default = first
        self.models_dir = Path(models_dir).expanduser() if models_dir is not None else None
        self.max_loaded = max_loaded
        self.keep_alive = keep_alive
        self._make_service = make_service or (lambda bundle, name: Service(bundle, name))
        self._load_bundle = load_bundle or (lambda source: load(source))
        self._loaded: dict[str, _Loaded] = {first.name: _Loaded(first, pinned=True)}
        self._lock = asyncio.Lock()

    # -- names -------------------------------------------------------------------------
    def _sources(self) -> dict[str, str]:
        """Loadable names and what loads each (a registered or stored name, or a folder);
        none when ``max_loaded`` is 0 (the server serves its one model)."""
        if self.max_loaded < 1:
            return {}
        sources = {name: name for name in plugins.host().registry("models")}
        # the store's entries (what `mlxrunner list` shows: pulled, created, copied)
        sources.update((name, name) for name in plugins.stored_names())
        if self.models_dir is not None and self.models_dir.is_dir():
            for folder in sorted(self.models_dir.iterdir()):
                if (folder / "config.json").is_file():
                    sources[folder.name] = str(folder)
        return sources

    def names(self) -> list[str]:
        """Every name this server answers to, the loaded ones first."""
        loaded = list(self._loaded)
        return loaded + [n for n in self._sources() if n not in self._loaded]

    def loaded(self) -> list[tuple[Service, float]]:
        """Loaded services and when each expires (``inf``: never), after unloading the
        expired ones."""
        self._sweep()
        return [(entry.service, entry.expires) for entry in self._loaded.values()]

    def _canonical(self, name: str) -> str:
        return name[:-len(":latest")] if name.endswith(":latest") else name

    def find(self, name: str | None) -> Service | None:
        """The loaded service called ``name`` (None or empty: the default), if loaded."""
        if not name:
            return self.default
        entry = self._loaded.get(self._canonical(name)) or self._loaded.get(name)
        return entry.service if entry is not None else None

    def _unknown(self, name: str) -> RequestError:
        return RequestError(f"model {name!r} not found (served: "
                            f"{', '.join(self.names())})", HTTPStatus.NOT_FOUND,
                            param="model")

    def known(self, name: str | None) -> str:
        """The canonical name of ``name``, or a 404."""
        if not name:
            return self.default.name
        for candidate in (name, self._canonical(name)):
            if candidate in self._loaded or candidate in self._sources():
                return candidate
        raise self._unknown(name)

    # -- loading -----------------------------------------------------------------------
    async def get(self, name: str | None, keep_alive: Any = None) -> Service:
        """The service for ``name``, loaded first when it is not; ``keep_alive`` (Ollama's
        values) sets how long it stays after this request."""
        seconds = keep_alive_seconds(keep_alive, self.keep_alive)
        canonical = self.known(name)
        async with self._lock:
            self._sweep()
            entry = self._loaded.get(canonical)
            if entry is None:
                self._make_room()
                source = self._sources()[canonical]
                log.info("mlxrunner: loading model %s", canonical)
                bundle = await asyncio.to_thread(self._load_bundle, source)
                entry = self._loaded[canonical] = _Loaded(
                    self._make_service(bundle, canonical), pinned=False)
            if not entry.pinned:
                entry.expires = time.monotonic() + seconds
                if seconds != float("inf"):
                    asyncio.get_running_loop().call_later(seconds + 0.05, self._sweep)
        return entry.service

    def _busy(self, service: Service) -> bool:
        return service.engine.busy

    def _make_room(self) -> None:
        unpinned = [(n, e) for n, e in self._loaded.items() if not e.pinned]
        while len(unpinned) >= self.max_loaded:
            idle = [(n, e) for n, e in unpinned if not self._busy(e.service)]
            if not idle:
                raise RequestError(f"{len(unpinned)} models are loaded and busy (at most "
                                   f"{self.max_loaded}); retry later",
                                   HTTPStatus.SERVICE_UNAVAILABLE, headers={"Retry-After": "1"})
            name, _ = min(idle, key=lambda item: item[1].expires)
            self.unload(name)
            unpinned = [(n, e) for n, e in self._loaded.items() if not e.pinned]

    def unload(self, name: str) -> bool:
        """Unload ``name`` (not the default one); True when it was loaded."""
        entry = self._loaded.get(name)
        if entry is None or entry.pinned:
            return False
        del self._loaded[name]
        entry.service.engine.close()
        log.info("mlxrunner: unloaded model %s", name)
        return True

    def _sweep(self) -> None:
        now = time.monotonic()
        for name, entry in list(self._loaded.items()):
            if entry.pinned or entry.expires > now:
                continue
            if self._busy(entry.service):  # expired while it decodes: look again soon
                asyncio.get_running_loop().call_later(0.5, self._sweep)
            else:
                self.unload(name)
