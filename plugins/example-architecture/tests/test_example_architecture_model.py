"""The example architecture against transformers' LlamaForCausalLM.

Everyday tests read the committed fixtures (checkpoint + transformers' outputs, written
by make_fixtures.py) and need no torch; the ``reference`` tests rerun transformers.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlxrunner_example_architecture import plugin
from mlxrunner_example_architecture.model import ExampleLlama

import mlxrunner
from mlxrunner.plugin import KVCache
from mlxrunner.testing import check_taps_against

LOGITS_ATOL = 1e-4  # float32 on the CPU: MLX vs torch differ by ~1e-5 on these fixtures


def _fixture_module():
    path = Path(__file__).with_name("make_fixtures.py")
    spec = importlib.util.spec_from_file_location("example_architecture_make_fixtures", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


fixtures = _fixture_module()
NAMES = sorted(fixtures.FIXTURES)


def load_reference(folder: Path) -> dict[str, np.ndarray]:
    with np.load(folder / "reference.npz") as data:
        return {k: data[k] for k in data.files}


@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers(name):
    folder = fixtures.fixture_path(name)
    model = mlxrunner.load_model(folder)
    assert isinstance(model, ExampleLlama)
    ref = load_reference(folder)
    logits = np.array(model(mx.array(ref["ids"])))
    err = np.abs(logits - ref["logits"]).max()
    assert err < LOGITS_ATOL, f"max |logits - transformers| = {err:.3g}"
    # The fixture's logits are far from zero, so the comparison above means something.
    assert np.abs(ref["logits"]).max() > 1.0
    assert (logits.argmax(-1) == ref["logits"].argmax(-1)).all()


@pytest.mark.parametrize("name", NAMES)
def test_taps_match_transformers_hidden_states(name):
    folder = fixtures.fixture_path(name)
    model = mlxrunner.load_model(folder)
    ref = load_reference(folder)
    # make_fixtures stores the last layer's state before the final norm.
    check_taps_against(model, ref["ids"], list(range(model.num_layers)), ref["hidden_states"],
                       last_entry_is_normed=False)


def test_tied_checkpoint_uses_the_embedding_table_as_head():
    folder = fixtures.fixture_path("tiny-example-llama-tied")
    assert "lm_head.weight" not in mx.load(str(folder / "model.safetensors"))
    model = mlxrunner.load_model(folder)
    assert "lm_head" not in model
    hidden = mx.random.normal((1, 3, model.hidden_size), key=mx.random.key(0))
    expected = hidden @ model.model.embed_tokens.weight.T
    assert mx.allclose(model.raw_logits(hidden), expected, atol=1e-5)


def test_sanitize_drops_rotary_frequencies_and_a_tied_head_copy():
    config = json.loads((fixtures.fixture_path("tiny-example-llama-tied") / "config.json")
                        .read_text())
    weights = {"model.norm.weight": mx.ones((32,)), "lm_head.weight": mx.ones((64, 32)),
               "model.layers.0.self_attn.rotary_emb.inv_freq": mx.ones((4,))}
    assert list(ExampleLlama(config).sanitize(dict(weights))) == ["model.norm.weight"]
    config["tie_word_embeddings"] = False
    assert sorted(ExampleLlama(config).sanitize(dict(weights))) == [
        "lm_head.weight", "model.norm.weight"]


def test_config_reading():
    base = json.loads((fixtures.fixture_path("tiny-example-llama") / "config.json").read_text())
    model = ExampleLlama(base)
    assert (model.num_layers, model.vocab_size, model.hidden_size) == (3, 64, 32)
    assert model.layers[0].self_attn.rope.base == 500.0 and model.cfg.num_key_value_heads == 2
    # Configs written before transformers 5 keep rope_theta at the top level.
    old = {k: v for k, v in base.items() if k != "rope_parameters"} | {"rope_theta": 123.0}
    assert ExampleLlama(old).layers[0].self_attn.rope.base == 123.0
    assert len(model.make_cache()) == 3
    assert all(isinstance(c, KVCache) for c in model.make_cache())


@pytest.mark.parametrize("change, message", [
    ({"hidden_size": None}, "config.json lacks 'hidden_size'"),
    ({"hidden_act": "gelu"}, "hidden_act 'silu' only, got 'gelu'"),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 1.0}},
     "example_llama: unsupported rope_type 'dynamic'"),
])
def test_unsupported_configs_are_one_line_errors(change, message):
    config = json.loads((fixtures.fixture_path("tiny-example-llama") / "config.json").read_text())
    for key, value in change.items():
        if value is None:
            del config[key]
        else:
            config[key] = value
    with pytest.raises(mlxrunner.ModelFolderError, match=None) as info:
        ExampleLlama(config)
    assert message in str(info.value)


def test_plugin_registers_both_names():
    registered = {}
    plugin.register_architectures(lambda name, cls: registered.setdefault(name, cls))
    assert registered == {"ExampleLlamaForCausalLM": ExampleLlama, "example_llama": ExampleLlama}


def test_model_type_alone_finds_the_architecture(tmp_path):
    folder = tmp_path / "by-model-type"
    shutil.copytree(fixtures.fixture_path("tiny-example-llama"), folder)
    config = json.loads((folder / "config.json").read_text())
    del config["architectures"]
    (folder / "config.json").write_text(json.dumps(config))
    assert isinstance(mlxrunner.load_model(folder), ExampleLlama)


def test_taps_outside_the_layers_are_rejected():
    model = mlxrunner.load_model(fixtures.fixture_path("tiny-example-llama-tied"))
    with pytest.raises(ValueError, match=r"tap layers \[2\] out of range 0..1"):
        model(mx.array([[1, 2]]), taps=[0, 2])


# -- against transformers itself (torch) -------------------------------------------

@pytest.mark.reference
@pytest.mark.parametrize("name", NAMES)
def test_committed_reference_is_what_transformers_computes(name):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    folder = fixtures.fixture_path(name)
    ref = load_reference(folder)
    fresh = fixtures.torch_reference(fixtures.torch_model_from_folder(folder), ref["ids"])
    # within the parity tolerance: another CPU sums float32 in another order (seen up to
    # 1.5e-5 between two machines)
    for key in ("logits", "hidden_states"):
        np.testing.assert_allclose(fresh[key], ref[key], rtol=0, atol=1e-4, err_msg=key)


@pytest.mark.reference
def test_a_freshly_written_checkpoint_matches_transformers(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    fields = dict(fixtures.FIXTURES["tiny-example-llama"][0], num_hidden_layers=2,
                  num_key_value_heads=4, tie_word_embeddings=True)
    ref = fixtures.write_fixture(tmp_path / "fresh", fields, seed=1234)
    model = mlxrunner.load_model(tmp_path / "fresh")
    logits, tapped = model(mx.array(ref["ids"]), taps=[0, 1])
    err = np.abs(np.array(logits) - ref["logits"]).max()
    assert err < LOGITS_ATOL, f"max |logits - transformers| = {err:.3g}"
    check_taps_against(model, ref["ids"], [0, 1], ref["hidden_states"],
                       last_entry_is_normed=False)


def test_fixture_is_a_complete_model_folder():
    bundle = mlxrunner.load(fixtures.fixture_path("tiny-example-llama"))
    assert isinstance(bundle.model, ExampleLlama)
    text = "<s>Hello, world!\n"
    ids = bundle.tokenizer.encode(text)
    assert len(ids) == len(text) - 2 and ids[0] == 1 and max(ids) < bundle.model.vocab_size
    assert bundle.tokenizer.decode(ids) == text
    assert 2 in bundle.tokenizer.eos_ids


def greedy(model, prompt: list[int], max_tokens: int, eos: int) -> list[int]:
    cache = model.make_cache()
    logits = model(mx.array([prompt]), cache)
    out: list[int] = []
    while len(out) < max_tokens:
        token = int(mx.argmax(logits[0, -1]))
        out.append(token)
        if token == eos:
            break
        logits = model(mx.array([[token]]), cache)
    return out


def test_the_cli_generates_with_the_plugin():
    cli = Path(sys.executable).with_name("mlxrunner")
    if not cli.exists():
        pytest.skip(f"no mlxrunner command beside {sys.executable}")
    folder = fixtures.fixture_path("tiny-example-llama")
    done = subprocess.run([str(cli), "run", str(folder), "hello", "--temperature", "0",
                           "--max-tokens", "8", "--json"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    bundle = mlxrunner.load(folder)
    prompt = bundle.tokenizer.encode("<s>user: hello\n<s>assistant: ")  # the chat template
    assert result["prompt_tokens"] == len(prompt)
    assert result["tokens"] == greedy(bundle.model, prompt, 8, eos=2)
