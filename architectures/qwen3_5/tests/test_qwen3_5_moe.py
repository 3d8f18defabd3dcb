"""Qwen3.5 mixture of experts (``qwen3_5_moe``) against transformers and mlx-lm.

Fixture: ``moe_fixtures/tiny_moe`` (make_moe_fixtures.py): what transformers 5.24's
``Qwen3_5MoeForCausalLM.save_pretrained`` writes, which is the per-expert layout
(``mlp.experts.N.{gate,up,down}_proj.weight``), and transformers' float32 logits and hidden
states. The other two expert layouts are derived from the same tensors by re-keying them
(no arithmetic on the expert weights): transformers' fused ``mlp.experts.gate_up_proj`` /
``down_proj`` (its in-memory layout, gate rows then up rows) and mlx-lm's converted folder
(``language_model.*`` names, stacked ``switch_mlp.*`` experts, ``1 + w`` norms, ``[C, K, 1]``
convolutions; a reference test checks that mlx-lm itself computes the same logits from it).

Tolerances, float32 on the CPU: max abs logit error < 1e-4 against transformers (logits are
O(3); transformers' own float32 run is 6e-5 from its float64 run at 40 tokens); hidden
states < 2e-5 times the layer's largest |value|. Against mlx-lm on the same q4/q8 weights
(both sides gather_qmm on identical packed tensors): < 1e-4.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
from pathlib import Path
from types import ModuleType
from typing import Any

import mlx.core as mx
import numpy as np
import pytest
from mlx.utils import tree_flatten

import mlxrunner
from mlxrunner.plugin import registered
from mlxrunner.testing import check_prefill_decode, check_taps_against, run_conformance

mx.set_default_device(mx.cpu)

HERE = Path(__file__).resolve().parent
FIXTURE = HERE / "moe_fixtures" / "tiny_moe"
DENSE_FIXTURE = HERE / "fixtures" / "tiny_hk2_hv4_tied"
LAYOUTS = ("per_expert", "fused", "switch_mlp")
TOLERANCE = 1e-4
MOE_NAMES = ("Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM", "qwen3_5_moe",
             "qwen3_5_moe_text")

_PER_EXPERT = re.compile(r"(.*\.mlp)\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
_ZERO_CENTRED = ("input_layernorm.weight", "post_attention_layernorm.weight", "q_norm.weight",
                 "k_norm.weight")


def max_err(a: mx.array, b: np.ndarray | mx.array) -> float:
    return float(np.abs(np.array(a.astype(mx.float32)) - np.array(b)).max())


@pytest.fixture(scope="module")
def ref() -> dict[str, np.ndarray]:
    with np.load(FIXTURE / "reference.npz") as data:
        return dict(data)


# -- the three layouts, from the committed tensors -----------------------------------------


def stacked_experts(weights: dict[str, mx.array]) -> tuple[dict[str, mx.array],
                                                           dict[str, dict[str, mx.array]]]:
    """The non-expert tensors, and per layer prefix the experts' gate/up/down stacked
    ``[E, out, in]`` in expert order."""
    rest: dict[str, mx.array] = {}
    found: dict[str, dict[str, dict[int, mx.array]]] = {}
    for key, value in weights.items():
        if m := _PER_EXPERT.match(key):
            prefix, expert, proj = m.groups()
            found.setdefault(prefix, {}).setdefault(proj, {})[int(expert)] = value
        else:
            rest[key] = value
    stacks = {prefix: {proj: mx.stack([by[e] for e in sorted(by)]) for proj, by in projs.items()}
              for prefix, projs in found.items()}
    return rest, stacks


def composite_config(text: dict[str, Any]) -> dict[str, Any]:
    return {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
            "tie_word_embeddings": text["tie_word_embeddings"],
            "text_config": {**{k: v for k, v in text.items() if k != "architectures"},
                            "model_type": "qwen3_5_moe_text"}}


def write_layout(layout: str, folder: Path, config_changes: dict[str, Any] | None = None
                 ) -> Path:
    text = {**json.loads((FIXTURE / "config.json").read_text()), **(config_changes or {})}
    weights = mx.load(str(FIXTURE / "model.safetensors"))
    folder.mkdir(parents=True)
    if layout == "per_expert":
        shutil.copy(FIXTURE / "model.safetensors", folder / "model.safetensors")
        (folder / "config.json").write_text(json.dumps(text))
        return folder
    rest, stacks = stacked_experts(weights)
    if layout == "fused":
        out = dict(rest)
        for prefix, s in stacks.items():
            out[f"{prefix}.experts.gate_up_proj"] = mx.concatenate([s["gate"], s["up"]], axis=1)
            out[f"{prefix}.experts.down_proj"] = s["down"]
        config = text
    else:  # mlx-lm's converted folder
        out = {}
        for key, value in rest.items():
            if key.endswith("conv1d.weight"):
                value = value.swapaxes(1, 2)
            elif key == "model.norm.weight" or key.endswith(_ZERO_CENTRED):
                value = value + 1.0
            out["language_model." + key] = value
        for prefix, s in stacks.items():
            for proj in ("gate", "up", "down"):
                out[f"language_model.{prefix}.switch_mlp.{proj}_proj.weight"] = s[proj]
        config = composite_config(text)
    mx.save_safetensors(str(folder / "model.safetensors"), out)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def layout_folders(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe_layouts")
    return {layout: write_layout(layout, root / layout) for layout in LAYOUTS}


@pytest.fixture(scope="module")
def models(layout_folders) -> dict[str, Any]:
    return {layout: mlxrunner.load_model(folder) for layout, folder in layout_folders.items()}


# -- structure --------------------------------------------------------------------------------


def test_fixture_is_small():
    assert sum(p.stat().st_size for p in FIXTURE.iterdir()) < 2_000_000


def test_registered_names_and_sparse_layers(models):
    registry = registered("architectures")
    classes = {registry[name].obj for name in MOE_NAMES}
    assert len(classes) == 1
    model = models["per_expert"]
    assert type(model) in classes and type(model).__name__ == "Qwen3_5Moe"
    assert [type(layer.mlp).__name__ for layer in model.layers] == ["SparseMoeBlock"] * 4
    mlp = model.layers[0].mlp
    assert mlp.experts.gate_up_proj.weight.shape == (8, 64, 64)
    assert mlp.experts.down_proj.weight.shape == (8, 64, 32)


def test_three_layouts_hold_the_same_parameters(models):
    want = dict(tree_flatten(models["per_expert"].parameters()))
    for layout in ("fused", "switch_mlp"):
        got = dict(tree_flatten(models[layout].parameters()))
        assert sorted(got) == sorted(want)
        for key, value in want.items():
            # the mlx-lm layout's 1 + w norms round when taken back to w
            assert float(mx.abs(got[key] - value).max()) <= 1e-7, (layout, key)


def test_published_35b_a3b_shape_builds():
    """Qwen3.5-35B-A3B's text config (hidden 2048, 40 layers, 256 experts of width 512, 8 per
    token, a shared expert, vocabulary 248320) builds 34.66e9 parameters, of which a token
    uses about 3e9 past its embedding row (the "A3B"); built lazily, nothing is allocated."""
    text = {"model_type": "qwen3_5_moe_text", "vocab_size": 248320, "hidden_size": 2048,
            "num_hidden_layers": 40, "full_attention_interval": 4, "num_attention_heads": 16,
            "num_key_value_heads": 2, "head_dim": 256, "linear_num_key_heads": 16,
            "linear_num_value_heads": 32, "linear_key_head_dim": 128,
            "linear_value_head_dim": 128, "num_experts": 256, "num_experts_per_tok": 8,
            "moe_intermediate_size": 512, "shared_expert_intermediate_size": 512,
            "tie_word_embeddings": False}
    model = mlxrunner.build_model(composite_config(text))
    sizes = {name: value.size for name, value in tree_flatten(model.parameters())}
    total = sum(sizes.values())
    experts = sum(n for name, n in sizes.items() if ".mlp.experts." in name)
    active = total - experts + experts * 8 // 256 - sizes["model.embed_tokens.weight"]
    assert 34.6e9 < total < 34.7e9 and 2.9e9 < active < 3.0e9, (total, active)
    assert [layer.is_linear for layer in model.layers[:4]] == [True, True, True, False]


def test_hub_composite_layout_loads(tmp_path, ref):
    """A Hub folder: composite config, text weights under model.language_model.* with fused
    experts, and the vision tower and MTP head beside them (dropped)."""
    folder = write_layout("fused", tmp_path / "fused")
    weights = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
               for k, v in mx.load(str(folder / "model.safetensors")).items()}
    weights.update({"model.visual.blocks.0.attn.qkv.weight": mx.ones((6, 2)),
                    "mtp.layers.0.mlp.experts.gate_up_proj": mx.ones((8, 64, 64)),
                    "mtp.fc.weight": mx.ones((64, 128))})
    hub = tmp_path / "hub"
    hub.mkdir()
    mx.save_safetensors(str(hub / "model.safetensors"), weights)
    config = composite_config(json.loads((FIXTURE / "config.json").read_text()))
    config["vision_config"] = {"model_type": "qwen3_5_moe_vision", "depth": 1}
    (hub / "config.json").write_text(json.dumps(config))
    model = mlxrunner.load_model(hub)
    assert max_err(model(mx.array(ref["ids_40"]))[0], ref["logits_40"]) < TOLERANCE


# -- parity with transformers -----------------------------------------------------------------


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("length", [1, 7, 40])
def test_logits_match_transformers(layout, length, models, ref):
    logits = models[layout](mx.array(ref[f"ids_{length}"]))
    assert logits.shape == (1, length, 256)
    assert max_err(logits[0], ref[f"logits_{length}"]) < TOLERANCE


@pytest.mark.parametrize("layout", LAYOUTS)
def test_prefill_then_single_steps_match_transformers(layout, models, ref):
    """Prefill 30 tokens (the sorted expert path: 90 token-expert pairs), then one token at
    a time (the unsorted path)."""
    model = models[layout]
    ids = mx.array(ref["ids_40"])
    cache = model.make_cache()
    parts = [model(ids[:, :30], cache)] + [model(ids[:, t:t + 1], cache) for t in range(30, 40)]
    assert max_err(mx.concatenate(parts, axis=1)[0], ref["logits_40"]) < TOLERANCE
    check_prefill_decode(model, ref["ids_7"])


def test_taps_equal_transformers_hidden_states(models, ref):
    model = models["per_expert"]
    hidden = ref["hidden_40"]
    # the last tap is skipped: transformers' last entry is after the final norm
    check_taps_against(model, ref["ids_40"], [0, 1, 2, 3], list(hidden[:, None]),
                       atol=2e-5 * float(np.abs(hidden).max()))
    logits, tapped = model(mx.array(ref["ids_40"]), taps=[3])
    assert max_err(model.model.norm(tapped)[0], hidden[4]) < 2e-5 * float(np.abs(hidden).max())
    assert max_err(model.raw_logits(model.model.norm(tapped))[0], ref["logits_40"]) < TOLERANCE


def test_conformance(models):
    ran = run_conformance(models["fused"], prompt_len=12, draft_len=5, seed=2)
    assert {"prefill_decode", "taps+layer_index", "cache_rollback", "compiled_step"} <= set(ran)


def test_speculative_greedy_with_a_dflash2_draft_equals_plain_greedy(models):
    pytest.importorskip("mlxrunner_dflash", reason="the dflash plugin is not installed")
    from mlxrunner.testing.speculative import check_speculative_greedy, random_draft

    stats = check_speculative_greedy(
        models["per_expert"], lambda m: random_draft(m, "DFlash2DraftModel", seed=5),
        max_tokens=60, prompts=1, prompt_len=8, seed=3, random_drafts=False)
    assert all(s.generated_tokens == 60 for s in stats)


# -- the router and the config keys ------------------------------------------------------------


def routed(model: Any, layer: int, x: mx.array) -> tuple[np.ndarray, np.ndarray]:
    indices, weights = model.layers[layer].mlp.route(x)
    return np.array(indices), np.array(weights)


def test_router_picks_the_top_k_by_softmax_and_renormalises(models, tmp_path):
    model = models["per_expert"]
    x = mx.random.normal((5, 64), key=mx.random.key(0))
    probs = np.array(mx.softmax(model.layers[1].mlp.gate(x), axis=-1))
    indices, weights = routed(model, 1, x)
    want = np.argsort(-probs, axis=-1)[:, :3]
    assert (np.sort(indices, -1) == np.sort(want, -1)).all()
    chosen = np.take_along_axis(probs, indices, -1)
    assert np.abs(weights - chosen / chosen.sum(-1, keepdims=True)).max() < 1e-6
    # norm_topk_prob false: the full softmax's probabilities, not renormalised
    plain = mlxrunner.load_model(write_layout("fused", tmp_path / "plain",
                                              {"norm_topk_prob": False}))
    _, weights = routed(plain, 1, x)
    assert np.abs(weights - chosen).max() < 1e-6 and (weights.sum(-1) < 1 - 1e-5).all()


def dense_as_moe(folder: Path, changes: dict[str, Any]) -> Path:
    """The dense fixture's folder with a qwen3_5_moe config (experts of width 16)."""
    folder.mkdir(parents=True)
    text = json.loads((DENSE_FIXTURE / "config.json").read_text())
    text.update(architectures=["Qwen3_5MoeForCausalLM"], model_type="qwen3_5_moe_text",
                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                shared_expert_intermediate_size=16, **changes)
    (folder / "config.json").write_text(json.dumps(text))
    return folder


