"""Independent references run live: transformers (CPU torch) and mlx-lm.

- The committed fixtures are what make_fixtures.py writes today (regenerated with torch
  into a temporary folder), and our logits match the regenerated outputs (< 1e-4).
- Our bf16/fp16 runs are no further from float32 than transformers' own half runs.
- mlx-lm's ``qwen3_5`` (0.32.2) on the same checkpoints, in the composite Hub layout it
  loads, gives the same logits as ours (float32, < 1e-4), in one forward and when decoding.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import mlx.core as mx
import numpy as np
import pytest

mx.set_default_device(mx.cpu)

HERE = Path(__file__).resolve().parent
FIXTURES = HERE / "fixtures"
FIXTURE_NAMES = sorted(p.name for p in FIXTURES.iterdir() if (p / "config.json").is_file())
TOLERANCE = 1e-4

pytestmark = pytest.mark.reference


def make_fixtures() -> ModuleType:
    path = HERE / "make_fixtures.py"
    spec = importlib.util.spec_from_file_location("qwen3_5_make_fixtures", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_regenerated_fixture_matches_committed_and_ours(name, tmp_path, load_folder):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    folder = tmp_path / name
    make_fixtures().write_fixture(name, folder)
    with np.load(folder / "reference.npz") as fresh, \
            np.load(FIXTURES / name / "reference.npz") as committed:
        assert sorted(fresh.files) == sorted(committed.files)
        for key in fresh.files:
            # within the parity tolerance: another CPU sums float32 in another order
            # (seen up to 1.5e-5 between two machines)
            assert np.abs(fresh[key] - committed[key]).max() < TOLERANCE, key
        model = load_folder(folder)
        for n in (1, 7, 130):
            logits = np.array(model(mx.array(fresh[f"ids_{n}"]))[0])
            assert np.abs(logits - fresh[f"logits_{n}"]).max() < TOLERANCE


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
def test_half_precision_no_worse_than_transformers(dtype_name, fixture_model, reference):
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    name = "tiny_hk2_hv4_tied"
    ref = reference(name)
    torch_model = make_fixtures().build_model(name).to(getattr(torch, dtype_name))
    with torch.no_grad():
        theirs = torch_model(input_ids=torch.from_numpy(ref["ids_130"]).long(),
                             use_cache=False).logits[0].float().numpy()
    ours = fixture_model(name, getattr(mx, dtype_name))(mx.array(ref["ids_130"]))
    ours = np.array(ours[0].astype(mx.float32))
    err_theirs = np.abs(theirs - ref["logits_130"]).max()
    err_ours = np.abs(ours - ref["logits_130"]).max()
    assert err_ours < 2 * err_theirs, (err_ours, err_theirs)


def composite_hub_folder(name: str, folder: Path) -> Path:
    """Hub layout (what mlx-lm loads): composite config, text weights model.language_model.*."""
    text = json.loads((FIXTURES / name / "config.json").read_text())
    # mlx-lm 0.32 ignores layer_types and reads full_attention_interval only.
    types = text["layer_types"]
    interval = types.index("full_attention") + 1
    if any((t == "full_attention") != ((i + 1) % interval == 0) for i, t in enumerate(types)):
        pytest.skip(f"mlx-lm cannot express the layer pattern {types}")
    text["full_attention_interval"] = interval
    folder.mkdir(parents=True)
    config = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
              "tie_word_embeddings": text["tie_word_embeddings"], "text_config": text}
    (folder / "config.json").write_text(json.dumps(config))
    weights = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
               for k, v in mx.load(str(FIXTURES / name / "model.safetensors")).items()}
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    return folder


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_matches_mlx_lm(name, tmp_path, fixture_model, reference):
    pytest.importorskip("mlx_lm")
    from mlx_lm.utils import load_model as mlx_lm_load_model

    folder = composite_hub_folder(name, tmp_path / "hub")
    theirs, _ = mlx_lm_load_model(folder)
    ours = fixture_model(name)
    ref = reference(name)
    for n in (7, 130):
        ids = mx.array(ref[f"ids_{n}"])
        assert float(mx.abs(ours(ids) - theirs(ids)).max()) < TOLERANCE
    # prefill + decode through each side's own caches
    ids = mx.array(ref["ids_130"][:, :40])
    our_cache, their_cache = ours.make_cache(), theirs.make_cache()
    a = [ours(ids[:, :30], our_cache)] + [ours(ids[:, t:t + 1], our_cache) for t in range(30, 40)]
    b = [theirs(ids[:, :30], cache=their_cache)] + [theirs(ids[:, t:t + 1], cache=their_cache)
                                                    for t in range(30, 40)]
    assert float(mx.abs(mx.concatenate(a, axis=1) - mx.concatenate(b, axis=1)).max()) < TOLERANCE


def test_bfloat16_folder_computed_in_float32_matches_transformers(tmp_path, load_folder):
    """A bf16 checkpoint run in float32: the zero-centred norms' ``1 + w`` is formed in
    float32 from the bf16 ``w`` (as transformers does), not rounded to bf16 first."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    name = "tiny_hk2_hv4_tied"
    folder = tmp_path / name
    torch_model = make_fixtures().build_model(name)
    with torch.no_grad():  # norm weights far from zero, where 1 + w in bf16 would round
        for param_name, param in torch_model.named_parameters():
            if param_name.endswith("norm.weight"):
                param.uniform_(-0.7, 0.7)
    torch_model.to(torch.bfloat16).save_pretrained(folder, safe_serialization=True)
    theirs_model = torch_model.float()  # the same bf16 values, computed in float32
    ids = np.arange(1, 41, dtype=np.int64)[None] % theirs_model.config.vocab_size
    with torch.no_grad():
        theirs = theirs_model(input_ids=torch.from_numpy(ids), use_cache=False).logits[0]
    ours = load_folder(folder, mx.float32)(mx.array(ids.astype(np.int32)))
    assert ours.dtype == mx.float32
    diff = np.abs(np.array(ours[0]) - theirs.numpy()).max()
    assert diff < TOLERANCE, diff
