"""The model store: one folder per model under ``~/.mlxrunner/models`` (``MLXRUNNER_MODELS``
moves it, read once per process).

An entry is a normal model folder plus ``manifest.json`` (name, source, created, modified,
target and draft precision, size). An entry is only ever put in place whole: it is built
under a temporary name inside the root (``.tmp-<pid>-...``), then renamed. Replacing an entry
moves the old one aside (``.old-...``) first and deletes it after; a process killed between
the two renames leaves the old entry aside, and the next write puts it back. Names starting
with ``.`` are never entries, so ``list`` and ``run`` never see a half-written model; the
next write deletes temporaries whose process is gone. A Hub download in progress keeps its
files in ``.partial-<entry>`` so that a later ``pull`` resumes it.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote

from ..errors import MLXRunnerError
from .describe import describe_folder

log = logging.getLogger("mlxrunner.store")

MANIFEST = "manifest.json"
MANIFEST_FORMAT = 1
TEMPORARY_PREFIX = ".tmp-"
ASIDE_PREFIX = ".old-"
PARTIAL_PREFIX = ".partial-"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/+-]{0,199}")


class StoreError(MLXRunnerError):
    """A store operation that cannot be done (a bad name, no such entry)."""


class FetchError(StoreError):
    """A model could not be fetched (network, pip, a checksum)."""


def check_name(name: str) -> str:
    """A model name (``name``, ``name:tag``, ``org/repo``): letters, digits and ``._:/+-``,
    starting with a letter or digit, without empty or ``..`` path parts."""
    if not isinstance(name, str) or not _NAME.fullmatch(name) or \
            any(part in ("", ".", "..") for part in name.split("/")):
        raise StoreError(f"{name!r:.80} is not a model name (letters, digits and ._:/+-, "
                         "starting with a letter or digit)")
    return name


def folder_name(name: str) -> str:
    """The entry folder of a model name: the name with ``/``, ``:`` and ``%`` escaped, so
    that every name has its own folder and none is hidden or nested."""
    return quote(check_name(name), safe="._+-")


def human_size(n: float) -> str:
    """A size as ``list`` and ``pull`` say it: ``98.4 MB``."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def _tag_forms(name: str) -> tuple[str, ...]:
    """The other spelling of ``name``'s default tag: ``NAME`` <-> ``NAME:latest``."""
    if name.endswith(":latest"):
        return (name[:-len(":latest")],)
    return () if ":" in name.rsplit("/", 1)[-1] else (f"{name}:latest",)


def name_of_folder(folder: str) -> str:
    return unquote(folder)


@dataclass
class Manifest:
    """What the store knows about an entry beyond its model folder."""

    name: str
    source: dict[str, Any]
    created: float
    modified: float
    size: int = 0
    architecture: str | None = None
    target_precision: str | None = None
    draft_precision: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    format: int = MANIFEST_FORMAT

    @classmethod
    def read(cls, path: Path) -> Manifest | None:
        """The manifest at ``path``; None when missing or unreadable (not an entry)."""
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
            known = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
            manifest = cls(**known)
        except (OSError, ValueError, TypeError):
            return None
        return manifest if isinstance(manifest.name, str) else None

    def write(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=2) + "\n", encoding="utf-8")


@dataclass(frozen=True)
class Entry:
    """A model in the store: its folder and manifest."""

    path: Path
    manifest: Manifest

    @property
    def name(self) -> str:
        return self.manifest.name


