"""The ``mlxrunner`` command line (console script ``mlxrunner = "mlxrunner.cli:main"``).

Only ``main`` is imported here; the interactive chat loop resolves lazily (it needs MLX,
and ``mlxrunner --help`` must not import it).
"""

from __future__ import annotations

from ..lazy import lazy_exports
from .main import main

_EXPORTS: dict[str, str] = {
    "COMPLETIONS": "chat",
    "HELP": "chat",
    "EXIT_HINT": "chat",
    "chat_loop": "chat",
    "read_message": "chat",
    "stream_reply": "chat",
    "LineEditor": "history",
    "conversations_folder": "history",
    "history_path": "history",
    "describe_comparison": "statistics",
    "describe_run": "statistics",
    "slowdown_reason": "statistics",
    "CommandRegistry": "main",
    "build_parser": "main",
    "build_prompt": "main",
    "log_to_stderr": "main",
}

__all__ = ["main", *sorted(_EXPORTS)]
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS, listed=__all__)
