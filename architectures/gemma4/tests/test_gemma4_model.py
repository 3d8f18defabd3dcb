"""Gemma 4 config spellings, registration, checkpoint names, quantized and MoE paths."""

from __future__ import annotations

import json
import os
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlxrunner_gemma4 import Gemma4Config, Gemma4Model

import mlxrunner
from mlxrunner import ModelFolderError
from mlxrunner.plugin import KVCache, RingCache, registered
from mlxrunner.testing import check_prefill_decode

mx.set_default_device(mx.cpu)

FIXTURES = Path(__file__).resolve().parent / "fixtures"
REPO = Path(__file__).resolve().parents[3]


def shared_configs() -> Path:
    root = Path(os.environ.get("MLXRUNNER_SHARED_DATA", REPO.parent / "shared" / "data"))
    folder = root / "configs"
    if not folder.is_dir():
        pytest.skip(f"shared data not found at {root} (set MLXRUNNER_SHARED_DATA)")
    return folder


def text_part(config: dict) -> dict:
    text = dict(config.get("text_config", config))
    for key, value in config.items():
        if key != "text_config":
            text.setdefault(key, value)
    return text


@pytest.mark.parametrize("variant", ["E2B", "E4B"])
def test_gemma4_both_config_spellings_resolve_alike(variant):
    folder = shared_configs()
    hub = json.loads((folder / f"gemma-4-{variant}-it.config.text-fields-from-ollama-tests.json"
                      ).read_text())
    serialized = json.loads((folder / f"gemma-4-{variant}-it.text_config.transformers-5.24-"
                                      "serialized.json").read_text())
    a, b = Gemma4Config.from_dict(text_part(hub)), Gemma4Config.from_dict(serialized)
    for fact in ("layer_types", "head_dims", "kv_heads", "kv_source", "intermediate_sizes",
                 "rope", "k_eq_v", "sliding_window", "hidden_size_per_layer_input"):
        assert getattr(a, fact) == getattr(b, fact), fact


def test_gemma4_e2b_facts():
    folder = shared_configs()
    hub = json.loads((folder / "gemma-4-E2B-it.config.text-fields-from-ollama-tests.json"
                      ).read_text())
    cfg = Gemma4Config.from_dict(text_part(hub))
    assert cfg.num_layers == 35
    assert cfg.kv_source[:15] == list(range(15))
    assert {cfg.kv_source[i] for i in range(15, 35) if cfg.layer_types[i] == "sliding_attention"
            } == {13}
    assert {cfg.kv_source[i] for i in range(15, 35) if cfg.layer_types[i] == "full_attention"
            } == {14}
    assert cfg.intermediate_sizes[14] == 6144 and cfg.intermediate_sizes[15] == 12288
    assert cfg.head_dims[:5] == [256, 256, 256, 256, 512]
    assert cfg.rope["full_attention"]["rope_type"] == "proportional"

    # Parameter shapes, without materialising 5B random numbers.
    model = Gemma4Model(text_part(hub))
    full = model.layers[4].self_attn.rope
    periods = full.freqs.tolist()
    assert full.dims == 512 and len(periods) == 256
    assert sum(p != float("inf") for p in periods) == 64  # 1/4 of 256 frequencies
    assert periods[1] == pytest.approx(1e6 ** (2 / 512))
    sliding = model.layers[0].self_attn.rope
    assert sliding.freqs is None and sliding.dims == 256 and sliding.base == 1e4
    shapes = {k: v.shape for k, v in tree_flatten(model.parameters())}
    assert shapes["model.layers.4.self_attn.q_proj.weight"] == (8 * 512, 1536)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (256, 1536)
    assert "model.layers.15.self_attn.k_proj.weight" not in shapes
    assert shapes["model.layers.15.mlp.gate_proj.weight"] == (12288, 1536)
    assert shapes["model.embed_tokens_per_layer.weight"] == (262144, 35 * 256)
    caches = model.make_cache()
    assert [type(c) for c in caches[:5]] == [RingCache] * 4 + [KVCache]
    assert caches[0].window == 512 and caches[15:] == [None] * 20


def test_gemma4_registered_through_the_entry_point():
    registry = registered("architectures")
    for name in ("Gemma4ForConditionalGeneration", "Gemma4ForCausalLM", "gemma4", "gemma4_text"):
        assert registry[name].obj is Gemma4Model
        assert registry[name].plugin == "gemma4"


@pytest.mark.parametrize("change, message", [
    ({"num_hidden_layers": None}, "num_hidden_layers"),
    ({"rope_parameters": {"sliding_attention": {"rope_type": "dynamic"}}}, "rope_type"),
    ({"num_kv_shared_layers": 99}, "num_kv_shared_layers"),
    ({"hidden_activation": "relu"}, "hidden_activation"),
])
def test_gemma4_bad_config_is_one_clear_error(change, message):
    config = json.loads((FIXTURES / "dense" / "config.json").read_text())
    for key, value in change.items():
        if value is None:
            config.pop(key)
        else:
            config[key] = value
    with pytest.raises(ModelFolderError, match=message):
        Gemma4Model(config)