def test_mlp_only_layers_and_decoder_sparse_step(tmp_path):
    """Layers listed in mlp_only_layers, and those with (i + 1) % decoder_sparse_step != 0,
    keep the dense MLP: with every layer dense the MoE class computes the dense model
    (transformers' Qwen3_5ForCausalLM logits); with step 2 layers 0 and 2 stay dense, so
    the first tap is still the dense model's."""
    with np.load(DENSE_FIXTURE / "reference.npz") as data:
        dense = dict(data)
    folder = dense_as_moe(tmp_path / "all_dense", {"mlp_only_layers": [0, 1, 2, 3]})
    shutil.copy(DENSE_FIXTURE / "model.safetensors", folder / "model.safetensors")
    model = mlxrunner.load_model(folder)
    assert type(model).__name__ == "Qwen3_5Moe"
    assert [type(layer.mlp).__name__ for layer in model.layers] == ["GatedMLP"] * 4
    assert max_err(model(mx.array(dense["ids_7"]))[0], dense["logits_7"]) < TOLERANCE

    stepped = dense_as_moe(tmp_path / "step2", {"decoder_sparse_step": 2})
    moe_model = mlxrunner.build_model(json.loads((stepped / "config.json").read_text()))
    assert [type(layer.mlp).__name__ for layer in moe_model.layers] == [
        "GatedMLP", "SparseMoeBlock", "GatedMLP", "SparseMoeBlock"]
    weights = dict(mx.load(str(DENSE_FIXTURE / "model.safetensors")))
    for i in (1, 3):
        for proj in ("gate_proj", "up_proj", "down_proj"):
            del weights[f"model.layers.{i}.mlp.{proj}.weight"]
    for n, (key, value) in enumerate(tree_flatten(moe_model.parameters())):
        if re.match(r"model\.layers\.[13]\.mlp\.", key):
            weights[key] = 0.2 * mx.random.normal(value.shape, key=mx.random.key(n))
    mx.save_safetensors(str(stepped / "model.safetensors"), weights)
    model = mlxrunner.load_model(stepped)
    _, tapped = model(mx.array(dense["ids_7"]), taps=[0, 1])
    assert max_err(tapped[0, :, :32], dense["hidden_7"][1]) < 2e-5 * 12
    assert max_err(tapped[0, :, 32:], dense["hidden_7"][2]) > 1e-2  # layer 1 is sparse now


