"""Llama-family logits against transformers' committed reference outputs, and the core's checks.

Reference: ``LlamaForCausalLM`` / ``MistralForCausalLM`` on CPU torch float32
(tests/make_fixtures.py). Our model runs float32 on the CPU. Tolerances: max abs logit
error < 1e-4 (logits are O(1-5); measured 1e-6 to 6e-6); taps: < 1e-5 times the largest
|hidden value|.
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
from mlxrunner_llama import plugin
from mlxrunner_llama.model import Llama

import mlxrunner
from mlxrunner.plugin import Model, registered
from mlxrunner.testing import (
    check_compiled_step,
    check_prefill_decode,
    check_speculative_greedy,
    check_taps,
    check_taps_against,
    compiled_steps,
    forward,
    run_conformance,
)

mx.set_default_device(mx.cpu)

FIXTURES = Path(__file__).resolve().parent / "fixtures"
NAMES = ("tied_llama3", "untied_bias_linear", "mistral_gqa4_yarn")
LENGTHS = (1, 7, 40)
TOLERANCE = 1e-4
TAP_TOLERANCE = 1e-5  # relative to the largest |hidden value|


def reference(name: str) -> dict[str, np.ndarray]:
    with np.load(FIXTURES / name / "reference.npz") as data:
        return dict(data)


def config(name: str) -> dict:
    return json.loads((FIXTURES / name / "config.json").read_text())


def max_err(a: mx.array, b: np.ndarray) -> float:
    return float(np.abs(np.array(a.astype(mx.float32)) - b).max())


@pytest.fixture(scope="module")
def models() -> dict[str, Model]:
    return {name: mlxrunner.load_model(FIXTURES / name) for name in NAMES}


def test_fixtures_are_small_and_cover_the_family():
    seen = set()
    for name in NAMES:
        assert sum(p.stat().st_size for p in (FIXTURES / name).iterdir()) < 200_000
        cfg = config(name)
        rope = cfg["rope_parameters"]["rope_type"]
        seen |= {cfg["architectures"][0], rope, ("tied", cfg["tie_word_embeddings"]),
                 ("group", cfg["num_attention_heads"] // cfg["num_key_value_heads"]),
                 ("bias", cfg.get("attention_bias", False) and cfg.get("mlp_bias", False))}
    assert {"LlamaForCausalLM", "MistralForCausalLM", "llama3", "linear", "yarn",
            ("tied", True), ("tied", False), ("group", 1), ("group", 2), ("group", 4),
            ("bias", True)} <= seen


def test_registered_under_the_family_names():
    registry = registered("architectures")
    assert plugin.ARCHITECTURE_NAMES == ("LlamaForCausalLM", "llama", "MistralForCausalLM",
                                         "mistral")
    for name in plugin.ARCHITECTURE_NAMES:
        assert registry[name].obj is Llama


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("length", LENGTHS)
def test_logits_match_transformers(models, name, length):
    model, ref = models[name], reference(name)
    logits = model(mx.array(ref[f"ids_{length}"]))
    assert logits.shape == (1, length, model.vocab_size)
    assert max_err(logits[0], ref[f"logits_{length}"]) < TOLERANCE


@pytest.mark.parametrize("name", NAMES)
def test_cached_decode_matches_transformers(models, name):
    """Prefill 7, a 9-token block, then single steps through the core's compiled step: the
    rows are transformers' rows, and the steps replayed a trace."""
    model, ref = models[name], reference(name)
    ids = mx.array(ref["ids_40"])
    steps = compiled_steps(model)
    steps.clear()
    cache = model.make_cache()
    rows = [model(ids[:, :7], cache), model(ids[:, 7:16], cache)]
    rows += [forward(model, ids[:, t:t + 1], cache) for t in range(16, 40)]
    assert all(c is not None and c.offset == 40 for c in cache)
    assert max_err(mx.concatenate(rows, axis=1)[0], ref["logits_40"]) < TOLERANCE
    assert steps.enabled and steps.replays() > 0