def test_gemma4_sanitize_reads_mlx_lm_names():
    """mlx-lm's converted layout: ``language_model.model.*`` and split switch_glu experts."""
    model = mlxrunner.load_model(FIXTURES / "moe")
    ours = dict(tree_flatten(model.parameters()))
    theirs = {}
    for name, value in ours.items():
        if ".experts.gate_up_proj." in name:
            base = name.split(".experts.")[0] + ".experts.switch_glu."
            gate, up = mx.split(value, 2, axis=1)
            theirs[base + "gate_proj.weight"], theirs[base + "up_proj.weight"] = gate, up
        elif ".experts.down_proj." in name:
            theirs[name.replace(".experts.down_proj.", ".experts.switch_glu.down_proj.")] = value
        else:
            theirs["language_model." + name] = value
    back = model.sanitize(theirs)
    assert sorted(back) == sorted(ours)
    for name, value in ours.items():
        assert mx.array_equal(back[name], value), name


def test_gemma4_sanitize_drops_shared_kv_weights_and_rotary_buffers():
    model = mlxrunner.load_model(FIXTURES / "e2b")
    weights = dict(tree_flatten(model.parameters()))
    extra = {"model.layers.7.self_attn.k_proj.weight": mx.zeros((16, 32)),
             "model.layers.9.self_attn.v_norm.weight": mx.zeros((32,)),
             "model.rotary_emb.full_attention_inv_freq": mx.zeros((16,)),
             "lm_head.weight": model.model.embed_tokens.weight}
    assert sorted(model.sanitize({**weights, **extra})) == sorted(weights)


def _random_moe_config() -> dict:
    config = json.loads((FIXTURES / "moe" / "config.json").read_text())
    config.update(hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
                  head_dim=32, per_layer_config={"5": {"head_dim": 64, "num_key_value_heads": 1}})
    return config


def test_gemma4_quantized_checkpoint_loads_and_runs(tmp_path):
    """An 8-bit checkpoint (experts and router included) saved and loaded by load_model."""
    config = _random_moe_config()
    mx.random.seed(3)
    model = Gemma4Model(config)
    model.load_weights([(k, mx.random.normal(v.shape) * v.shape[-1] ** -0.5 if v.ndim > 1
                         else mx.ones(v.shape)) for k, v in tree_flatten(model.parameters())])
    ids = mx.array([[5, 9, 17, 3, 44, 2, 90, 11, 65, 7, 30, 31]])
    nn.quantize(model, group_size=32, bits=8, class_predicate=model.quantize_predicate)
    assert type(model.model.layers[0].experts.gate_up_proj).__name__ == "QuantizedExpertLinear"
    quant_logits = model(ids)
    folder = tmp_path / "q8"
    folder.mkdir()
    mx.save_safetensors(str(folder / "model.safetensors"), dict(tree_flatten(model.parameters())))
    (folder / "config.json").write_text(json.dumps({**config, "quantization":
                                                    {"group_size": 32, "bits": 8}}))
    loaded = mlxrunner.load_model(folder)
    assert loaded.weight_precision == "8-bit affine"
    assert mx.array_equal(loaded(ids), quant_logits)
    check_prefill_decode(loaded, ids, prefill_len=4)


def test_gemma4_moe_grouped_expert_path_equals_per_token_path():
    """Prompts with >= 64 (token, expert) pairs sort tokens by expert; one-token steps don't."""
    model = mlxrunner.load_model(FIXTURES / "moe")
    ids = np.random.default_rng(4).integers(3, 128, (1, 40))
    check_prefill_decode(model, ids, prefill_len=36)


@pytest.mark.parametrize("name", ["e2b", "dense", "moe"])
def test_gemma4_bfloat16_runs_on_the_cpu(name):
    """bf16 weights (MLX's CPU gather_mm is float32-only: the experts fall back)."""
    model = mlxrunner.load_model(FIXTURES / name, dtype="bfloat16")
    with np.load(FIXTURES / name / "reference.npz") as ref:
        ids, expected = ref["ids_20"], ref["logits_20"]
    logits = np.array(model(mx.array(ids)[None])[0].astype(mx.float32))
    # bf16 rounding through the layers: transformers in bf16 is off by ~0.5 on e2b too
    assert np.isfinite(logits).all() and np.abs(logits - expected).max() < 1.0
    assert (logits.argmax(-1) == expected.argmax(-1)).mean() > 0.8


def test_gemma4_conformance_with_a_batch_of_two():
    from mlxrunner.testing import run_conformance

    model = mlxrunner.load_model(FIXTURES / "e2b")
    ran = run_conformance(model, batch=2, prompt_len=14, draft_len=9, rounds=2)
    assert "cache_rollback" in ran


