"""The Gemma 4 vision tower and ``embed_vision`` against transformers' committed outputs.

Reference: ``Gemma4ForConditionalGeneration().model`` on CPU torch float32
(tests/make_vision_fixtures.py, folder ``vision_fixtures/tiny_vision``): for one image, and
for a tall and a wide image padded into one batch, the encoder's output (before pooling),
the tower's soft tokens (``vision_tower(...).last_hidden_state``: pooled, scaled,
standardized) and ``get_image_features``' projection into the text width
(``embed_vision``). Ours runs float32 on the CPU; max abs difference <= 1e-4 for all three
(the outputs are O(1-40); dropping any norm, the clipping, the RoPE, its x/y order, the
position table or the standardization moves them by 0.3 or more, the attention scaled by
1/sqrt(head_dim) by 4, padding rows attended by 4, a tanh GELU made exact by 1e-3 or more).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path
from types import ModuleType

import mlx.core as mx
import mlxrunner_gemma4
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlxrunner_gemma4.vision import Gemma4Vision, VisionConfig, load_vision

from mlxrunner.plugin import ModelFolderError

mx.set_default_device(mx.cpu)

HERE = Path(__file__).resolve().parent
FOLDER = HERE / "vision_fixtures" / "tiny_vision"
TEXT_ONLY = [HERE / "fixtures" / name for name in ("e2b", "dense", "moe")]
CASES = ("one_image", "two_images")
TOLERANCE = 1e-4  # float32 against transformers (CPU torch, float32): max abs difference
OUTPUTS = ("encoder", "pooled", "embeds")

# a vision_config of E2B's shape: transformers' Gemma4VisionConfig defaults, clipped linears
E2B_VISION_CONFIG = {
    "model_type": "gemma4_vision", "hidden_size": 768, "intermediate_size": 3072,
    "num_hidden_layers": 16, "num_attention_heads": 12, "num_key_value_heads": 12,
    "head_dim": 64, "hidden_activation": "gelu_pytorch_tanh", "rms_norm_eps": 1e-06,
    "patch_size": 16, "pooling_kernel_size": 3, "position_embedding_size": 10240,
    "rope_parameters": {"rope_type": "default", "rope_theta": 100.0},
    "standardize": False, "use_clipped_linears": True,
}


@pytest.fixture(scope="module")
def reference() -> dict[str, np.ndarray]:
    with np.load(FOLDER / "reference.npz") as data:
        return dict(data)


@pytest.fixture(scope="module")
def tower() -> Gemma4Vision:
    model = load_vision(FOLDER)
    assert model is not None
    return model


def outputs(model: Gemma4Vision, ref: dict[str, np.ndarray], case: str
            ) -> dict[str, mx.array]:
    pixels, positions = ref[f"{case}_pixels"], ref[f"{case}_positions"]
    return {"encoder": model.hidden_states(pixels, positions),
            "pooled": model.soft_tokens(pixels, positions),
            "embeds": model(pixels, positions)}


def max_errors(model: Gemma4Vision, ref: dict[str, np.ndarray], case: str
               ) -> dict[str, float]:
    ours = outputs(model, ref, case)
    return {key: float(np.abs(np.array(ours[key].astype(mx.float32)) - ref[f"{case}_{key}"])
                       .max()) for key in OUTPUTS}


def test_fixture_is_small_and_covers_the_cases(reference, tower):
    assert sum(p.stat().st_size for p in FOLDER.iterdir()) < 1024 * 1024
    config = json.loads((FOLDER / "config.json").read_text())
    assert config["audio_config"] is None and config["vision_config"]["standardize"]
    assert config["vision_config"]["use_clipped_linears"]
    assert reference["one_image_pixels"].shape == (1, 24, 48)
    assert reference["two_images_pixels"].shape == (2, 20, 48)
    assert tower.soft_token_counts(reference["one_image_positions"]) == [6]
    # a 6 x 2 and a 2 x 8 patch grid, padded to 20 rows each
    assert tower.soft_token_counts(reference["two_images_positions"]) == [3, 4]
    assert reference["two_images_embeds"].shape == (7, 32)
    # the package's lazy names
    assert (mlxrunner_gemma4.load_vision, mlxrunner_gemma4.Gemma4Vision) == (load_vision,
                                                                             Gemma4Vision)


@pytest.mark.parametrize("case", CASES)
def test_matches_transformers(case, tower, reference):
    ours = outputs(tower, reference, case)
    assert all(value.dtype == mx.float32 for value in ours.values())
    assert ours["embeds"].shape == (ours["pooled"].shape[0], tower.config.text_hidden_size)
    errors = max_errors(tower, reference, case)
    assert max(errors.values()) <= TOLERANCE, errors


def test_images_come_out_as_they_do_alone(tower, reference):
    """Each image of the padded batch comes out as it does alone, with or without padding
    rows (attention and pooling per image, padding never attended)."""
    pixels, positions = reference["two_images_pixels"], reference["two_images_positions"]
    together = np.array(tower(pixels, positions))
    alone = []
    for i, n in enumerate((12, 16)):
        assert (positions[i, n:] == -1).all() and (positions[i, :n] >= 0).all()
        alone.append(np.array(tower(pixels[i, :n], positions[i, :n])))  # one image, 2-D
    assert np.abs(np.concatenate(alone) - together).max() <= 1e-6
    # the rows in another order (positions travel with them): the same soft tokens
    order = np.random.default_rng(0).permutation(20)
    shuffled = np.array(tower(pixels[:1, order], positions[:1, order]))
    assert np.abs(shuffled - together[:3]).max() <= 1e-5


def test_text_only_checkpoints_have_no_vision_tower(tmp_path):
    for folder in TEXT_ONLY:
        assert load_vision(folder) is None, folder
    config = json.loads((FOLDER / "config.json").read_text())
    # a composite config whose safetensors hold no vision tensor (a text-only conversion)
    folder = tmp_path / "composite"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    text = {k: v for k, v in mx.load(str(FOLDER / "model.safetensors")).items()
            if ".language_model." in k}
    mx.save_safetensors(str(folder / "model.safetensors"), text)
    assert load_vision(folder) is None
    # vision_config null, as transformers writes a missing tower
    shutil.copy(FOLDER / "model.safetensors", folder)
    (folder / "config.json").write_text(json.dumps({**config, "vision_config": None}))
    assert load_vision(folder) is None


def vision_tensors() -> dict[str, mx.array]:
    return {k: v for k, v in mx.load(str(FOLDER / "model.safetensors")).items()
            if k.startswith(("model.vision_tower.", "model.embed_vision."))}


def test_other_layouts_load_the_same(tmp_path, tower, reference):
    """A sharded folder of the Hub's names, and mlx-vlm's names (no ``model.``)."""
    pixels, positions = reference["one_image_pixels"], reference["one_image_positions"]
    expected = tower(pixels, positions)
    vision = vision_tensors()
    folder = tmp_path / "sharded"
    folder.mkdir()
    shutil.copy(FOLDER / "config.json", folder)
    names = sorted(vision)
    shards = {"model-00001.safetensors": names[: len(names) // 2],
              "model-00002.safetensors": names[len(names) // 2:]}
    for shard, keys in shards.items():
        mx.save_safetensors(str(folder / shard), {k: vision[k] for k in keys})
    weight_map = {k: shard for shard, keys in shards.items() for k in keys}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    model = load_vision(folder)
    assert model is not None
    assert mx.array_equal(model(pixels, positions), expected)

    weight_map[names[0]] = "../model-00001.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ModelFolderError, match="outside the model folder"):
        load_vision(folder)

    folder = tmp_path / "mlx_vlm"
    folder.mkdir()
    shutil.copy(FOLDER / "config.json", folder)
    mx.save_safetensors(str(folder / "model.safetensors"),
                        {k[len("model."):]: v for k, v in vision.items()})
    model = load_vision(folder)
    assert model is not None
    assert mx.array_equal(model(pixels, positions), expected)


def test_unclipped_linears(tmp_path, tower, reference):
    """``use_clipped_linears: false`` reads no bounds and clamps nothing: the fixture's
    weights without their bounds give what the fixture gives with every bound infinite."""
    folder = tmp_path / "unclipped"
    folder.mkdir()
    config = json.loads((FOLDER / "config.json").read_text())
    config["vision_config"]["use_clipped_linears"] = False
    (folder / "config.json").write_text(json.dumps(config))
    bounds = ("input_min", "input_max", "output_min", "output_max")
    mx.save_safetensors(str(folder / "model.safetensors"),
                        {k: v for k, v in vision_tensors().items() if not k.endswith(bounds)})
    model = load_vision(folder)
    assert model is not None
    clipped = load_vision(FOLDER)
    assert clipped is not None
    clipped.load_weights([(k, mx.array(-np.inf if k.endswith("_min") else np.inf))
                          for k, _ in tree_flatten(clipped.parameters()) if k.endswith(bounds)],
                         strict=False)
    pixels, positions = reference["one_image_pixels"], reference["one_image_positions"]
    unclipped = np.array(model(pixels, positions))
    assert np.abs(unclipped - np.array(clipped(pixels, positions))).max() <= 1e-6
    assert np.abs(unclipped - np.array(tower(pixels, positions))).max() > 0.1


def test_bfloat16_runs(reference):
    model = load_vision(FOLDER, mx.bfloat16)
    assert model is not None
    embeds = model(reference["one_image_pixels"], reference["one_image_positions"])
    assert embeds.dtype == mx.bfloat16
    # bfloat16 rounding through two layers: a few hundredths on values up to 3
    assert np.abs(np.array(embeds.astype(mx.float32))
                  - reference["one_image_embeds"]).max() < 0.2


def test_truncated_or_mismatched_weights_are_refused(tmp_path):
    folder = tmp_path / "truncated"
    folder.mkdir()
    shutil.copy(FOLDER / "config.json", folder)
    data = (FOLDER / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[:-100])
    with pytest.raises(ModelFolderError, match="model.safetensors"):
        load_vision(folder)

    folder = tmp_path / "mismatched"
    folder.mkdir()
    shutil.copy(FOLDER / "model.safetensors", folder)
    config = json.loads((FOLDER / "config.json").read_text())
    config["vision_config"]["intermediate_size"] = 48
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelFolderError, match="has shape"):
        load_vision(folder)


def test_e2b_config_and_defaults():
    cfg = VisionConfig.from_dict(E2B_VISION_CONFIG, 1536)
    assert (cfg.hidden_size, cfg.head_dim, cfg.num_key_value_heads) == (768, 64, 12)
    assert cfg.patch_dim == 768 and cfg.pooling_kernel_size == 3
    assert cfg.rope_theta == 100.0 and cfg.use_clipped_linears and not cfg.standardize
    assert cfg.text_hidden_size == 1536
    assert VisionConfig.from_dict({}) == VisionConfig()  # transformers' defaults
    model = Gemma4Vision(dict(E2B_VISION_CONFIG, num_hidden_layers=1), 64)
    # 1 / 100^(2i / 32) for i < 16: a quarter of the head per axis
    assert np.allclose(model.inv_freq, 100.0 ** (-np.arange(0, 32, 2) / 32), rtol=1e-6)


@pytest.mark.parametrize("change, match", [
    ({"hidden_activation": "relu"}, "hidden_activation"),
    ({"rope_parameters": {"rope_type": "yarn"}}, "axial"),
    ({"rope_parameters": {"rope_theta": -1.0}}, "rope_theta"),
    ({"head_dim": 18}, "multiple of 4"),
    ({"num_attention_heads": 0}, "num_attention_heads"),
    ({"num_key_value_heads": 5}, "multiple"),
    ({"pooling_kernel_size": 0}, "pooling_kernel_size"),
    ({"patch_size": "16"}, "patch_size"),
    ({"position_embedding_size": 2**21}, "position_embedding_size"),
    ({"use_clipped_linears": "yes"}, "use_clipped_linears"),
    ({"rms_norm_eps": 0}, "rms_norm_eps"),
])
def test_bad_configs_are_refused(change, match):
    with pytest.raises(ModelFolderError, match=match):
        VisionConfig.from_dict({**E2B_VISION_CONFIG, **change})


@pytest.mark.parametrize("section, change, match", [
    ("vision_config", {"num_hidden_layers": 10**6}, "vision_config: num_hidden_layers"),
    ("text_config", {"hidden_size": 0}, "text_config: hidden_size"),
])
def test_a_bad_folder_config_is_one_error(tmp_path, section, change, match):
    config = json.loads((FOLDER / "config.json").read_text())
    config[section].update(change)
    (tmp_path / "config.json").write_text(json.dumps(config))
    shutil.copy(FOLDER / "model.safetensors", tmp_path)
    with pytest.raises(ModelFolderError, match=match) as raised:
        load_vision(tmp_path)
    assert "\n" not in str(raised.value)


def test_bad_inputs_are_refused(tower, reference):
    pixels, positions = reference["one_image_pixels"], reference["one_image_positions"]
    with pytest.raises(ValueError, match="pixel_values must be"):
        tower(pixels[:, :20], positions)
    with pytest.raises(ValueError, match="position_ids must be"):
        tower(pixels, positions.astype(np.float32))
    with pytest.raises(ValueError, match="pooling_kernel_size"):  # a 4 x 3 grid, k = 2
        keep = positions[0, :, 0] < 3
        tower(pixels[:, keep], positions[:, keep])
    holed = positions.copy()
    holed[0, 5] = holed[0, 4]  # one cell twice, another never
    with pytest.raises(ValueError, match="tile"):
        tower(pixels, holed)
    with pytest.raises(ValueError, match="no patch"):
        tower(pixels, np.full_like(positions, -1))
    far = positions.copy()
    far[0, :, 0] += 16
    with pytest.raises(ValueError, match="position table"):
        tower(pixels, far)


def make_vision_fixtures() -> ModuleType:
    path = HERE / "make_vision_fixtures.py"
    spec = importlib.util.spec_from_file_location("gemma4_make_vision_fixtures", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.reference
def test_regenerated_fixture_matches_committed_and_ours(tmp_path, reference):
    """make_vision_fixtures.py, run now with torch, writes the committed reference (inputs
    equal, outputs within 1e-4: another CPU sums float32 in another order), and ours on the
    regenerated checkpoint matches its outputs within 1e-4."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    folder = tmp_path / "tiny_vision"
    make_vision_fixtures().write_fixture(folder)
    with np.load(folder / "reference.npz") as data:
        fresh = dict(data)
    assert sorted(fresh) == sorted(reference)
    for key, value in fresh.items():
        if key.endswith(("_pixels", "_positions")):
            assert np.array_equal(value, reference[key]), key
        else:
            assert np.abs(value - reference[key]).max() <= TOLERANCE, key
    model = load_vision(folder)
    assert model is not None
    for case in CASES:
        errors = max_errors(model, fresh, case)
        assert max(errors.values()) <= TOLERANCE, (case, errors)