@pytest.mark.parametrize("name", NAMES)
def test_taps_equal_transformers_hidden_states(models, name):
    model, ref = models[name], reference(name)
    hidden = ref["hidden_40"][:, None]  # [layers + 1, B, L, hidden]: embeddings first
    atol = TAP_TOLERANCE * float(np.abs(hidden).max())
    assert max_err(model.embed_tokens(mx.array(ref["ids_40"]))[0], ref["hidden_40"][0]) == 0
    last = model.num_layers - 1
    check_taps_against(model, ref["ids_40"], list(range(last + 1)), list(hidden),
                       atol=atol)
    # the last tap is before the final norm; transformers' last entry is after it
    logits, tapped = model(mx.array(ref["ids_40"]), taps=[last])
    normed = model.model.norm(tapped)
    assert max_err(normed[0], ref["hidden_40"][-1]) < atol
    assert max_err(model.raw_logits(normed), np.array(logits)) < 1e-5


@pytest.mark.parametrize("name", NAMES)
def test_conformance(models, name):
    ran = run_conformance(models[name], batch=2, prompt_len=10, draft_len=4, rounds=4)
    assert ran == ["prefill_decode", "taps+layer_index", "cache_rollback", "compiled_step"]


def test_compiled_step_equals_eager_across_the_cache_growth(models):
    model = models["mistral_gqa4_yarn"]
    prompt = mx.array(reference("mistral_gqa4_yarn")["ids_40"])
    check_compiled_step(model, prompt, steps=4, block=6, rounds=4, taps=[0, 1])
    check_prefill_decode(model, mx.concatenate([prompt] * 7, axis=1)[:, :262],
                         prefill_len=250)  # KVCache grows 256 positions at a time


@pytest.mark.parametrize("name", ["tied_llama3", "untied_bias_linear"])
def test_speculative_greedy_is_exact(models, name):
    """Random DFlash/DFlash2 drafts (when registered) and a scripted draft that makes every
    rollback length happen: speculative greedy output is plain greedy output."""
    stats = check_speculative_greedy(models[name], max_tokens=120, prompts=3)
    assert stats


def test_tap_contract(models):
    model = models["tied_llama3"]
    check_taps(model, reference("tied_llama3")["ids_7"], [0, 1])


# -- checkpoints ---------------------------------------------------------------------------


def copy_fixture(name: str, folder: Path, config_changes: dict | None = None,
                 extra: dict[str, mx.array] | None = None) -> Path:
    shutil.copytree(FIXTURES / name, folder)
    if config_changes:
        cfg = {**config(name), **config_changes}
        (folder / "config.json").write_text(json.dumps(cfg))
    if extra:
        weights = mx.load(str(folder / "model.safetensors"))
        mx.save_safetensors(str(folder / "model.safetensors"), {**weights, **extra})
    return folder


def test_tied_checkpoint_with_a_head_copy_and_inv_freq_loads(tmp_path):
    """Llama 3.2 folders store lm_head.weight though tied; old exports store inv_freq."""
    name = "tied_llama3"
    table = mx.load(str(FIXTURES / name / "model.safetensors"))["model.embed_tokens.weight"]
    folder = copy_fixture(name, tmp_path / "m", extra={
        "lm_head.weight": table,
        "model.layers.0.self_attn.rotary_emb.inv_freq": mx.ones((4,)),
        "model.layers.1.self_attn.rotary_emb.inv_freq": mx.ones((4,))})
    model = mlxrunner.load_model(folder)
    assert not hasattr(model, "lm_head")
    ref = reference(name)
    assert max_err(model(mx.array(ref["ids_40"]))[0], ref["logits_40"]) < TOLERANCE


def test_legacy_rope_scaling_spelling_loads_alike(tmp_path):
    """Pre-5 transformers configs: ``rope_scaling`` (``type`` or ``rope_type``) beside
    ``rope_theta``; head_dim absent (hidden / heads)."""
    name = "tied_llama3"
    rope = dict(config(name)["rope_parameters"])
    theta = rope.pop("rope_theta")
    changes = {"rope_parameters": None, "rope_scaling": rope, "rope_theta": theta,
               "head_dim": None}
    folder = copy_fixture(name, tmp_path / "m", changes)
    ref = reference(name)
    model = mlxrunner.load_model(folder)
    assert max_err(model(mx.array(ref["ids_40"]))[0], ref["logits_40"]) < TOLERANCE


@pytest.mark.parametrize("name", NAMES)
def test_rope_scaling_matters_at_forty_tokens(name):
    """Default RoPE on the same weights is far from the reference: the scaling is exercised."""
    cfg = {**config(name), "rope_parameters": {"rope_type": "default",
                                               "rope_theta": config(name)["rope_parameters"]
                                               ["rope_theta"]}}
    plain = Llama(cfg)
    weights = mx.load(str(FIXTURES / name / "model.safetensors"))
    plain.load_weights(list(plain.sanitize(weights).items()), strict=True)
    ref = reference(name)
    assert max_err(plain(mx.array(ref["ids_40"]))[0], ref["logits_40"]) > 1e-2


