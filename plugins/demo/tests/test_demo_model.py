"""The shipped demo pair: registered as ``demo-qwen3.5``, loads, fits the size limit, decodes the
same greedy text with and without its DFlash2 draft; and the recipe's deterministic parts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest
from mlxrunner_demo import MODEL_PATH

import mlxrunner

mx.set_default_device(mx.cpu)

LIMIT_BYTES = 25_000_000
PROMPT = "def fibonacci(n):"

needs_model = pytest.mark.skipif(not (MODEL_PATH / "config.json").exists(),
                                 reason=f"the demo model is not built yet ({MODEL_PATH}); "
                                        "run plugins/demo/recipe/build_demo.py")


def test_plugin_registers_the_shipped_folder_as_demo_qwen3_5():
    from mlxrunner_demo import plugin

    found = {}
    plugin.register_models(lambda name, obj: found.setdefault(name, obj))
    assert found == {"demo-qwen3.5": str(MODEL_PATH)}


def test_the_entry_point_is_found_by_the_cli():
    out = subprocess.run([sys.executable, "-m", "mlxrunner.cli", "models", "--json"],
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "MLXRUNNER_LOAD_PLUGINS": "mlxrunner-demo"})
    assert out.returncode == 0, out.stderr
    assert {"name": "demo-qwen3.5", "plugin": "demo"} in json.loads(out.stdout)


@needs_model
def test_shipped_folder_is_complete_and_within_the_size_limit():
    files = {p.relative_to(MODEL_PATH).as_posix(): p.stat().st_size
             for p in MODEL_PATH.rglob("*") if p.is_file()}
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
                 "generation_config.json", "Modelfile", "draft/config.json",
                 "draft/model.safetensors"):
        assert name in files, name
    weights = files["model.safetensors"] + files["draft/model.safetensors"]
    assert weights <= LIMIT_BYTES and sum(files.values()) <= LIMIT_BYTES, files
    config = json.loads((MODEL_PATH / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5ForCausalLM"]
    assert config["model_type"] == "qwen3_5_text" and config["tie_word_embeddings"]
    assert {"linear_attention", "full_attention"} <= set(config["layer_types"])
    tensors = mx.load(str(MODEL_PATH / "model.safetensors"))
    # stored in bf16, computed in the float32 the config declares (verify and decode agree)
    assert {v.dtype for v in tensors.values()} == {mx.bfloat16} and config["dtype"] == "float32"
    assert mlxrunner.load_model(MODEL_PATH).dtype == mx.float32
    draft = json.loads((MODEL_PATH / "draft" / "config.json").read_text())
    assert draft["architectures"] == ["DFlash2DraftModel"] and draft["dtype"] == "bfloat16"
    section = draft["dflash_config"]
    assert section["block_size"] == 8
    assert section["target_layer_ids"] == sorted(section["target_layer_ids"])
    assert max(section["target_layer_ids"]) < config["num_hidden_layers"]
    assert section["mask_token_id"] == 1  # <|mask|>
    draft_tensors = mx.load(str(MODEL_PATH / "draft" / "model.safetensors"))
    assert {v.dtype for v in draft_tensors.values()} == {mx.bfloat16}


@needs_model
def test_default_loads_with_its_tokenizer_renderer_and_draft():
    bundle = mlxrunner.load("demo-qwen3.5")
    assert bundle.path.resolve() == MODEL_PATH.resolve()
    assert type(bundle.draft).__name__ == "DFlash2DraftModel"
    tok = bundle.tokenizer
    assert tok.eos_ids == frozenset({0}) and tok.token_to_id("<|endoftext|>") == 0
    assert tok.token_to_id("<|mask|>") == 1
    assert tok.decode(tok.encode("    return x\n")) == "    return x\n"
    # the Modelfile's jinja renderer passes a prompt through unchanged: a code model, no chat
    assert bundle.renderer.render([{"role": "user", "content": PROMPT}]) == PROMPT
    assert bundle.defaults.temperature == 0


@needs_model
def test_greedy_speculative_output_equals_plain_greedy_output():
    bundle = mlxrunner.load("demo-qwen3.5", dtype="float32")
    tok = bundle.tokenizer
    ids = tok.encode(PROMPT)
    options = mlxrunner.SamplerOptions(temperature=0.0)
    plain = mlxrunner.generate(bundle.model, ids, options=options, max_tokens=64,
                               eos_ids=tok.eos_ids)
    spec = mlxrunner.generate(bundle.model, ids, options=options, max_tokens=64,
                              eos_ids=tok.eos_ids, draft=bundle.draft)
    assert spec.tokens == plain.tokens
    stats = spec.stats
    assert stats.rounds > 0 and stats.tau > 1.5, stats.as_dict()  # the draft earns its keep
    text = tok.decode(plain.tokens)
    assert "\n" in text and any(word in text for word in ("return", "if ", "self", " = "))


@needs_model
def test_bench_reports_both_modes_taking_turns(tmp_path):
    """``mlxrunner bench default``: plain and speculative rows, the speedup of the best runs
    and the median of per-pair speedups, identical output in every timed run."""
    out = tmp_path / "bench.json"
    run = subprocess.run([sys.executable, "-m", "mlxrunner.cli", "bench", "demo-qwen3.5",
                          "--prompt", PROMPT, "--max-tokens", "24", "--repeats", "3",
                          "--warmup", "1", "--json", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    plain, spec = json.loads(out.read_text())["results"]
    assert (plain["mode"], spec["mode"]) == ("plain", "speculative")
    assert plain["generated_tokens"] == spec["generated_tokens"] == 24
    assert spec["identical_to_plain"] is True and spec["tau"] > 1.0
    assert spec["speedup"] == round(spec["tokens_per_second"] / plain["tokens_per_second"], 3)
    assert spec["speedup_median"] > 0
    assert "speedup_median" in run.stdout


# -- the recipe's deterministic parts ------------------------------------------------------------


def test_recipe_selects_the_same_corpus_every_time(demo_recipe):
    r = demo_recipe
    root = r.stdlib_root()
    train_a, held_a = r.select_corpus(root, 0, 0.03)
    train_b, held_b = r.select_corpus(root, 0, 0.03)
    assert (train_a, held_a) == (train_b, held_b)
    assert held_a and not set(train_a) & set(held_a)
    assert train_a == sorted(train_a)
    for f in train_a + held_a:
        rel = f.relative_to(root).parts
        assert f.suffix == ".py" and "site-packages" not in rel
        assert f.stat().st_size <= r.MAX_FILE_BYTES


def test_recipe_saves_a_hugging_face_folder_that_loads_back(demo_recipe, tmp_path):
    r = demo_recipe
    preset = r.PRESETS["tiny"]
    train_files, _ = r.select_corpus(r.stdlib_root(), 0, 0.1, max_files=6)
    tok = r.train_tokenizer(train_files, preset.vocab_size, tmp_path)
    assert [tok.token_to_id(t) for t in r.SPECIAL_TOKENS] == [0, 1, 2]
    config = r.target_config(preset)
    model = r.build_target(config, 3)
    r.save_target(model, config, tmp_path, preset)
    hf = mx.load(str(tmp_path / "model.safetensors"))
    conv = [v for k, v in hf.items() if k.endswith("conv1d.weight")]
    assert conv and all(v.shape[1] == 1 for v in conv)  # Hugging Face [C, 1, K]
    assert abs(float(hf["model.norm.weight"].astype(mx.float32).mean().item())) < 1e-6  # w of 1+w
    loaded = mlxrunner.load_model(tmp_path, dtype="float32")
    model.set_dtype(mx.bfloat16)  # the saved precision
    model.set_dtype(mx.float32)
    x = mx.array(np.arange(1, 40, dtype=np.int32)[None] % preset.vocab_size)
    np.testing.assert_allclose(np.array(loaded(x)), np.array(model(x)), atol=2e-2)


@pytest.mark.reference
@needs_model
def test_shipped_target_matches_transformers():
    """transformers (CPU torch, float32) reads the shipped folder as its own Qwen3.5 model."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(MODEL_PATH),
                                                            dtype=torch.float32)
    ids = mlxrunner.load("demo-qwen3.5", use_draft=False).tokenizer.encode(
        "import os\n\ndef main(argv):\n    return 0\n")
    with torch.no_grad():
        expected = ref(torch.tensor([ids])).logits[0].numpy()
    model = mlxrunner.load_model(MODEL_PATH, dtype="float32")
    got = np.array(model(mx.array([ids]))[0])
    # mlxrunner's Qwen3.5 sanitize folds the 1 + w of zero-centred norms in the checkpoint's
    # dtype (bf16), transformers in float32: logits (magnitude ~5) differ by up to ~6e-3.
    np.testing.assert_allclose(got, expected, atol=1e-2, rtol=1e-3)
    assert (got.argmax(-1) == expected.argmax(-1)).mean() > 0.95


@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("MLXRUNNER_SLOW_TESTS"),
                    reason="set MLXRUNNER_SLOW_TESTS=1 (about 20-40 s: the whole recipe, tiny)")
def test_recipe_builds_a_working_pair_end_to_end(demo_recipe, tmp_path):
    out = tmp_path / "model"
    assert demo_recipe.main(["--out", str(out), "--preset", "tiny", "--measure-prompts", "1",
                             "--measure-tokens", "24"]) == 0
    summary = json.loads((tmp_path / "model.build" / "build_summary.json").read_text())
    assert summary["measure"]["identical_to_plain"]
    assert summary["target"]["reload_max_abs_logit_diff"] < 0.05
    assert (tmp_path / "model.build" / "model_card_figures.md").exists()
    bundle = mlxrunner.load(str(out))
    assert type(bundle.draft).__name__ == "DFlash2DraftModel"