@pytest.mark.parametrize("chunks", [[20], [5, 14], [11, 1, 9]])
def test_gemma4_prefill_runs_the_last_rows_alone_past_the_last_cache_write(chunks, monkeypatch):
    """Inside the core's prefill (last_logits_only) the last layer that writes a cache (5:
    layers 6-9 share) stores every row's keys and values and runs the rest on the chunk's
    last row, and the layers after it take that row alone: the logits and every cache equal
    a whole forward's, for chunks shorter and longer than the window (8) and after earlier
    chunks; inside caches_only (a chunk before the prompt's last) the layers after it do not
    run, no row's logits come, and the caches are the same. A tap before that layer is every
    row's; a tap at or past it keeps every row everywhere (the cut is not taken)."""
    from mlxrunner_gemma4 import model as gemma4

    from mlxrunner import nn as mnn

    rows: list[tuple[int, int]] = []  # each layer's rows in and out

    def spied(self, x, *args):
        out = layer_call(self, x, *args)
        rows.append((x.shape[1], out[0].shape[1]))
        return out

    layer_call = gemma4.DecoderLayer.__call__
    monkeypatch.setattr(gemma4.DecoderLayer, "__call__", spied)
    model = mlxrunner.load_model(FIXTURES / "e2b")
    ids = mx.array(np.random.default_rng(7).integers(3, 128, (1, sum(chunks))))
    whole, cut, skipped = model.make_cache(), model.make_cache(), model.make_cache()
    start = 0
    for n in chunks:
        block = ids[:, start:start + n]
        expected = model(block, cache=whole)[:, -1:]
        rows.clear()
        with mnn.last_logits_only():
            got = model(block, cache=cut)
        assert got.shape[1] == 1 and rows == [(n, n)] * 5 + [(n, 1)] + [(1, 1)] * 4
        np.testing.assert_allclose(np.array(got), np.array(expected), atol=2e-5, rtol=2e-5)
        rows.clear()
        with mnn.caches_only():  # (a chunk before a prompt's last: no layer after 5 runs)
            none = model(block, cache=skipped)
        assert none.shape == (1, 0, model.vocab_size) and rows == [(n, n)] * 5 + [(n, 1)]
        for a, b, c in zip(whole, cut, skipped):
            for x, y, z in zip(a.state if a else (), b.state if b else (), c.state if c else ()):
                assert mx.array_equal(x, y) and mx.array_equal(x, z)
        start += n
    L = ids.shape[1]
    for taps, cut_taken in (([2], True), ([2, 5], False), ([2, 8], False)):
        rows.clear()
        with mnn.last_logits_only():
            logits, tapped = model(ids, taps=taps)
        assert rows == ([(L, L)] * 5 + [(L, 1)] + [(1, 1)] * 4 if cut_taken
                        else [(L, L)] * 10)
        full_logits, full_tapped = model(ids, taps=taps)
        assert tapped.shape == full_tapped.shape and mx.allclose(tapped, full_tapped, atol=1e-5)
        np.testing.assert_allclose(np.array(logits), np.array(full_logits[:, -1:]), atol=2e-5)
        rows.clear()
        with mnn.caches_only():
            _, tapped = model(ids, taps=taps)
        assert rows == ([(L, L)] * 5 + [(L, 1)] if cut_taken else [(L, L)] * 10)
        assert mx.allclose(tapped, full_tapped, atol=1e-5)


@pytest.mark.parametrize("name, layers", [("dense", 8), ("moe", 6)])
def test_gemma4_prefill_without_sharing_runs_the_last_layers_rest_on_one_row(name, layers,
                                                                             monkeypatch):
    """No layer shares keys and values: the last layer is the last cache write, and past its
    keys and values it runs the last row alone; logits and caches equal a whole forward's."""
    from mlxrunner_gemma4 import model as gemma4

    from mlxrunner import nn as mnn

    rows: list[tuple[int, int]] = []
    layer_call = gemma4.DecoderLayer.__call__

    def spied(self, x, *args):
        out = layer_call(self, x, *args)
        rows.append((x.shape[1], out[0].shape[1]))
        return out

    monkeypatch.setattr(gemma4.DecoderLayer, "__call__", spied)
    model = mlxrunner.load_model(FIXTURES / name)
    ids = mx.array(np.random.default_rng(3).integers(3, 128, (1, 13)))
    whole, cut = model.make_cache(), model.make_cache()
    expected = model(ids, cache=whole)[:, -1:]
    rows.clear()
    with mnn.last_logits_only():
        got = model(ids, cache=cut)
    assert rows == [(13, 13)] * (layers - 1) + [(13, 1)]
    np.testing.assert_allclose(np.array(got), np.array(expected), atol=2e-5, rtol=2e-5)
    for a, b in zip(whole, cut):
        for x, y in zip(a.state if a else (), b.state if b else ()):
            assert mx.array_equal(x, y)
