"""Gemma 4 logits and taps against transformers' committed reference outputs, and mlx-lm.

Reference: ``Gemma4ForCausalLM`` on CPU torch float32, eager attention
(tests/make_fixtures.py). Our model runs float32 on the CPU. Tolerances: max abs
logit error < 1e-4 (logits are O(1-5)); taps: max abs error < 1e-5 of the
largest hidden value (hidden states grow to ~20 over the layers).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import mlxrunner
from mlxrunner.plugin import Model
from mlxrunner.testing import (
    check_compiled_step,
    check_prefill_decode,
    check_taps,
    check_taps_against,
    compiled_steps,
    forward,
)

mx.set_default_device(mx.cpu)

FIXTURES = Path(__file__).resolve().parent / "fixtures"
NAMES = ("e2b", "dense", "moe")
LENGTHS = (1, 9, 20)
TOLERANCE = 1e-4
TAP_TOLERANCE = 1e-5  # relative to the largest |hidden value|


def load(folder: Path) -> Model:
    return mlxrunner.load_model(folder)


def reference(name: str) -> dict[str, np.ndarray]:
    with np.load(FIXTURES / name / "reference.npz") as data:
        return dict(data)


def max_err(a: mx.array, b: np.ndarray) -> float:
    return float(np.abs(np.array(a.astype(mx.float32)) - b).max())


@pytest.fixture(scope="module")
def models() -> dict[str, Model]:
    return {name: load(FIXTURES / name) for name in NAMES}


def test_gemma4_fixtures_are_small_and_cover_the_features():
    configs = {}
    for name in NAMES:
        folder = FIXTURES / name
        assert sum(p.stat().st_size for p in folder.iterdir()) < 1_000_000
        configs[name] = json.loads((folder / "config.json").read_text())
    e2b, dense, moe = configs["e2b"], configs["dense"], configs["moe"]
    assert e2b["num_kv_shared_layers"] > 0 and e2b["hidden_size_per_layer_input"] > 0
    assert e2b["use_double_wide_mlp"] and not e2b["attention_k_eq_v"]
    assert dense["attention_k_eq_v"] and not dense["hidden_size_per_layer_input"]
    assert moe["enable_moe_block"] and moe["attention_k_eq_v"]
    for cfg in configs.values():
        assert max(LENGTHS) > 2 * cfg["sliding_window"]
        assert "per_layer_config" in cfg  # transformers' spelling of the full layers' dims


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("length", LENGTHS)
def test_gemma4_logits_match_transformers(models, name, length):
    model, ref = models[name], reference(name)
    logits = model(mx.array(ref[f"ids_{length}"])[None])
    assert logits.shape == (1, length, model.vocab_size)
    assert max_err(logits[0], ref[f"logits_{length}"]) < TOLERANCE


@pytest.mark.parametrize("name", NAMES)
def test_gemma4_taps_equal_transformers_hidden_states(models, name):
    model, ref = models[name], reference(name)
    ids = ref["ids_20"][None]
    hidden = ref["hidden_20"][:, None]  # [layers + 1, B, L, hidden]
    atol = TAP_TOLERANCE * float(np.abs(hidden).max())
    check_taps_against(model, ids, list(range(model.num_layers)), list(hidden), atol=atol)
    # The last layer's tap is pre-norm; transformers' last entry is after the final norm.
    _, tapped = model(mx.array(ids), taps=[model.num_layers - 1])
    normed = model.model.norm(tapped)
    assert max_err(normed[0], ref["hidden_20"][-1]) < atol


@pytest.mark.parametrize("name", NAMES)
def test_gemma4_tap_contract(models, name):
    model, ref = models[name], reference(name)
    check_taps(model, ref["ids_9"][None], [0, model.num_layers // 2, model.num_layers - 1])


@pytest.mark.parametrize("name", NAMES)
def test_gemma4_prefill_then_decode_equals_full_forward(models, name):
    model, ref = models[name], reference(name)
    # prefill 5 (< window), then decode across the window edge and two wraps
    check_prefill_decode(model, ref["ids_20"][None], prefill_len=5)
    # prefill 13 (> window: the ring is written in two pieces), decode the rest
    check_prefill_decode(model, ref["ids_20"][None], prefill_len=13)


@pytest.mark.parametrize("name", NAMES)
def test_gemma4_decode_through_the_compiled_step_matches_transformers_rows(models, name):
    """Single-token steps through the core's compiled step reproduce the reference rows
    (across the ring's wraps), and the steps replayed a trace."""
    model, ref = models[name], reference(name)
    ids = mx.array(ref["ids_20"])[None]
    steps = compiled_steps(model)
    steps.clear()
    cache = model.make_cache()
    rows = [model(ids[:, :3], cache)]
    rows += [forward(model, ids[:, t:t + 1], cache) for t in range(3, 20)]
    assert max_err(mx.concatenate(rows, axis=1)[0], ref["logits_20"]) < TOLERANCE
    assert steps.enabled and steps.replays() > 0


@pytest.mark.parametrize("name", NAMES)
def test_gemma4_compiled_step_equals_eager(models, name):
    """Decode steps and verify blocks through the compiled step equal the eager forward,
    taps and rollback included, with the rings wrapping inside the blocks (window 8)."""
    model = models[name]
    prompt = mx.array(reference(name)["ids_20"])[None, :5]
    check_compiled_step(model, prompt, steps=4, block=6, rounds=4,
                        taps=[1, model.num_layers - 1])


def test_gemma4_embed_tokens_and_raw_logits_compose_the_head(models):
    model, ref = models["e2b"], reference("e2b")
    ids = mx.array(ref["ids_9"])[None]
    emb = model.embed_tokens(ids)
    assert max_err(emb[0], ref["hidden_9"][0]) == 0.0  # transformers' scaled embedding
    logits, tapped = model(ids, taps=[model.num_layers - 1])
    raw = model.raw_logits(model.model.norm(tapped))
    cap = 30.0
    assert max_err(cap * mx.tanh(raw / cap), np.array(logits)) < 1e-5
    assert float(mx.abs(raw).max()) > float(mx.abs(logits).max())  # before the softcap


def test_gemma4_embedding_scale_is_rounded_to_the_weight_dtype():
    config = json.loads((FIXTURES / "e2b" / "config.json").read_text())
    model = mlxrunner.load_model(FIXTURES / "e2b", dtype="bfloat16")
    ids = mx.array([[5, 6]])
    table = model.model.embed_tokens.weight[ids]
    scale = mx.array(config["hidden_size"] ** 0.5, mx.bfloat16)  # 5.65625, not 5.6569
    assert mx.array_equal(model.embed_tokens(ids), table * scale)
    assert model.weight_precision == "bfloat16"


# -- the Hub layout, and mlx-lm on the same folder ---------------------------------------

def hub_variant(src: Path, dst: Path) -> Path:
    """The same checkpoint in the Hub's composite layout: ``text_config`` with
    ``global_head_dim`` / ``num_global_key_value_heads``, weights under
    ``model.language_model.``, plus vision/audio tensors that must be dropped."""
    cfg = json.loads((src / "config.json").read_text())
    text = {k: v for k, v in cfg.items()
            if k not in ("architectures", "per_layer_config", "transformers_version", "dtype")}
    text["model_type"] = "gemma4_text"
    full = [i for i, t in enumerate(cfg["layer_types"]) if t == "full_attention"]
    override = cfg["per_layer_config"][str(full[0])]
    text["global_head_dim"] = override["head_dim"]
    if "num_key_value_heads" in override:
        text["num_global_key_value_heads"] = override["num_key_value_heads"]
    top = {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4",
           "tie_word_embeddings": True, "vocab_size": cfg["vocab_size"], "text_config": text}
    dst.mkdir(parents=True, exist_ok=True)
    (dst / "config.json").write_text(json.dumps(top, indent=1))
    weights = mx.load(str(src / "model.safetensors"))
    weights = {"model.language_model." + k.removeprefix("model."): v for k, v in weights.items()}
    weights["model.vision_tower.encoder.layers.0.weight"] = mx.zeros((4, 4))
    weights["model.embed_vision.embedding_projection.weight"] = mx.zeros((4, 4))
    weights["model.audio_tower.conv.weight"] = mx.zeros((2, 2))
    mx.save_safetensors(str(dst / "model.safetensors"), weights, metadata={"format": "mlx"})
    return dst


@pytest.mark.parametrize("name", NAMES)
def test_gemma4_hub_layout_loads_to_the_same_logits(tmp_path, models, name):
    model = load(hub_variant(FIXTURES / name, tmp_path / name))
    ref = reference(name)
    ids = mx.array(ref["ids_20"])[None]
    assert max_err(model(ids)[0], ref["logits_20"]) < TOLERANCE
    assert max_err(model(ids)[0], np.array(models[name](ids)[0])) < 1e-6


@pytest.mark.reference
@pytest.mark.parametrize("name", NAMES)
def test_gemma4_matches_mlx_lm_on_the_same_folder(tmp_path, models, name):
    pytest.importorskip("mlx_lm")
    from mlx_lm.utils import load_model as mlx_lm_load

    folder = FIXTURES / name
    try:
        theirs, _ = mlx_lm_load(folder)
        # mlx-lm 0.32 ignores per_layer_config: it builds 512-dim full layers and fails
    except Exception:
        folder = hub_variant(folder, tmp_path / name)
        theirs, _ = mlx_lm_load(folder)
    ours, ref = models[name], reference(name)
    for length in LENGTHS:
        ids = mx.array(ref[f"ids_{length}"])[None]
        ours_logits = np.array(ours(ids)[0])
        assert max_err(theirs(ids)[0], ours_logits) < 1e-5
        assert max_err(theirs(ids)[0], ref[f"logits_{length}"]) < TOLERANCE


@pytest.mark.reference
@pytest.mark.parametrize("name", NAMES)
def test_gemma4_regenerated_fixture_matches(tmp_path, name):
    """Regenerate the checkpoint and reference outputs with transformers and compare."""
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    spec = importlib.util.spec_from_file_location(
        "gemma4_make_fixtures", Path(__file__).with_name("make_fixtures.py"))
    maker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(maker)
    folder = maker.write_fixture(name, tmp_path)
    model = load(folder)
    with np.load(folder / "reference.npz") as fresh:
        for length in maker.PROMPT_LENGTHS:
            ids = mx.array(fresh[f"ids_{length}"])[None]
            assert max_err(model(ids)[0], fresh[f"logits_{length}"]) < TOLERANCE
        # the committed reference is what the script writes today
        committed = reference(name)
        for key in fresh.files:
            # within the parity tolerance: another CPU sums float32 in another order
            # (seen up to 1.5e-5 between two machines)
            np.testing.assert_allclose(fresh[key], committed[key], rtol=0, atol=TOLERANCE)
