"""The Qwen3.5 vision tower against transformers' committed reference outputs.

Reference: ``Qwen3_5ForConditionalGeneration().model.visual`` on CPU torch float32
(tests/make_vision_fixtures.py, folder ``vision_fixtures/tiny_vl``): for one image, two
images of other sizes together, and two frames of one clip, the blocks' output
(``last_hidden_state``) and the merger's (``pooler_output``). Ours runs float32 on the CPU;
max abs difference <= 1e-4 for both (the outputs are O(1-10); a tanh GELU where the
merger's is exact moves them by about 1e-3, attention across images by several units).
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
from mlxrunner_qwen3_5.vision import Qwen3_5Vision, VisionConfig, load_vision

from mlxrunner.plugin import ModelFolderError

mx.set_default_device(mx.cpu)

HERE = Path(__file__).resolve().parent
FOLDER = HERE / "vision_fixtures" / "tiny_vl"
TEXT_ONLY = HERE / "fixtures" / "tiny_hk2_hv4_tied"
CASES = ("one_image", "two_images", "two_frames")
TOLERANCE = 1e-4  # float32 against transformers (CPU torch, float32): max abs difference

# config.json's vision_config of Qwen/Qwen3.5-0.8B (no rope_parameters: base 10000)
HUB_VISION_CONFIG = {
    "deepstack_visual_indexes": [], "depth": 12, "hidden_act": "gelu_pytorch_tanh",
    "hidden_size": 768, "in_channels": 3, "initializer_range": 0.02,
    "intermediate_size": 3072, "model_type": "qwen3_5_vision", "num_heads": 12,
    "num_position_embeddings": 2304, "out_hidden_size": 1024, "patch_size": 16,
    "spatial_merge_size": 2, "temporal_patch_size": 2,
}


@pytest.fixture(scope="module")
def reference() -> dict[str, np.ndarray]:
    with np.load(FOLDER / "reference.npz") as data:
        return dict(data)


@pytest.fixture(scope="module")
def tower() -> Qwen3_5Vision:
    model = load_vision(FOLDER)
    assert model is not None
    return model


def grid_of(ref: dict[str, np.ndarray], case: str) -> list[tuple[int, int, int]]:
    return [(int(t), int(h), int(w)) for t, h, w in ref[f"{case}_grid"]]


def max_errors(model: Qwen3_5Vision, ref: dict[str, np.ndarray], case: str
               ) -> tuple[float, float]:
    patches, grid = mx.array(ref[f"{case}_patches"]), grid_of(ref, case)
    hidden = model.hidden_states(patches, grid)
    merged = model(patches, grid)
    assert hidden.dtype == merged.dtype == mx.float32
    assert merged.shape == (patches.shape[0] // 4, model.config.out_hidden_size)
    return (float(np.abs(np.array(hidden) - ref[f"{case}_hidden"]).max()),
            float(np.abs(np.array(merged) - ref[f"{case}_merged"]).max()))


def test_fixture_is_small_and_covers_the_cases(reference):
    assert sum(p.stat().st_size for p in FOLDER.iterdir()) < 1024 * 1024
    assert grid_of(reference, "one_image") == [(1, 4, 6)]
    assert grid_of(reference, "two_images") == [(1, 4, 4), (1, 2, 6)]
    assert grid_of(reference, "two_frames") == [(2, 2, 4)]


@pytest.mark.parametrize("case", CASES)
def test_matches_transformers(case, tower, reference):
    hidden_err, merged_err = max_errors(tower, reference, case)
    assert hidden_err <= TOLERANCE, hidden_err
    assert merged_err <= TOLERANCE, merged_err


def test_images_do_not_see_each_other(tower, reference):
    """Each image of a batch comes out as it does alone (attention and positions per image)."""
    patches, grid = mx.array(reference["two_images_patches"]), grid_of(reference, "two_images")
    together = np.array(tower(patches, grid))
    first = 4 * 4
    alone = [np.array(tower(patches[:first], grid[:1])),
             np.array(tower(patches[first:], grid[1:]))]
    assert np.abs(np.concatenate(alone) - together).max() <= TOLERANCE


def test_text_only_checkpoints_have_no_vision_tower(tmp_path):
    assert load_vision(TEXT_ONLY) is None
    # a composite config whose safetensors hold no model.visual.* tensor
    folder = tmp_path / "composite"
    folder.mkdir()
    config = json.loads((FOLDER / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps(config))
    text = {k: v for k, v in mx.load(str(FOLDER / "model.safetensors")).items()
            if not k.startswith("model.visual.")}
    mx.save_safetensors(str(folder / "model.safetensors"), text)
    assert load_vision(folder) is None


def test_a_sharded_folder_loads_the_same(tmp_path, tower, reference):
    folder = tmp_path / "sharded"
    folder.mkdir()
    shutil.copy(FOLDER / "config.json", folder)
    weights = mx.load(str(FOLDER / "model.safetensors"))
    vision = {k: v for k, v in weights.items() if k.startswith("model.visual.")}
    names = sorted(vision)
    shards = {"model-00001.safetensors": names[: len(names) // 2],
              "model-00002.safetensors": names[len(names) // 2:]}
    for shard, keys in shards.items():
        mx.save_safetensors(str(folder / shard), {k: vision[k] for k in keys})
    weight_map = {k: shard for shard, keys in shards.items() for k in keys}
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    model = load_vision(folder)
    assert model is not None
    patches, grid = mx.array(reference["one_image_patches"]), grid_of(reference, "one_image")
    assert mx.array_equal(model(patches, grid), tower(patches, grid))

    weight_map[names[0]] = "../model-00001.safetensors"
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ModelFolderError, match="outside the model folder"):
        load_vision(folder)

    weight_map[names[0]] = "missing.safetensors"  # a broken folder: one clear error
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ModelFolderError, match="missing"):
        load_vision(folder)


def test_truncated_weights_are_refused(tmp_path):
    folder = tmp_path / "truncated"
    folder.mkdir()
    shutil.copy(FOLDER / "config.json", folder)
    data = (FOLDER / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[:-100])
    with pytest.raises(ModelFolderError, match="model.safetensors"):
        load_vision(folder)


def test_channels_last_patch_kernel_is_converted(tower):
    """An MLX-converted folder's Conv3d kernel ``[D, T, P, P, C]`` gives the same map."""
    kernel = mx.load(str(FOLDER / "model.safetensors"))["model.visual.patch_embed.proj.weight"]
    assert kernel.shape == (32, 3, 2, 4, 4)
    ours = tower.sanitize({"model.visual.patch_embed.proj.weight": kernel.transpose(0, 2, 3, 4, 1)})
    assert mx.array_equal(ours["patch_embed.proj.weight"], tower.patch_embed.proj.weight)


