"""The example plugin, installed from its folder like a third party's, works through the CLI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlxrunner_test_support import write_model_folder

REPO = Path(__file__).resolve().parent.parent
PLUGIN = REPO / "plugins" / "example-architecture"


@pytest.fixture(scope="module")
def installed_site(tmp_path_factory) -> Path:
    if not (PLUGIN / "pyproject.toml").exists():
        pytest.skip("plugins/example-architecture is absent")
    site = tmp_path_factory.mktemp("site")
    result = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--target", str(site), str(PLUGIN)], capture_output=True, text=True, timeout=600)
    if result.returncode != 0 and "setuptools" in result.stderr:
        pytest.skip("setuptools is not available for a no-isolation build")
    assert result.returncode == 0, result.stderr
    return site


def cli(site: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(site))
    env.pop("MLXRUNNER_LOAD_PLUGINS", None)
    return subprocess.run([sys.executable, "-m", "mlxrunner.cli", *args], capture_output=True,
                          text=True, cwd=cwd, env=env, timeout=300)


def test_installed_plugin_is_listed_and_generates(installed_site, tmp_path):
    env = dict(os.environ, PYTHONPATH=str(installed_site))
    where = subprocess.run([sys.executable, "-c",
                            "import mlxrunner_example_architecture as m; print(m.__file__)"],
                           capture_output=True, text=True, env=env, check=True).stdout
    assert str(installed_site) in where  # the freshly installed copy is the one that loads

    listing = json.loads(cli(installed_site, "plugins", cwd=tmp_path).stdout)
    example = [p for p in listing if p["distribution"] == "mlxrunner-example-architecture"]
    assert example and "register_architectures" in example[0]["hooks"]

    archs = json.loads(cli(installed_site, "architectures", "--json", cwd=tmp_path).stdout)
    assert {"name": "ExampleLlamaForCausalLM", "plugin": example[0]["plugin"]} in archs

    folder = write_model_folder(tmp_path / "model")
    result = cli(installed_site, "run", str(folder), "def add", "--max-tokens", "12",
                 "--temperature", "0", "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    out = json.loads(result.stdout)
    assert len(out["tokens"]) >= 1 and out["statistics"]["run"]["generated_tokens"] == len(
        out["tokens"])
    assert all(0 <= t < 320 for t in out["tokens"])


def _requirement_module(requirement: str) -> str:
    """``"hypothesis>=6"`` -> ``"hypothesis"``; ``"mlx[cpu]>=0.32; ..."`` -> ``"mlx"``."""
    import re

    name = re.split(r"[\s<>=!~;\[]", requirement.strip(), maxsplit=1)[0]
    return name.lower().replace("-", "_")


def _imported_modules(path: Path) -> set[str]:
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found.add(node.module.split(".")[0])
    return found


def test_the_readme_install_brings_what_the_plugins_tests_import():
    """After the README's install (the plugin with its `test` extra) its tests run: every
    module they import is the standard library's, the plugin's, mlxrunner's or one of its
    dependencies, or named by the `test` extra; and the README says how to run them."""
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((PLUGIN / "pyproject.toml").read_text())["project"]
    core = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    provided = {_requirement_module(r) for r in
                [*project["dependencies"], *project["optional-dependencies"]["test"],
                 *core["dependencies"]]}
    provided |= set(sys.stdlib_module_names) | {"mlxrunner", "mlxrunner_example_architecture",
                                                "__future__"}
    tests = sorted((PLUGIN / "tests").glob("test_*.py"))
    assert tests
    missing = {path.name: sorted(_imported_modules(path) - provided) for path in tests}
    assert {name: mods for name, mods in missing.items() if mods} == {}

    readme = (PLUGIN / "README.md").read_text()
    install = readme.split("## Install and try", 1)[1].split("\n## ", 1)[0]
    assert '"plugins/example-architecture[test]"' in install
    assert "pytest --import-mode=importlib tests" in install
