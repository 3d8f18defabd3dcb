"""mlx-lm's mxfp4 conversion of a Gemma 4 MoE (the 26B-A4B layout) loads and computes what
mlx-lm computes on the same folder.

mlx-lm quantizes every layer in mxfp4 except the routers, which its Gemma 4 predicate keeps
at 8-bit affine, recording each under its own module name
(``language_model.model.layers.N.router.proj``) in the config's ``quantization`` block.

The source checkpoint: the committed ``moe`` fixture's layout widened to hidden 64 (mlx-lm's
router override uses group size 64), random weights, written in the Hub's composite layout
(mlx-lm 0.32 reads ``global_head_dim``, not ``per_layer_config``). It is converted with
mlx-lm's own ``load_model`` / ``quantize_model(mode="mxfp4")`` / ``save_model`` /
``save_config``, which is what ``mlx_lm.convert`` runs minus the tokenizer (the tiny folder
has none). Tolerance: float32 CPU on both sides with the same quantized kernels; logits are
O(1-10), and we require max abs difference < 1e-4.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlxrunner_gemma4 import Gemma4Model

import mlxrunner
from mlxrunner.testing import check_prefill_decode

mx.set_default_device(mx.cpu)

FIXTURES = Path(__file__).resolve().parent / "fixtures"
TOLERANCE = 1e-4
HIDDEN = 64


def _text_config() -> dict:
    config = json.loads((FIXTURES / "moe" / "config.json").read_text())
    config.update(hidden_size=HIDDEN, intermediate_size=64, moe_intermediate_size=32,
                  head_dim=32, vocab_size=256, vocab_size_per_layer_input=256)
    config.pop("per_layer_config")
    config.update(global_head_dim=64, num_global_key_value_heads=1, model_type="gemma4_text")
    for key in ("architectures", "transformers_version", "dtype"):
        config.pop(key, None)
    return config


def _hub_folder(folder: Path) -> Path:
    """A float32 Hub-layout Gemma 4 MoE checkpoint with random weights."""
    text = _text_config()
    shapes = Gemma4Model({**text, "architectures": ["Gemma4ForCausalLM"]})
    rng = np.random.default_rng(18)
    weights = {}
    for name, value in tree_flatten(shapes.parameters()):
        shape = value.shape
        if name.endswith(("norm.weight", ".scale", "layer_scalar")):
            array = 1.0 + 0.2 * rng.standard_normal(shape)
        elif name.endswith("per_expert_scale"):
            array = 0.5 + rng.random(shape)
        else:
            array = rng.standard_normal(shape) * shape[-1] ** -0.5
        if name.endswith((".experts.gate_up_proj.weight", ".experts.down_proj.weight")):
            name = name.removesuffix(".weight")  # transformers' expert parameters
        weights["model.language_model." + name.removeprefix("model.")] = \
            mx.array(array.astype(np.float32))
    folder.mkdir(parents=True)
    top = {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4",
           "tie_word_embeddings": True, "vocab_size": text["vocab_size"], "dtype": "float32",
           "text_config": text}
    (folder / "config.json").write_text(json.dumps(top, indent=1))
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    return folder


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> tuple[Path, object]:
    """(the mxfp4 folder mlx-lm wrote, mlx-lm's model loaded from it)."""
    pytest.importorskip("mlx_lm")
    from mlx_lm.utils import load_model, quantize_model, save_config, save_model

    root = tmp_path_factory.mktemp("gemma4_mxfp4")
    source = _hub_folder(root / "source")
    model, config = load_model(source)
    model, config = quantize_model(model, config, None, None, mode="mxfp4")
    out = root / "mxfp4"
    save_model(out, model)
    save_config(config, out / "config.json")
    theirs, _ = load_model(out)
    return out, theirs


@pytest.mark.reference
def test_the_conversion_has_the_published_layout(converted):
    """What the issue reported: a top-level mxfp4 mode with the routers' 8-bit affine
    overrides named by mlx-lm's module paths, and routers stored with affine biases."""
    folder, _ = converted
    quantization = json.loads((folder / "config.json").read_text())["quantization"]
    assert quantization["mode"] == "mxfp4" and quantization["bits"] == 4
    router = "language_model.model.layers.0.router.proj"
    assert quantization[router] == {"group_size": 64, "bits": 8}
    weights = mx.load(str(folder / "model.safetensors"))
    assert f"{router}.biases" in weights
    assert weights[f"{router}.scales"].dtype == mx.float32
    assert weights["language_model.model.layers.0.self_attn.q_proj.scales"].dtype == mx.uint8
    assert "language_model.model.layers.0.self_attn.q_proj.biases" not in weights


@pytest.mark.reference
def test_the_mxfp4_conversion_loads_and_matches_mlx_lm(converted):
    folder, theirs = converted
    ours = mlxrunner.load_model(folder)
    layer = ours.layers[0]
    assert (layer.router.proj.mode, layer.router.proj.bits, layer.router.proj.group_size) \
        == ("affine", 8, 64)
    assert (layer.self_attn.q_proj.mode, layer.self_attn.q_proj.bits) == ("mxfp4", 4)
    assert (layer.experts.gate_up_proj.mode, layer.experts.gate_up_proj.bits) == ("mxfp4", 4)
    rng = np.random.default_rng(5)
    for length in (1, 7, 40):
        ids = mx.array(rng.integers(3, 256, (1, length)))
        expected = np.array(theirs(ids)[0])
        got = np.array(ours(ids)[0])
        assert np.abs(got - expected).max() < TOLERANCE, length
    check_prefill_decode(ours, rng.integers(3, 256, (1, 20)), prefill_len=9)


def test_a_module_override_without_a_mode_is_affine_under_an_mxfp4_top_mode(tmp_path):
    """Not depending on mlx-lm: the override names a module by a path sanitize renames, and
    its dict (like mlx-lm's) has no mode; bits, group size and mode come off the tensors."""
    import mlx.nn as nn

    text = _text_config()
    config = {**text, "architectures": ["Gemma4ForCausalLM"]}
    model = Gemma4Model(config)

    def predicate(path: str, module: nn.Module) -> bool | dict:
        if not model.quantize_predicate(path, module):
            return False
        if path.endswith("router.proj"):
            return {"group_size": 64, "bits": 8, "mode": "affine"}
        return True

    nn.quantize(model, group_size=32, bits=4, mode="mxfp4", class_predicate=predicate)
    weights = {"language_model." + k: v for k, v in tree_flatten(model.parameters())}
    folder = tmp_path / "q"
    folder.mkdir()
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    overrides = {f"language_model.model.layers.{i}.router.proj": {"group_size": 64, "bits": 8}
                 for i in range(text["num_hidden_layers"])}
    (folder / "config.json").write_text(json.dumps(
        {**config, "quantization": {"group_size": 32, "bits": 4, "mode": "mxfp4",
                                    **overrides}}))
    loaded = mlxrunner.load_model(folder)
    ids = mx.array([[5, 9, 17, 3, 44, 2, 90, 11]])
    assert mx.array_equal(loaded(ids), model(ids))
