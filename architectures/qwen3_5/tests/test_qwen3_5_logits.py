"""Qwen3.5 logits against transformers' committed reference outputs, in every path.

Reference: ``Qwen3_5ForCausalLM`` on CPU torch float32 (tests/make_fixtures.py). Our
model runs float32 on the CPU; max abs logit error < 1e-4 (the logits are O(1-5)).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten

import mlxrunner
from mlxrunner.plugin import RecurrentCache, registered
from mlxrunner.testing import check_prefill_decode

mx.set_default_device(mx.cpu)

FIXTURES = Path(__file__).resolve().parent / "fixtures"
FIXTURE_NAMES = sorted(p.name for p in FIXTURES.iterdir() if (p / "config.json").is_file())
PROMPT_LENGTHS = (1, 7, 130)
TOLERANCE = 1e-4  # float32 against transformers (CPU torch, float32): max abs logit error

TIED = "tiny_hk2_hv4_tied"  # Hk != Hv, 3 DeltaNet + 1 full-attention layer


def max_err(a: mx.array, b: np.ndarray) -> float:
    return float(np.abs(np.array(a.astype(mx.float32)) - b).max())


def test_fixtures_are_small_and_varied():
    assert len(FIXTURE_NAMES) >= 3
    heads = set()
    for name in FIXTURE_NAMES:
        folder = FIXTURES / name
        assert sum(p.stat().st_size for p in folder.iterdir()) < 1_000_000
        cfg = json.loads((folder / "config.json").read_text())
        heads.add(cfg["linear_num_key_heads"] == cfg["linear_num_value_heads"])
    assert heads == {True, False}  # both Hk == Hv and Hk != Hv


@pytest.mark.parametrize("name", FIXTURE_NAMES)
@pytest.mark.parametrize("length", PROMPT_LENGTHS)
def test_logits_match_transformers(name, length, fixture_model, reference):
    model, ref = fixture_model(name), reference(name)
    logits = model(mx.array(ref[f"ids_{length}"]))
    assert logits.shape == (1, length, model.vocab_size)
    assert max_err(logits[0], ref[f"logits_{length}"]) < TOLERANCE


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_prefill_then_decode_matches_transformers(name, fixture_model, reference):
    """Prefill 100 tokens (two chunks), verify-style 20 at once, then 10 single steps."""
    model, ref = fixture_model(name), reference(name)
    ids = mx.array(ref["ids_130"])
    cache = model.make_cache()
    rows = [model(ids[:, :100], cache), model(ids[:, 100:120], cache)]
    rows += [model(ids[:, t:t + 1], cache) for t in range(120, 130)]
    assert all(c.offset == 130 for c in cache)
    assert max_err(mx.concatenate(rows, axis=1)[0], ref["logits_130"]) < TOLERANCE


def test_prefill_decode_conformance(fixture_model, reference):
    """The core's check: full forward == prefill + token-by-token decode (ours vs ours)."""
    model = fixture_model("tiny_alternating_hk1_hv3")
    check_prefill_decode(model, reference("tiny_alternating_hk1_hv3")["ids_130"][:, :40],
                         prefill_len=9)


@pytest.mark.parametrize("dtype,rel_tol", [(mx.bfloat16, 0.3), (mx.float16, 0.06)])
def test_half_precision_runs_close_to_float32(dtype, rel_tol, fixture_model, reference):
    """bf16/fp16 weights and activations, in one forward and in prefill + decode.

    Tolerance: max abs logit error against float32 within ``rel_tol`` times the largest
    |logit|. This random model amplifies rounding (~250x): transformers' own bf16/fp16 run
    of it is off by 0.69x / 0.022x the largest logit; ours by ~0.18x / ~0.03x (the
    reference test checks that against torch).
    """
    model, ref = fixture_model(TIED, dtype), reference(TIED)
    assert model.dtype == dtype
    expected = ref["logits_130"]
    scale = np.abs(expected).max()
    ids = mx.array(ref["ids_130"])
    logits = model(ids)
    assert logits.dtype == dtype
    assert max_err(logits[0], expected) < rel_tol * scale
    cache = model.make_cache()
    rows = [model(ids[:, :120], cache)] + [model(ids[:, t:t + 1], cache) for t in range(120, 130)]
    assert max_err(mx.concatenate(rows, axis=1)[0], expected) < rel_tol * scale
    for c in cache:  # the DeltaNet state stays float32 whatever the compute dtype
        if isinstance(c, RecurrentCache):
            assert c.recurrent_state.dtype == mx.float32
            assert c.conv_tail.dtype == dtype


def test_batch_rows_are_independent(fixture_model, reference):
    model, ref = fixture_model(TIED), reference(TIED)
    ids = mx.array(ref["ids_130"][:, :40])
    other = mx.array(ref["ids_130"][:, 90:])
    both = model(mx.concatenate([ids, other], axis=0))
    assert max_err(both[0], np.array(model(ids)[0])) < 1e-5
    assert max_err(both[1], np.array(model(other)[0])) < 1e-5


# -- checkpoint layouts ----------------------------------------------------------------------


