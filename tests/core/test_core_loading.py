"""Loading model folders: text_config, shards, quantized checkpoints, dtype, strictness."""

from __future__ import annotations

import json
import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

import mlxrunner
import mlxrunner.plugin
from mlxrunner import host as plugins
from mlxrunner import settings
from mlxrunner.errors import ModelFolderError
from mlxrunner.model import host_dtype
from mlxrunner.plugin import KVCache, Model

#: products run on the host BLAS (MLX's CPU device off macOS): half precision computes in float32
HOST = mx.default_device() == mx.cpu and sys.platform != "darwin"


class TinyLM(Model):
    """Embedding -> one projection per layer -> tied head; enough to exercise loading."""

    def __init__(self, config):
        super().__init__(config)
        self.n_layers = config["num_hidden_layers"]
        self.embed = nn.Embedding(config["vocab_size"], config["hidden_size"])
        self.layers = [nn.Linear(config["hidden_size"], config["hidden_size"], bias=False)
                       for _ in range(self.n_layers)]

    def sanitize(self, weights):
        prefix = "model.language_model."
        return {k.removeprefix(prefix): v for k, v in weights.items()
                if not k.startswith("model.visual.")}

    def make_cache(self):
        return [KVCache() for _ in range(self.n_layers)]

    def __call__(self, ids, cache=None, *, taps=None):
        h = self.embed(ids)
        for layer in self.layers:
            h = h + layer(h)
        return self.embed.as_linear(h)

    @property
    def num_layers(self):
        return self.n_layers

    @property
    def vocab_size(self):
        return self.embed.weight.shape[0]


CONFIG = {"architectures": ["TinyLMForTest"], "model_type": "tiny_lm_test",
          "hidden_size": 64, "num_hidden_layers": 2, "vocab_size": 96}


@pytest.fixture(autouse=True)
def registered():
    previous = plugins.host()
    plugins.reset(plugins.PluginHost(use_entry_points=False))
    mlxrunner.plugin.register("TinyLMForTest", TinyLM)
    yield
    plugins.reset(previous)


def write(folder, config, weights, shards=1):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    names = sorted(weights)
    if shards == 1:
        mx.save_safetensors(str(folder / "model.safetensors"), weights)
        return
    weight_map = {}
    for i in range(shards):
        part = {k: weights[k] for k in names[i::shards]}
        fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        mx.save_safetensors(str(folder / fname), part)
        weight_map.update({k: fname for k in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))


def reference_weights(seed=0):
    mx.random.seed(seed)
    return dict(tree_flatten(TinyLM(CONFIG).parameters()))


def test_single_file_loads_and_matches(tmp_path):
    weights = reference_weights()
    write(tmp_path / "m", CONFIG, weights)
    model = mlxrunner.load_model(tmp_path / "m")
    ids = mx.array([[1, 2, 3, 4]])
    expected = TinyLM(CONFIG)
    expected.load_weights(list(weights.items()))
    assert model(ids).shape == (1, 4, 96)
    np.testing.assert_array_equal(np.array(model(ids)), np.array(expected(ids)))


def test_sharded_with_index_and_text_config_and_prefix(tmp_path):
    weights = {"model.language_model." + k: v for k, v in reference_weights().items()}
    weights["model.visual.patch"] = mx.zeros((2, 2))
    config = {"architectures": ["TinyLMForTest"], "model_type": "wrapper",
              "text_config": {k: v for k, v in CONFIG.items() if k != "architectures"}}
    write(tmp_path / "m", config, weights, shards=3)
    model = mlxrunner.load_model(tmp_path / "m")
    assert model.num_layers == 2 and model(mx.array([[5]])).shape == (1, 1, 96)


def test_dtype_kept_or_cast(tmp_path):
    weights = {k: v.astype(mx.bfloat16) for k, v in reference_weights().items()}
    write(tmp_path / "m", CONFIG, weights)
    assert mlxrunner.load_model(tmp_path / "m", dtype="bfloat16").dtype == mx.bfloat16
    assert mlxrunner.load_model(tmp_path / "m", dtype="float32").dtype == mx.float32
    # unasked, half precision computes in float32 where products run on the host BLAS
    # (MLX's CPU device off macOS), else as stored
    want = mx.float32 if HOST else mx.bfloat16
    assert mlxrunner.load_model(tmp_path / "m").dtype == want


@pytest.mark.skipif(not HOST, reason="products run on the host BLAS only on MLX's CPU device "
                    "off macOS")
def test_host_dtype_takes_float32_only_for_half_precision_that_fits():
    half = {"w": mx.zeros((256, 256), dtype=mx.bfloat16), "n": mx.zeros((256,), mx.float16)}
    needed = 4 * (256 * 256 + 256)
    for declared in (None, mx.bfloat16, mx.float16):
        assert host_dtype(declared, half, memory=3 * needed) == mx.float32
        assert host_dtype(declared, half, memory=3 * needed - 4) == declared
    assert host_dtype(mx.float32, half, memory=10 * needed) == mx.float32
    mixed = dict(half, q=mx.zeros((8,), mx.uint32), f=mx.zeros((4,), mx.float32))
    assert host_dtype(None, mixed, memory=10 * needed) is None  # not all half
    with settings.overridden(host_products=False):  # as on a GPU or macOS
        assert host_dtype(mx.bfloat16, half, memory=10 * needed) == mx.bfloat16