@pytest.mark.parametrize("changes, message", [
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"moe_intermediate_size": 0}, "moe_intermediate_size"),
    ({"mlp_only_layers": [1]}, "intermediate_size"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step"),
    ({"norm_topk_prob": "yes"}, "norm_topk_prob"),
    ({"mlp_only_layers": [-1]}, "mlp_only_layers"),
])
def test_bad_config_is_one_clear_error(changes, message, tmp_path):
    folder = write_layout("per_expert", tmp_path / "bad", changes)
    with pytest.raises(mlxrunner.ModelFolderError, match=message):
        mlxrunner.load_model(folder)


def test_missing_expert_is_one_clear_error(tmp_path):
    folder = write_layout("per_expert", tmp_path / "missing")
    weights = mx.load(str(folder / "model.safetensors"))
    del weights["model.layers.2.mlp.experts.5.up_proj.weight"]
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    with pytest.raises(mlxrunner.ModelFolderError, match=r"found 7 of 8 experts"):
        mlxrunner.load_model(folder)


def test_dense_class_refuses_experts():
    registry = registered("architectures")
    config = json.loads((FIXTURE / "config.json").read_text())
    with pytest.raises(mlxrunner.ModelFolderError, match="qwen3_5_moe"):
        registry["qwen3_5"].obj(config)