def write_composite(src: Path, dst: Path, extra: dict[str, mx.array] | None = None) -> Path:
    """The Hub layout: composite config with text_config, text weights under
    ``model.language_model.*``, plus vision and MTP tensors that must be dropped."""
    text = json.loads((src / "config.json").read_text())
    dst.mkdir(parents=True)
    config = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
              "tie_word_embeddings": text["tie_word_embeddings"],
              "text_config": {k: v for k, v in text.items() if k != "architectures"},
              "vision_config": {"model_type": "qwen3_5_vision", "depth": 1}}
    (dst / "config.json").write_text(json.dumps(config))
    weights = {}
    for key, value in mx.load(str(src / "model.safetensors")).items():
        if key.startswith("model."):
            key = "model.language_model." + key[len("model."):]
        weights[key] = value
    weights.update(extra or {})
    mx.save_safetensors(str(dst / "model.safetensors"), weights)
    return dst


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_hub_composite_layout_loads(name, tmp_path, reference, load_folder):
    junk = {"model.visual.blocks.0.attn.qkv.weight": mx.ones((6, 2)),
            "mtp.layers.0.mlp.gate_proj.weight": mx.ones((2, 2)),
            "mtp.fc.weight": mx.ones((2, 4))}
    folder = write_composite(FIXTURES / name, tmp_path / "hub", junk)
    model = load_folder(folder)
    ref = reference(name)
    assert max_err(model(mx.array(ref["ids_7"]))[0], ref["logits_7"]) < TOLERANCE


def mlx_converted(model: nn.Module, config: dict, folder: Path) -> Path:
    """Write a model the way mlx-lm's convert does: composite config, language_model.* names,
    1 + w zero-centred norm weights (ours hold w), [C, K, 1] conv weights (as ours)."""
    folder.mkdir(parents=True)
    zero_centred = ("input_layernorm.weight", "post_attention_layernorm.weight",
                    "q_norm.weight", "k_norm.weight")
    weights = {"language_model." + k: (v + 1.0 if k == "model.norm.weight"
                                       or k.endswith(zero_centred) else v)
               for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def composite_config(name: str) -> dict:
    text = json.loads((FIXTURES / name / "config.json").read_text())
    return {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
            "tie_word_embeddings": text["tie_word_embeddings"], "text_config": text}


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_mlx_converted_layout_loads(name, tmp_path, fixture_model, reference, load_folder):
    folder = mlx_converted(fixture_model(name), composite_config(name), tmp_path / "mlx")
    model = load_folder(folder)
    ref = reference(name)
    assert max_err(model(mx.array(ref["ids_7"]))[0], ref["logits_7"]) < TOLERANCE


def dequantized_copy(quantized: nn.Module, float_model: nn.Module) -> nn.Module:
    """``float_model`` with every weight replaced by its quantized counterpart, dequantized."""
    params = dict(tree_flatten(float_model.parameters()))
    for path, module in quantized.named_modules():
        if hasattr(module, "scales"):
            params[f"{path}.weight"] = mx.dequantize(
                module.weight, module.scales, module.biases, module.group_size, module.bits)
    float_model.load_weights(list(params.items()))
    return float_model


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_checkpoint_loads_and_runs(bits, tmp_path, reference, load_folder):
    """An MLX-converted affine-quantized folder (every linear layer and the embedding, group
    32) loads through its quantization block; prefill + decode and one full forward equal a
    float32 model holding the dequantized weights (max abs error < 1e-4)."""
    name = TIED
    model = load_folder(FIXTURES / name)
    nn.quantize(model, group_size=32, bits=bits)
    config = composite_config(name)
    config["quantization"] = {"group_size": 32, "bits": bits}
    loaded = load_folder(mlx_converted(model, config, tmp_path / f"q{bits}"))
    assert isinstance(loaded.model.layers[0].linear_attn.in_proj_qkv, nn.QuantizedLinear)
    assert isinstance(loaded.model.embed_tokens, nn.QuantizedEmbedding)
    assert loaded.weight_precision == f"{bits}-bit affine"
    expected_model = dequantized_copy(loaded, load_folder(FIXTURES / name))
    ids = mx.array(reference(name)["ids_130"])
    expected = np.array(expected_model(ids)[0])
    assert max_err(loaded(ids)[0], expected) < 1e-4
    cache = loaded.make_cache()
    rows = [loaded(ids[:, :125], cache)] + [loaded(ids[:, t:t + 1], cache)
                                            for t in range(125, 130)]
    assert max_err(mx.concatenate(rows, axis=1)[0], expected) < 1e-4
    # and quantization really changed the weights
    assert max_err(loaded(ids)[0], reference(name)["logits_130"]) > 1e-3


def test_load_model_through_registry(tmp_path):
    """The entry point registers every name; load_model picks the class by architecture."""
    from mlxrunner_qwen3_5 import Qwen3_5

    registry = registered("architectures")
    for name in ("Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM", "qwen3_5",
                 "qwen3_5_text"):
        assert registry[name].obj is Qwen3_5
    folder = tmp_path / "m"
    shutil.copytree(FIXTURES / TIED, folder)
    model = mlxrunner.load_model(folder)
    assert isinstance(model, Qwen3_5) and model.num_layers == 4 and model.hidden_size == 32


def test_bad_config_is_one_clear_error():
    from mlxrunner_qwen3_5 import Qwen3_5

    config = json.loads((FIXTURES / TIED / "config.json").read_text())
    with pytest.raises(mlxrunner.ModelFolderError, match="layer_types"):
        Qwen3_5({**config, "layer_types": ["linear_attention", "moe"]})
    with pytest.raises(mlxrunner.ModelFolderError, match="linear_num_value_heads"):
        Qwen3_5({**config, "linear_num_value_heads": 3})
    del config["hidden_size"]
    with pytest.raises(mlxrunner.ModelFolderError, match="hidden_size"):
        Qwen3_5(config)