@pytest.mark.parametrize("key", ["dtype", "torch_dtype"])
def test_config_declared_dtype_is_the_compute_dtype(tmp_path, key):
    """bf16 weights in a folder whose config.json declares float32 compute in float32 (as
    transformers' dtype="auto" loads them); an explicit dtype still wins."""
    weights = {k: v.astype(mx.bfloat16) for k, v in reference_weights().items()}
    write(tmp_path / "m", {**CONFIG, key: "float32"}, weights)
    model = mlxrunner.load_model(tmp_path / "m")
    assert model.dtype == mx.float32
    ids = mx.array([[5, 9, 2]])
    want = mlxrunner.load_model(tmp_path / "m", dtype="float32")(ids)
    assert mx.array_equal(model(ids), want).item()
    assert mlxrunner.load_model(tmp_path / "m", dtype="bfloat16").dtype == mx.bfloat16


@pytest.mark.parametrize("bits", [4, 8])
def test_mlx_affine_quantized_checkpoint(tmp_path, bits):
    mx.random.seed(1)
    model = TinyLM(CONFIG)
    dense_out = model(mx.array([[1, 2, 3]]))
    nn.quantize(model, group_size=32, bits=bits)
    weights = dict(tree_flatten(model.parameters()))
    assert any(k.endswith(".scales") for k in weights)
    config = dict(CONFIG, quantization={"group_size": 32, "bits": bits})
    write(tmp_path / "q", config, weights)
    loaded = mlxrunner.load_model(tmp_path / "q")
    assert loaded.weight_precision == f"{bits}-bit affine"
    out = loaded(mx.array([[1, 2, 3]]))
    np.testing.assert_allclose(np.array(out), np.array(model(mx.array([[1, 2, 3]]))), atol=1e-5)
    # and close to the unquantized model (quantization error only)
    assert float(mx.abs(out - dense_out).max()) < (0.5 if bits == 4 else 0.1)


def test_strictness(tmp_path):
    weights = reference_weights()
    extra = dict(weights, **{"stray.weight": mx.zeros((1,))})
    write(tmp_path / "extra", CONFIG, extra)
    with pytest.raises(ModelFolderError, match="unexpected tensor 'stray.weight'"):
        mlxrunner.load_model(tmp_path / "extra")
    missing = dict(weights)
    del missing["layers.1.weight"]
    write(tmp_path / "missing", CONFIG, missing)
    with pytest.raises(ModelFolderError, match="missing tensor 'layers.1.weight'"):
        mlxrunner.load_model(tmp_path / "missing")


def test_pickle_only_folder_is_refused(tmp_path):
    folder = tmp_path / "p"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CONFIG))
    (folder / "pytorch_model.bin").write_bytes(b"\x80\x04not loaded")
    with pytest.raises(ModelFolderError, match="pickle weights are never loaded"):
        mlxrunner.load_model(folder)


def test_mixed_precision_checkpoint_reads_bits_from_the_tensors(tmp_path):
    mx.random.seed(2)
    model = TinyLM(CONFIG)
    nn.quantize(model, group_size=32, bits=4,
                class_predicate=lambda p, m: isinstance(m, nn.Linear) and p != "layers.1")
    nn.quantize(model, group_size=64, bits=8,
                class_predicate=lambda p, m: p == "layers.1")
    weights = dict(tree_flatten(model.parameters()))
    # the config's default says 4-bit; layers.1 is 8-bit with no override under our names
    config = dict(CONFIG, quantization={"group_size": 32, "bits": 4,
                                        "language_model.layers.1": {"bits": 8}})
    write(tmp_path / "mixed", config, weights)
    loaded = mlxrunner.load_model(tmp_path / "mixed")
    assert loaded.layers[1].bits == 8 and loaded.layers[1].group_size == 64
    assert loaded.layers[0].bits == 4
    ids = mx.array([[3, 1, 4]])
    np.testing.assert_allclose(np.array(loaded(ids)), np.array(model(ids)), atol=1e-5)


class _Tower(nn.Module):
    """A part the core does not load with the model: its tensors under ``model.tower.``."""

    def __init__(self, part: dict, config: dict) -> None:
        super().__init__()
        self.proj = nn.Linear(part["width"], config["hidden_size"])

    def sanitize(self, weights: dict) -> dict:
        return {name.removeprefix("model.tower."): array for name, array in weights.items()}


def test_load_part_reads_one_part_of_a_folder(tmp_path):
    from mlxrunner.plugin import load_part

    config = {"architectures": ["TowerModel"], "hidden_size": 6, "tower_config": {"width": 4}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    w = mx.random.normal((6, 4))
    mx.save_safetensors(str(tmp_path / "model.safetensors"), {
        "model.tower.proj.weight": w, "model.tower.proj.bias": mx.zeros((6,)),
        "model.language_model.embed.weight": mx.zeros((3, 6))})
    tower = load_part(tmp_path, "tower_config", ("model.tower.",), _Tower, mx.bfloat16, "tower")
    assert tower.proj.weight.dtype == mx.bfloat16
    np.testing.assert_array_equal(np.array(tower.proj.weight.astype(mx.float32)),
                                  np.array(w.astype(mx.bfloat16).astype(mx.float32)))
    assert load_part(tmp_path, "audio_config", ("model.tower.",), _Tower) is None
    assert load_part(tmp_path, "tower_config", ("model.audio.",), _Tower) is None
    (tmp_path / "config.json").write_text(json.dumps({**config, "tower_config": [1]}))
    with pytest.raises(ModelFolderError, match="tower_config must be an object"):
        load_part(tmp_path, "tower_config", ("model.tower.",), _Tower)
    (tmp_path / "config.json").write_text(json.dumps({**config, "tower_config": {"width": 5}}))
    with pytest.raises(ModelFolderError, match="proj.weight. has shape \\(6, 4\\)"):
        load_part(tmp_path, "tower_config", ("model.tower.",), _Tower, what="tower")
