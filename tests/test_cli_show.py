"""`mlxrunner show`: the target's precision on its own line, independent of a quantized draft's."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

demo = pytest.importorskip("mlxrunner_demo", reason="the demo plugin is not installed")


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("MLXRUNNER_LOAD_PLUGINS", None)
    return subprocess.run([sys.executable, "-m", "mlxrunner.cli", *args], capture_output=True,
                          text=True, cwd=cwd, env=env, timeout=300)


def test_show_reports_target_and_quantized_draft_precision_apart(tmp_path):
    import mlxrunner
    from mlxrunner import host as plugins

    source = Path(plugins.host().registry("models")["demo-qwen3.5"].obj)
    folder = tmp_path / "pair"
    shutil.copytree(source, folder)
    bundle = mlxrunner.load(folder)
    draft = bundle.draft
    assert draft is not None
    nn.quantize(draft, group_size=32, bits=4,
                class_predicate=lambda p, m: isinstance(m, nn.Linear)
                and m.weight.shape[-1] % 32 == 0)
    # The draft's own tensors only: it borrows the target's embedding and head.
    weights = {k: v for k, v in tree_flatten(draft.parameters())
               if not k.startswith("target.")}
    mx.save_safetensors(str(folder / "draft" / "model.safetensors"), weights)
    config = json.loads((folder / "draft" / "config.json").read_text())
    config["quantization"] = {"group_size": 32, "bits": 4}
    (folder / "draft" / "config.json").write_text(json.dumps(config))

    result = cli("show", str(folder), "--json", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    target_precision = bundle.model.weight_precision
    assert info["target_precision"] == target_precision and "bit" not in target_precision
    assert info["draft_precision"] == "4-bit affine"

    text = cli("show", str(folder), cwd=tmp_path).stdout.splitlines()
    stored = info["target_stored_precision"]
    assert f"target precision  {stored} (stored), computed in {target_precision}" in text
    assert f"draft precision   4-bit affine (stored), computed in {info['draft_compute_dtype']}" \
        in text
