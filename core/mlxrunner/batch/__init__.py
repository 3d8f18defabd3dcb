"""Continuous batching: a scheduler in the core that decodes many sequences together, each
exactly as it would decode alone (see :mod:`.scheduler` and docs/batching.md)."""

from __future__ import annotations

from ..lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "BatchRequest": "scheduler",
    "Scheduler": "scheduler",
    "TokenCallback": "scheduler",
    "batch_budget": "scheduler",
    "generate": "generation",
    "generate_batch": "scheduler",
    "verify_width": "scheduler",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
