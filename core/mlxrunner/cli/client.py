"""Commands that ask a running ``mlxrunner serve``, as ``ollama ps`` and ``ollama stop`` ask
Ollama's server: ``ps`` lists the models it holds loaded, ``stop NAME`` unloads one (Ollama's
unload: a generate request with nothing to generate and ``keep_alive`` 0).

The server is ``--url`` (default ``http://127.0.0.1:8080``, where ``serve`` listens by
default); ``MLXRUNNER_API_KEY`` is sent as the bearer token where set. No server there is one
line and exit status 1."""

from __future__ import annotations

import argparse
import json
from datetime import datetime, timezone
from typing import Any

from ..errors import MLXRunnerError

DEFAULT_URL = "http://127.0.0.1:8080"
#: seconds to wait for the server's answer
TIMEOUT_S = 30.0


def add_url(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", default=DEFAULT_URL,
                   help=f"the server (default {DEFAULT_URL}, where `mlxrunner serve` listens)")


def _ask(url: str, path: str, body: dict[str, Any] | None = None) -> Any:
    import urllib.error  # (here: every command's --help would import them)
    import urllib.request

    from .. import settings

    base = url.rstrip("/")
    if "://" not in base:
        base = f"http://{base}"
    headers = {"Content-Type": "application/json"}
    key = settings.current().api_key
    if key:
        headers["Authorization"] = f"Bearer {key}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(base + path, data=data, headers=headers,
                                     method="GET" if body is None else "POST")
    try:
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as response:
            text = response.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode("utf-8", "replace")
        try:
            message = json.loads(detail).get("error", detail)
        except (ValueError, AttributeError):
            message = detail
        if isinstance(message, dict):
            message = message.get("message", str(message))
        raise MLXRunnerError(f"{base}: {exc.code} {str(message).strip()[:300]}") from None
    except (urllib.error.URLError, OSError) as exc:
        reason = getattr(exc, "reason", exc)
        raise MLXRunnerError(f"no mlxrunner server at {base} ({reason}); start one with "
                             "`mlxrunner serve`, or name it with --url") from None
    lines = [line for line in text.splitlines() if line.strip()]
    try:
        return json.loads(lines[-1] if lines else "null")
    except ValueError:
        raise MLXRunnerError(f"{base}{path}: not a JSON answer") from None


def _until(expires: str | None) -> str:
    if not expires:
        return "-"
    try:
        then = datetime.fromisoformat(expires.replace("Z", "+00:00"))
    except ValueError:
        return expires
    seconds = (then - datetime.now(timezone.utc)).total_seconds()
    if seconds > 50 * 365 * 86400:
        return "Forever"
    if seconds <= 0:
        return "now"
    for unit, size in (("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds >= size:
            n = int(seconds // size)
            return f"{n} {unit}{'s' if n > 1 else ''} from now"
    return f"{int(seconds)} seconds from now"


def cmd_ps(args: argparse.Namespace) -> int:
    answer = _ask(args.url, "/api/ps")
    models = answer.get("models", []) if isinstance(answer, dict) else []
    if args.json:
        print(json.dumps(models, indent=2))
        return 0
    from ..store import human_size

    table = [("NAME", "SIZE", "CONTEXT", "UNTIL")]
    for m in models:
        table.append((str(m.get("name", "?")), human_size(int(m.get("size") or 0)),
                      str(m.get("context_length", "-")), _until(m.get("expires_at"))))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for row in table:
        print("    ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    return 0


def cmd_stop(args: argparse.Namespace) -> int:
    loaded = _ask(args.url, "/api/ps")
    names = {str(m.get("name")) for m in (loaded.get("models", []) if isinstance(loaded, dict)
                                          else [])}
    if args.model not in names:
        held = ", ".join(sorted(names)) or "none"
        raise MLXRunnerError(f"{args.model} is not loaded on {args.url} (loaded: {held})")
    answer = _ask(args.url, "/api/generate", {"model": args.model, "keep_alive": 0})
    if not isinstance(answer, dict) or answer.get("done_reason") != "unload":
        raise MLXRunnerError(f"{args.model} stays loaded: the server's model is served for "
                             "its whole life (models it loaded on demand can be stopped)")
    return 0


def register(command: Any) -> None:
    """Add ``ps`` and ``stop`` (``command``: the CLI's command registry's ``command``)."""

    def add_ps(p: argparse.ArgumentParser) -> None:
        add_url(p)
        p.add_argument("--json", action="store_true", help="print JSON")

    def add_stop(p: argparse.ArgumentParser) -> None:
        p.add_argument("model", help="a model the server holds loaded (as `ps` lists it)")
        add_url(p)

    command("ps", "list the models a running server holds loaded", add_ps, cmd_ps)
    command("stop", "unload a model from a running server", add_stop, cmd_stop)
