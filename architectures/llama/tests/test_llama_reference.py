"""Independent references run live (skipped without torch and transformers, or mlx-lm).

- The committed fixtures are what make_fixtures.py writes today (regenerated with torch into
  a temporary folder), and our logits match the regenerated outputs (< 1e-4).
- transformers' own cached decode (its DynamicCache, token by token) gives the rows ours do.
- mlx-lm's ``llama`` (0.32.2) on the same checkpoints gives the same logits as ours.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path
from types import ModuleType

import mlx.core as mx
import numpy as np
import pytest

import mlxrunner

mx.set_default_device(mx.cpu)

HERE = Path(__file__).resolve().parent
FIXTURES = HERE / "fixtures"
NAMES = ("tied_llama3", "untied_bias_linear", "mistral_gqa4_yarn")
TOLERANCE = 1e-4

pytestmark = pytest.mark.reference


def make_fixtures() -> ModuleType:
    spec = importlib.util.spec_from_file_location("llama_make_fixtures", HERE / "make_fixtures.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", NAMES)
def test_regenerated_fixture_matches_committed_and_ours(name, tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    maker = make_fixtures()
    folder = maker.write_fixture(name, tmp_path / name)
    model = mlxrunner.load_model(folder)
    with np.load(folder / "reference.npz") as fresh, \
            np.load(FIXTURES / name / "reference.npz") as committed:
        assert sorted(fresh.files) == sorted(committed.files)
        for key in fresh.files:
            # within the parity tolerance: another CPU sums float32 in another order
            # (seen up to 1.5e-5 between two machines)
            np.testing.assert_allclose(fresh[key], committed[key], rtol=0, atol=TOLERANCE,
                                       err_msg=key)
        for n in maker.PROMPT_LENGTHS:
            logits = np.array(model(mx.array(fresh[f"ids_{n}"]))[0])
            assert np.abs(logits - fresh[f"logits_{n}"]).max() < TOLERANCE


@pytest.mark.parametrize("name", NAMES)
def test_decode_matches_transformers_own_cached_decode(name):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    theirs = make_fixtures().build_model(name)
    ids = np.load(FIXTURES / name / "reference.npz")["ids_40"]
    with torch.no_grad():
        out = theirs(input_ids=torch.from_numpy(ids[:, :10]).long(), use_cache=True)
        rows, past = [out.logits[0].numpy()], out.past_key_values
        for t in range(10, 40):
            out = theirs(input_ids=torch.from_numpy(ids[:, t:t + 1]).long(), cache=past,
                         use_cache=True)
            rows.append(out.logits[0].numpy())
            past = out.past_key_values
    expected = np.concatenate(rows)
    model = mlxrunner.load_model(FIXTURES / name)
    cache = model.make_cache()
    ours = [model(mx.array(ids[:, :10]), cache)]
    ours += [model(mx.array(ids[:, t:t + 1]), cache) for t in range(10, 40)]
    got = np.array(mx.concatenate(ours, axis=1)[0])
    assert np.abs(got - expected).max() < TOLERANCE


def legacy_rope_folder(name: str, folder: Path) -> Path:
    """The fixture with transformers 4's spelling (``rope_scaling`` beside ``rope_theta``):
    mlx-lm 0.32 reads only that one (it ignores ``rope_parameters``)."""
    shutil.copytree(FIXTURES / name, folder)
    cfg = json.loads((folder / "config.json").read_text())
    rope = dict(cfg.pop("rope_parameters"))
    cfg["rope_theta"] = rope.pop("rope_theta")
    cfg["rope_scaling"] = rope
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


@pytest.mark.parametrize("name", NAMES)
def test_matches_mlx_lm(name, tmp_path):
    pytest.importorskip("mlx_lm")
    from mlx_lm.utils import load_model as mlx_lm_load_model

    folder = legacy_rope_folder(name, tmp_path / name)
    theirs, _ = mlx_lm_load_model(folder)
    ours = mlxrunner.load_model(folder)
    ids = mx.array(np.load(FIXTURES / name / "reference.npz")["ids_40"])
    assert float(mx.abs(ours(ids) - theirs(ids)).max()) < 1e-5
    assert float(mx.abs(ours(ids) - mlxrunner.load_model(FIXTURES / name)(ids)).max()) == 0