def test_hub_config_and_defaults():
    cfg = VisionConfig.from_dict(HUB_VISION_CONFIG)
    assert (cfg.depth, cfg.hidden_size, cfg.head_dim, cfg.grid_side) == (12, 768, 64, 48)
    assert cfg.rope_theta == 10000.0 and cfg.patch_dim == 3 * 2 * 16 * 16
    model = Qwen3_5Vision(dict(HUB_VISION_CONFIG, depth=1))
    # 1 / 10000^(2i / 32) for i < 16: a quarter of the head per axis
    assert np.allclose(model.inv_freq, 10000.0 ** (-np.arange(0, 32, 2) / 32), rtol=1e-6)


@pytest.mark.parametrize("change, match", [
    ({"deepstack_visual_indexes": [3]}, "deepstack"),
    ({"hidden_act": "relu"}, "hidden_act"),
    ({"num_position_embeddings": 2300}, "square"),
    ({"rope_parameters": {"rope_type": "default"}}, "axial"),
    ({"num_heads": 0}, "num_heads"),
    ({"hidden_size": 770}, "multiple"),
])
def test_bad_configs_are_refused(change, match):
    with pytest.raises(ModelFolderError, match=match):
        VisionConfig.from_dict({**HUB_VISION_CONFIG, **change})


def test_bad_grids_are_refused(tower, reference):
    patches = mx.array(reference["one_image_patches"])
    with pytest.raises(ValueError, match="spatial_merge_size"):
        tower(patches[:12], [(1, 3, 4)])
    with pytest.raises(ValueError, match="patches must be"):
        tower(patches, [(1, 4, 4)])


def make_vision_fixtures() -> ModuleType:
    path = HERE / "make_vision_fixtures.py"
    spec = importlib.util.spec_from_file_location("qwen3_5_make_vision_fixtures", path)
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
    folder = tmp_path / "tiny_vl"
    make_vision_fixtures().write_fixture(folder)
    with np.load(folder / "reference.npz") as data:
        fresh = dict(data)
    assert sorted(fresh) == sorted(reference)
    for key, value in fresh.items():
        if key.endswith(("_patches", "_grid")):
            assert np.array_equal(value, reference[key]), key
        else:
            assert np.abs(value - reference[key]).max() <= TOLERANCE, key
    model = load_vision(folder)
    assert model is not None
    for case in CASES:
        hidden_err, merged_err = max_errors(model, fresh, case)
        assert hidden_err <= TOLERANCE and merged_err <= TOLERANCE, (case, hidden_err,
                                                                    merged_err)