def folder_size(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def _process_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


class Store:
    """The entries under one root folder."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root).expanduser()

    def __repr__(self) -> str:
        return f"Store({str(self.root)!r})"

    # -- reading ---------------------------------------------------------------------------
    def path_of(self, name: str) -> Path:
        return self.root / folder_name(name)

    def get(self, name: str) -> Entry | None:
        """The entry called ``name``, if the store holds it whole; as in Ollama, a name
        without a tag is also its ``:latest`` (and ``NAME:latest`` also a bare ``NAME``)."""
        for candidate in (name, *_tag_forms(name)):
            try:
                folder = self.path_of(candidate)
            except StoreError:
                return None
            manifest = Manifest.read(folder / MANIFEST)
            if manifest is not None and manifest.name == candidate:
                return Entry(folder, manifest)
        return None

    def entries(self) -> list[Entry]:
        """Every whole entry, by name (temporaries and folders without a manifest are not
        entries)."""
        if not self.root.is_dir():
            return []
        found = []
        for folder in self.root.iterdir():
            if folder.name.startswith(".") or not folder.is_dir():
                continue
            entry = self.get(name_of_folder(folder.name))
            if entry is not None:
                found.append(entry)
        return sorted(found, key=lambda e: e.name)

    def require(self, name: str) -> Entry:
        entry = self.get(check_name(name))
        if entry is None:
            held = ", ".join(e.name for e in self.entries()) or "none"
            raise StoreError(f"{name}: no such model in the store {self.root} (held: {held})")
        return entry

    # -- writing ---------------------------------------------------------------------------
    def clean(self) -> None:
        """Delete what killed writers left (temporaries of dead processes) and put back an
        entry that a killed replacement had moved aside."""
        if not self.root.is_dir():
            return
        for path in self.root.iterdir():
            if path.name.startswith(TEMPORARY_PREFIX):
                pid = path.name[len(TEMPORARY_PREFIX):].split("-", 1)[0]
                if pid.isdigit() and not _process_alive(int(pid)):
                    _remove(path)
            elif path.name.startswith(ASIDE_PREFIX):
                pid, _, folder = path.name[len(ASIDE_PREFIX):].partition("-")
                if pid.isdigit() and _process_alive(int(pid)):
                    continue
                home = self.root / folder
                if folder and not home.exists() and (path / MANIFEST).is_file():
                    os.replace(path, home)
                    log.info("store: put back %s, which a killed write had moved aside",
                             name_of_folder(folder))
                else:
                    _remove(path)

    def temporary(self, what: str = "write") -> Path:
        """A new empty folder inside the root for building an entry (same file system, so
        that the final rename is atomic)."""
        self.root.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(prefix=f"{TEMPORARY_PREFIX}{os.getpid()}-{what}-",
                                     dir=self.root))

    @contextmanager
    def writing(self, name: str, source: dict[str, Any]) -> Iterator[Path]:
        """Build the entry ``name`` in the folder this yields; on leaving the block without
        an error, the manifest is written and the folder renamed into place (replacing an
        entry of that name). On an error, nothing of it stays."""
        check_name(name)
        self.clean()
        building = self.temporary()
        try:
            yield building
            self.commit(building, name, source)
        except BaseException:
            _remove(building)
            raise

    def commit(self, building: Path, name: str, source: dict[str, Any],
               created: float | None = None) -> Entry:
        """Write the manifest of the folder ``building`` (inside the root) and rename it into
        place as entry ``name``."""
        now = time.time()
        old = self.get(name)
        manifest = Manifest(name=name, source=source,
                            created=created if created is not None else
                            (old.manifest.created if old is not None else now),
                            modified=now, **describe_folder(building))
        manifest.size = folder_size(building)
        manifest.write(building / MANIFEST)
        building.chmod(0o755)  # a temporary folder is private; an entry is not
        _fsync_tree(building)
        home = self.path_of(name)
        aside = None
        if home.exists():
            aside = self.root / f"{ASIDE_PREFIX}{os.getpid()}-{home.name}"
            os.replace(home, aside)
        try:
            os.replace(building, home)
        except OSError:
            if aside is not None and not home.exists():
                os.replace(aside, home)  # the old entry stays
            raise
        _fsync_dir(self.root)
        if aside is not None:
            _remove(aside)
        return Entry(home, manifest)

    def remove(self, name: str) -> Entry:
        """Delete an entry: renamed to a temporary first, so it is gone from ``list`` at
        once and a kill mid-delete leaves a temporary, not a half entry."""
        entry = self.require(name)
        self.clean()
        doomed = self.root / f"{TEMPORARY_PREFIX}{os.getpid()}-rm-{entry.path.name}"
        os.replace(entry.path, doomed)
        _remove(doomed)
        return entry

    def copy(self, source_name: str, new_name: str) -> Entry:
        """A copy of entry ``source_name`` as ``new_name``."""
        entry = self.require(source_name)
        return self.add_folder(entry.path, new_name,
                               {**entry.manifest.source, "copied_from": source_name})

    def add_folder(self, folder: Path, name: str, source: dict[str, Any]) -> Entry:
        """A copy of the model folder ``folder`` as entry ``name`` (links followed: the entry
        holds the files themselves)."""
        with self.writing(name, source) as building:
            shutil.copytree(folder, building, dirs_exist_ok=True)
            (building / MANIFEST).unlink(missing_ok=True)
        entry = self.get(name)
        assert entry is not None
        return entry

    def partial(self, name: str) -> Path:
        """The resumable download folder of entry ``name``."""
        self.root.mkdir(parents=True, exist_ok=True)
        return self.root / f"{PARTIAL_PREFIX}{folder_name(name)}"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _fsync_tree(folder: Path) -> None:
    """Flush an entry's files before it is renamed into place, so that after a crash the
    name never points at files the disk has not got."""
    for path in folder.rglob("*"):
        if path.is_file():
            with open(path, "rb+") as f:
                os.fsync(f.fileno())
    for path in [folder, *[p for p in folder.rglob("*") if p.is_dir()]]:
        _fsync_dir(path)


_root: Path | None = None


def store_root() -> Path:
    """The store's root: ``MLXRUNNER_MODELS``, else ``~/.mlxrunner/models`` (read once)."""
    global _root
    if _root is None:
        configured = os.environ.get("MLXRUNNER_MODELS", "").strip()
        _root = Path(configured).expanduser() if configured else \
            Path.home() / ".mlxrunner" / "models"
    return _root


def default_store() -> Store:
    return Store(store_root())


def forget_root() -> None:
    """Read ``MLXRUNNER_MODELS`` again at the next use (tests that change it)."""
    global _root
    _root = None