def test_mistral_sliding_window_is_refused_unless_it_covers_the_context():
    cfg = config("mistral_gqa4_yarn")
    with pytest.raises(mlxrunner.ModelFolderError, match="sliding_window 16"):
        Llama({**cfg, "sliding_window": 16})
    Llama({**cfg, "sliding_window": cfg["max_position_embeddings"]})
    absent = {k: v for k, v in cfg.items() if k != "sliding_window"}
    Llama(absent)  # transformers' MistralConfig default, a 4096 window, covers 64 positions
    with pytest.raises(mlxrunner.ModelFolderError, match="sliding_window 4096"):
        Llama({**absent, "max_position_embeddings": 32768})


@pytest.mark.parametrize("changes,match", [
    ({"hidden_act": "relu"}, "hidden_act 'relu'"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e4}}, "rope_type 'dynamic'"),
    ({"num_attention_heads": 6, "num_key_value_heads": 4}, "multiple"),
    ({"head_dim": None, "hidden_size": 30}, "multiple"),
    ({"vocab_size": 10**9}, "vocab_size"),
    ({"pretraining_tp": 0}, "pretraining_tp"),
])
def test_bad_configs_are_one_clear_error(tmp_path, changes, match):
    folder = copy_fixture("untied_bias_linear", tmp_path / "m", changes)
    with pytest.raises(mlxrunner.ModelFolderError, match=match):
        mlxrunner.load_model(folder)


def test_missing_key_is_named():
    cfg = config("tied_llama3")
    del cfg["intermediate_size"]
    with pytest.raises(mlxrunner.ModelFolderError, match="intermediate_size"):
        Llama(cfg)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_folder_loads_and_runs(bits, tmp_path):
    """An MLX affine-quantized folder (every linear layer and the tied embedding, which is
    also the head, group 32) loads through its quantization block and computes what the
    quantized model it was written from computes, prefill + decode included."""
    name = "tied_llama3"
    source = mlxrunner.load_model(FIXTURES / name)
    nn.quantize(source, group_size=32, bits=bits)
    folder = tmp_path / f"q{bits}"
    folder.mkdir()
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(source.parameters())))
    (folder / "config.json").write_text(json.dumps(
        {**config(name), "quantization": {"group_size": 32, "bits": bits}}))
    loaded = mlxrunner.load_model(folder)
    assert isinstance(loaded.model.embed_tokens, nn.QuantizedEmbedding)
    assert isinstance(loaded.layers[0].self_attn.q_proj, nn.QuantizedLinear)
    assert loaded.weight_precision == f"{bits}-bit affine"
    ids = mx.array(reference(name)["ids_40"])
    expected = np.array(source(ids)[0])
    assert max_err(loaded(ids)[0], expected) < 1e-5
    cache = loaded.make_cache()
    rows = [loaded(ids[:, :30], cache)] + [loaded(ids[:, t:t + 1], cache) for t in range(30, 40)]
    assert max_err(mx.concatenate(rows, axis=1)[0], expected) < 1e-4
    assert max_err(loaded(ids)[0], reference(name)["logits_40"]) > 1e-3  # really quantized


#: SmolLM2-135M-Instruct's config.json (HuggingFaceTB), the keys the architecture reads
SMOLLM2_135M = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 49152,
    "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_act": "silu",
    "max_position_embeddings": 8192, "rms_norm_eps": 1e-5, "rope_theta": 100000,
    "rope_scaling": None, "tie_word_embeddings": True, "attention_bias": False,
    "mlp_bias": False, "pretraining_tp": 1,
}


def test_smollm2_135m_shapes():
    """The published SmolLM2-135M config builds the 134.5M-parameter model (shapes only: no
    random weights are materialised)."""
    model = Llama(SMOLLM2_135M)
    shapes = {k: v.shape for k, v in tree_flatten(model.parameters())}
    assert shapes["model.layers.0.self_attn.q_proj.weight"] == (576, 576)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (192, 576)  # 3 heads of 64
    assert shapes["model.layers.29.mlp.down_proj.weight"] == (576, 1536)
    assert "lm_head.weight" not in shapes
    assert sum(int(np.prod(s)) for s in shapes.values()) == 134_515_008
    rope = model.layers[0].self_attn.rope
    assert rope.dims == 64 and rope.base == 100000.0