# -- live references (transformers, mlx-lm) -----------------------------------------------


def make_moe_fixtures() -> ModuleType:
    spec = importlib.util.spec_from_file_location("qwen3_5_make_moe_fixtures",
                                                  HERE / "make_moe_fixtures.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.reference
def test_regenerated_fixture_matches_committed(tmp_path, ref):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    folder = tmp_path / "tiny_moe"
    make_moe_fixtures().write_fixture("tiny_moe", folder)
    with np.load(folder / "reference.npz") as fresh:
        assert sorted(fresh.files) == sorted(ref)
        for key in fresh.files:
            # within the parity tolerance: another CPU sums float32 in another order
            # (seen up to 1.5e-5 between two machines)
            assert np.abs(fresh[key] - ref[key]).max() < TOLERANCE, key
    assert mx.load(str(folder / "model.safetensors")).keys() == \
        mx.load(str(FIXTURE / "model.safetensors")).keys()


@pytest.mark.reference
def test_no_further_from_float64_than_transformers_float32(models, ref):
    """Against transformers run in float64 (eager experts) on the same weights, our float32
    logits are no further off than transformers' own float32 ones (times 1.5)."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("transformers")
    reference = make_moe_fixtures().build_model("tiny_moe")
    reference.set_experts_implementation("eager")  # grouped_mm takes no float64
    reference = reference.double()
    ids = ref["ids_40"]
    with torch.no_grad():
        exact = reference(input_ids=torch.from_numpy(ids).long(), use_cache=False).logits[0]
    exact = exact.numpy()
    ours = max_err(models["per_expert"](mx.array(ids))[0], exact)
    theirs = float(np.abs(ref["logits_40"] - exact).max())
    assert ours < 1.5 * theirs, (ours, theirs)


def mlx_lm_model(folder: Path) -> tuple[Any, dict]:
    pytest.importorskip("mlx_lm")
    from mlx_lm.utils import load_model

    return load_model(folder)


def assert_same_as(ours: Any, theirs: Any, ids: mx.array, tol: float) -> None:
    assert max_err(ours(ids), theirs(ids)) < tol
    cache_a, cache_b = ours.make_cache(), theirs.make_cache()
    a = [ours(ids[:, :30], cache_a)] + [ours(ids[:, t:t + 1], cache_a) for t in range(30, 40)]
    b = [theirs(ids[:, :30], cache=cache_b)] + [theirs(ids[:, t:t + 1], cache=cache_b)
                                                for t in range(30, 40)]
    assert max_err(mx.concatenate(a, axis=1), mx.concatenate(b, axis=1)) < tol


@pytest.mark.reference
@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_mlx_lm_reads_the_switch_layout_as_we_do(norm_topk_prob, tmp_path, ref):
    """mlx-lm 0.32.2's qwen3_5_moe on the derived mlx-lm folder: the same float32 logits
    (so the derived folder is mlx-lm's layout); with norm_topk_prob false too (transformers'
    qwen3_5_moe always renormalises; mlx-lm reads the key, default true, as we do)."""
    folder = write_layout("switch_mlp", tmp_path / "switch", {"norm_topk_prob": norm_topk_prob})
    theirs, _ = mlx_lm_model(folder)
    ours = mlxrunner.load_model(folder)
    assert_same_as(ours, theirs, mx.array(ref["ids_40"]), TOLERANCE)
    if norm_topk_prob:
        assert max_err(ours(mx.array(ref["ids_40"]))[0], ref["logits_40"]) < TOLERANCE


@pytest.mark.reference
@pytest.mark.parametrize("bits", [4, 8])
def test_mlx_lm_quantized_conversion(bits, tmp_path, ref):
    """mlx-lm's own quantize_model (its predicate: routers and shared-expert gates at 8 bits,
    group 64; the rest at ``bits``, group 32) and save_model/save_config write the folder;
    our model from it computes mlx-lm's logits on those weights, through gather_qmm."""
    pytest.importorskip("mlx_lm")
    from mlx_lm.utils import quantize_model, save_config, save_model

    theirs, config = mlx_lm_model(write_layout("switch_mlp", tmp_path / "switch"))
    theirs, config = quantize_model(theirs, config, group_size=32, bits=bits)
    folder = tmp_path / f"q{bits}"
    save_model(folder, theirs)
    save_config(config, folder / "config.json")
    ours = mlxrunner.load_model(folder)
    experts = ours.layers[0].mlp.experts
    assert type(experts.gate_up_proj).__name__ == "QuantizedExpertLinear"
    assert experts.gate_up_proj.bits == bits and experts.gate_up_proj.group_size == 32
    assert ours.layers[0].mlp.gate.bits == 8 and ours.layers[0].mlp.gate.group_size == 64
    ids = mx.array(ref["ids_40"])
    assert_same_as(ours, theirs, ids, TOLERANCE)
    # quantization changed the model (the comparison is not float against float)
    assert max_err(ours(ids)[0], ref["logits_40"]) > 1e-3
