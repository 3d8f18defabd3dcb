"""Renderer choice order (argument, Modelfile, architecture default, jinja) and `run` without a
default model."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import mlxrunner

REPO = Path(__file__).resolve().parent.parent
FIXTURE = REPO / "plugins" / "example-architecture" / "tests" / "fixtures" / "tiny-example-llama"


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    pytest.importorskip("mlxrunner_example_architecture")
    pytest.importorskip("mlxrunner_renderer_qwen3_5")
    target = tmp_path / "m"
    shutil.copytree(FIXTURE, target)
    return target


def test_renderer_choice_order(folder: Path, monkeypatch):
    from mlxrunner_example_architecture.model import ExampleLlama

    # nothing named, no architecture default: the folder's own template through jinja
    assert mlxrunner.load(folder, use_draft=False).renderer_name == "jinja"
    # the architecture's default, when a plugin provides that renderer
    monkeypatch.setattr(ExampleLlama, "default_renderer", "qwen3.5", raising=False)
    assert mlxrunner.load(folder, use_draft=False).renderer_name == "qwen3.5"
    # the Modelfile's RENDERER beats the architecture
    (folder / "Modelfile").write_text("FROM .\nRENDERER gemma4-nemotron\n")
    assert mlxrunner.load(folder, use_draft=False).renderer_name == "gemma4-nemotron"
    # the argument beats everything
    bundle = mlxrunner.load(folder, renderer="gemma4-large", use_draft=False)
    assert bundle.renderer_name == "gemma4-large"


def test_run_without_model_or_default_says_what_to_do(tmp_path: Path):
    env = dict(os.environ, MLXRUNNER_LOAD_PLUGINS="")
    result = subprocess.run([sys.executable, "-m", "mlxrunner.cli", "run", "hello there"],
                            capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    assert result.returncode != 0
    err = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(err) == 1 and "registered as 'default'" in err[0]
    assert "mlxrunner run ./model" in err[0] and "plugins/demo" in err[0]


def test_show_names_the_chosen_renderer(folder: Path, tmp_path: Path):
    (folder / "Modelfile").write_text("FROM .\nRENDERER qwen3.5\n")
    result = subprocess.run([sys.executable, "-m", "mlxrunner.cli", "show", str(folder),
                             "--json"], capture_output=True, text=True, cwd=tmp_path,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["renderer"] == "qwen3.5" and info["parser"] == "qwen3.5"


@pytest.mark.parametrize("name,close", [("llama3.2", None), ("qwen3:0.6b", None),
                                        ("mysmoll", "mysmol"), ("smolm2:135m", "smollm2:135m")])
def test_an_unknown_model_name_is_one_line_not_a_prompt(tmp_path: Path, name, close):
    """``run NAME`` (one word, as ``ollama run NAME``) never runs the default model with the
    name as its prompt: an unknown name is one line naming the closest known names."""
    store = tmp_path / "store"
    env = dict(os.environ, MLXRUNNER_MODELS=str(store))
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    made = subprocess.run([sys.executable, "-m", "mlxrunner.cli", "cp", str(folder), "mysmol"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert made.returncode == 0, made.stderr
    result = subprocess.run([sys.executable, "-m", "mlxrunner.cli", "run", name],
                            capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120,
                            stdin=subprocess.DEVNULL)
    err = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode != 0 and result.stdout == ""
    assert len(err) == 1 and f"unknown model {name!r}" in err[0], err
    assert "stored: mysmol" in err[0] and "mlxrunner pull" in err[0]
    assert (f"did you mean {close}" in err[0]) if close else "did you mean" not in err[0]
