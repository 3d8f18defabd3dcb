"""GGUF files: a tiny Llama written as llama.cpp's converter writes it (the ``gguf`` package's
writer, query/key rows reordered for interleaved RoPE, llama.cpp tensor names and metadata)
runs as the same weights do from a Hugging Face folder; quantized files as their dequantized
weights do; the tokenizer from the metadata encodes as the folder's tokenizer.json does;
transformers' own GGUF loader is the independent reference where it is installed; broken
files are one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np
import pytest

import mlxrunner
from mlxrunner.errors import MLXRunnerError

gguf = pytest.importorskip("gguf", reason="the gguf package writes the test files")
pytest.importorskip("mlxrunner_llama", reason="the llama plugin is not installed")

from gguf import GGMLQuantizationType as Q  # noqa: E402

CONFIG = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
          "intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
          "max_position_embeddings": 256, "tie_word_embeddings": False, "bos_token_id": 0,
          "eos_token_id": 2, "dtype": "float32"}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
            "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEXTS = ["Hello world! 12345 apples, 6.02e23 moles.", "def add(a, b):\n    return a + b\n",
         "<|im_start|>user\nÜber café — naïve 東京<|im_end|>", "  spaces\t\ttabs\n\nnewlines"]
PROMPT = [5, 17, 42, 8, 99, 3, 61, 120, 7, 33]


def _train_tokenizer() -> object:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    # SmolLM2's split (llama.cpp calls it "smollm"): digits one by one, then GPT-2's
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    corpus = ["The quick brown fox jumps over the lazy dog 0123456789.",
              "def add(a, b):\n    return a + b\n", "Hello world, hello there!"] * 20
    tok.train_from_iterator(corpus, trainer)
    return tok


def _hf_weights(config: dict, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    h, f, v = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    d = h // config["num_attention_heads"]
    kv = config["num_key_value_heads"] * d

    def rand(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.08).astype(np.float32)

    w = {"model.embed_tokens.weight": rand(v, h), "model.norm.weight": 1 + rand(h)}
    if not config["tie_word_embeddings"]:
        w["lm_head.weight"] = rand(v, h)
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w |= {p + "input_layernorm.weight": 1 + rand(h),
              p + "post_attention_layernorm.weight": 1 + rand(h),
              p + "self_attn.q_proj.weight": rand(h, h), p + "self_attn.k_proj.weight": rand(kv, h),
              p + "self_attn.v_proj.weight": rand(kv, h), p + "self_attn.o_proj.weight": rand(h, h),
              p + "mlp.gate_proj.weight": rand(f, h), p + "mlp.up_proj.weight": rand(f, h),
              p + "mlp.down_proj.weight": rand(h, f)}
    return w


def _llama_cpp_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's row order for q/k (each head's rotary halves interleaved)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(
        w.shape)


GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}


def _gguf_name(name: str) -> str:
    if name.startswith("model.layers."):
        _, _, index, rest = name.split(".", 3)
        module = rest.rsplit(".", 1)[0]
        return f"blk.{index}.{GGUF_NAMES[module]}.weight"
    return {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight":
            "output_norm.weight", "lm_head.weight": "output.weight"}[name]


def write_gguf(path: Path, config: dict, weights: dict[str, np.ndarray], tok: object,
               qtype: Q = Q.F32, *, tokenizer_model: str = "gpt2", pre: str = "smollm") -> None:
    data = json.loads(tok.to_str())  # type: ignore[attr-defined]
    vocab = sorted(data["model"]["vocab"].items(), key=lambda kv: kv[1])
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny llama")
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_rope_dimension_count(config["hidden_size"] // config["num_attention_heads"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_tokenizer_model(tokenizer_model)
    writer.add_tokenizer_pre(pre)
    writer.add_token_list([t for t, _ in vocab])
    writer.add_token_merges(merges)
    writer.add_token_types([3 if t in SPECIALS else 1 for t, _ in vocab])
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(False)
    writer.add_chat_template(TEMPLATE)
    heads = {"self_attn.q_proj": config["num_attention_heads"],
             "self_attn.k_proj": config["num_key_value_heads"]}
    for name, value in weights.items():
        module = name.rsplit(".", 1)[0].split(".", 3)[-1]
        if module in heads:
            value = _llama_cpp_rows(value, heads[module])
        if value.ndim == 1 or qtype == Q.F32:
            writer.add_tensor(_gguf_name(name), value)
        elif qtype == Q.F16:
            writer.add_tensor(_gguf_name(name), value.astype(np.float16))
        else:
            writer.add_tensor(_gguf_name(name), gguf.quants.quantize(value, qtype),
                              raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def write_folder(folder: Path, config: dict, weights: dict[str, np.ndarray], tok: object
                 ) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    mx.save_safetensors(str(folder / "model.safetensors"),
                        {k: mx.array(v) for k, v in weights.items()})
    tok.save(str(folder / "tokenizer.json"))  # type: ignore[attr-defined]
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "add_bos_token": False,
         "chat_template": TEMPLATE}))
    return folder


def dequantized(weights: dict[str, np.ndarray], qtype: Q) -> dict[str, np.ndarray]:
    """What a file of ``qtype`` stores, as float32 (the gguf package's own round trip)."""
    if qtype in (Q.F32,):
        return weights
    out = {}
    for name, value in weights.items():
        if value.ndim == 1:
            out[name] = value
        elif qtype == Q.F16:
            out[name] = value.astype(np.float16).astype(np.float32)
        else:
            out[name] = gguf.quants.dequantize(gguf.quants.quantize(value, qtype), qtype)
    return out


@pytest.fixture(scope="module")
def tokenizer() -> object:
    return _train_tokenizer()


def _config(tok: object, **overrides: object) -> dict:
    return {**CONFIG, "vocab_size": tok.get_vocab_size(), **overrides}  # type: ignore[attr-defined]


def _logits(model: object, ids: list[int]) -> np.ndarray:
    out = model(mx.array([ids]))  # type: ignore[operator]
    return np.array(out[0].astype(mx.float32))


@pytest.mark.parametrize("qtype,tol", [(Q.F32, 1e-5), (Q.F16, 1e-4), (Q.Q8_0, 1e-4),
                                       (Q.Q4_0, 1e-4), (Q.Q4_1, 1e-4), (Q.Q5_0, 1e-4)])
@pytest.mark.parametrize("tied", [False, True])
def test_gguf_runs_as_the_folder_of_its_weights(tmp_path, tokenizer, qtype, tol, tied):
    config = _config(tokenizer, tie_word_embeddings=tied)
    weights = _hf_weights(config, seed=1)
    write_gguf(tmp_path / "tiny.gguf", config, weights, tokenizer, qtype)
    folder = write_folder(tmp_path / "folder", config, dequantized(weights, qtype), tokenizer)
    from_gguf = mlxrunner.load(tmp_path / "tiny.gguf")
    from_folder = mlxrunner.load(folder)
    got, want = _logits(from_gguf.model, PROMPT), _logits(from_folder.model, PROMPT)
    assert np.abs(got - want).max() < tol * max(1.0, np.abs(want).max())
    # the cached path: the prompt, then one token at a time
    cache = from_gguf.model.make_cache()
    from_gguf.model(mx.array([PROMPT[:7]]), cache=cache)
    steps = [np.array(from_gguf.model(mx.array([[t]]), cache=cache)[0, -1]) for t in PROMPT[7:]]
    assert np.abs(np.stack(steps) - want[7:]).max() < tol * max(1.0, np.abs(want).max())
    # Q4_0/Q4_1/Q8_0 stay quantized: MLX's quantized products on the stored blocks
    if qtype in (Q.Q4_0, Q.Q4_1, Q.Q8_0):
        assert "bit" in mlxrunner.model.weight_precision_of(from_gguf.model)


def test_gguf_rows_are_reordered_for_rotate_half_rope(tmp_path, tokenizer):
    """Without undoing llama.cpp's q/k row order the logits differ: the check above sees it."""
    config = _config(tokenizer)
    weights = _hf_weights(config, seed=2)
    write_gguf(tmp_path / "tiny.gguf", config, weights, tokenizer)
    shuffled = dict(weights)
    for name in weights:
        if "q_proj" in name or "k_proj" in name:
            heads = config["num_attention_heads" if "q_proj" in name else "num_key_value_heads"]
            shuffled[name] = _llama_cpp_rows(weights[name], heads)
    wrong = mlxrunner.load(write_folder(tmp_path / "wrong", config, shuffled, tokenizer))
    got = _logits(mlxrunner.load(tmp_path / "tiny.gguf").model, PROMPT)
    assert np.abs(got - _logits(wrong.model, PROMPT)).max() > 1e-3


def test_gguf_bf16_is_read_exactly(tmp_path, tokenizer):
    config = _config(tokenizer)
    weights = _hf_weights(config, seed=3)
    path = tmp_path / "bf16.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, value in weights.items():
        bits = (mx.array(value).astype(mx.bfloat16).view(mx.uint16))
        writer.add_tensor(_gguf_name(name), np.array(bits), raw_dtype=Q.BF16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    from mlxrunner.model import read_gguf, read_gguf_tensors

    tensors = read_gguf_tensors(read_gguf(path))
    want = mx.array(weights["model.layers.0.mlp.up_proj.weight"]).astype(mx.bfloat16)
    got = tensors["blk.0.ffn_up.weight"]
    assert got.dtype == mx.bfloat16 and bool(mx.array_equal(got, want))


def test_gguf_tokenizer_and_template_match_the_folder(tmp_path, tokenizer):
    config = _config(tokenizer)
    weights = _hf_weights(config, seed=4)
    write_gguf(tmp_path / "tiny.gguf", config, weights, tokenizer)
    from_gguf = mlxrunner.load(tmp_path / "tiny.gguf")
    from_folder = mlxrunner.load(write_folder(tmp_path / "folder", config, weights, tokenizer))
    for text in TEXTS:
        ids = from_folder.tokenizer.encode(text)
        assert from_gguf.tokenizer.encode(text) == ids
        assert from_gguf.tokenizer.decode(ids) == from_folder.tokenizer.decode(ids)
    assert from_gguf.tokenizer.encode("2024")[:4] == [tokenizer.token_to_id(c) for c in "2024"]
    messages = [{"role": "user", "content": "Hi there"}]
    assert from_gguf.renderer.render(messages) == from_folder.renderer.render(messages)
    assert from_gguf.stop_token_ids() == from_folder.stop_token_ids()
    assert from_gguf.tokenizer.special_tokens == from_folder.tokenizer.special_tokens


def test_modelfile_from_a_gguf_file(tmp_path, tokenizer):
    config = _config(tokenizer)
    write_gguf(tmp_path / "tiny.gguf", config, _hf_weights(config, seed=5), tokenizer)
    (tmp_path / "Modelfile").write_text("FROM ./tiny.gguf\nPARAMETER temperature 0.25\n"
                                        "SYSTEM Be brief.\n")
    bundle = mlxrunner.load(tmp_path)
    assert bundle.defaults.temperature == 0.25 and bundle.extra["system"] == "Be brief."
    assert mlxrunner.bundle.stored_precision(bundle) == "GGUF F32"
    (tmp_path / "Modelfile").write_text("FROM ./missing.gguf\n")
    with pytest.raises(MLXRunnerError, match="no such GGUF file"):
        mlxrunner.load(tmp_path)
    with pytest.raises(MLXRunnerError, match="missing.gguf: no such GGUF file"):
        mlxrunner.load(tmp_path / "missing.gguf")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mlxrunner.cli", *args], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "NO_COLOR": "1"})


def test_cli_runs_and_shows_a_gguf_file(tmp_path, tokenizer):
    config = _config(tokenizer)
    write_gguf(tmp_path / "tiny.gguf", config, _hf_weights(config, seed=6), tokenizer, Q.Q8_0)
    run = _cli("run", str(tmp_path / "tiny.gguf"), "Hello", "--max-tokens", "4",
               "--temperature", "0", "--json")
    assert run.returncode == 0, run.stderr
    assert len(json.loads(run.stdout)["tokens"]) == 4
    show = _cli("show", str(tmp_path / "tiny.gguf"))
    assert show.returncode == 0, show.stderr
    assert "GGUF" in show.stdout and "Q8_0" in show.stdout
    assert f"model             {tmp_path / 'tiny.gguf'}" in show.stdout


def test_a_served_gguf_model_says_its_format_and_size(tmp_path, tokenizer):
    """/api/tags and /api/show of a GGUF model: format gguf, the file's size, its weights'
    type (they said safetensors and 0)."""
    httpx = pytest.importorskip("httpx")
    from mlxrunner.serve import Listener, Service, bind, create_app

    config = _config(tokenizer)
    path = tmp_path / "tiny.gguf"
    write_gguf(path, config, _hf_weights(config, seed=6), tokenizer, Q.Q8_0)
    service = Service(mlxrunner.load(path), name="tiny")
    listener = Listener(create_app(service), bind("127.0.0.1", 0)).start()
    try:
        entry = httpx.get(listener.url + "/api/tags").json()["models"][0]
        assert entry["size"] == path.stat().st_size
        assert entry["details"]["format"] == "gguf"
        assert entry["details"]["quantization_level"] == "Q8_0"
    finally:
        listener.stop()


def _corrupt(path: Path, at: int, data: bytes) -> None:
    raw = bytearray(path.read_bytes())
    raw[at:at + len(data)] = data
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize("case,message", [
    ("truncated", "outside the data"),
    ("magic", "no GGUF magic"),
    ("empty", "not a GGUF file"),
    ("overlap", "overlap"),
    ("architecture", "unknown architecture 'gpt-neox-x'"),
    ("tokenizer", "tokenizer model 'llama' is not supported"),
    ("pre", "pre-tokenizer 'made-up' is not supported"),
    ("huge-count", "past the limit"),
])
def test_broken_gguf_files_are_one_line(tmp_path, tokenizer, case, message):
    config = _config(tokenizer)
    weights = _hf_weights(config, seed=7)
    path = tmp_path / "bad.gguf"
    write_gguf(path, config, weights, tokenizer,
               tokenizer_model="llama" if case == "tokenizer" else "gpt2",
               pre="made-up" if case == "pre" else "smollm")
    if case == "truncated":
        path.write_bytes(path.read_bytes()[:-100])
    elif case == "magic":
        _corrupt(path, 0, b"GGUX")
    elif case == "empty":
        path.write_bytes(b"")
    elif case == "huge-count":
        _corrupt(path, 8, (1 << 40).to_bytes(8, "little"))
    elif case == "overlap":
        from mlxrunner.model import read_gguf

        info = read_gguf(path).tensors
        second = sorted(info.values(), key=lambda t: t.offset)[1]
        raw = path.read_bytes()
        # the second tensor's offset field: its name, then dims and type, then the offset
        name = second.name.encode()
        at = raw.index(len(name).to_bytes(8, "little") + name) + 8 + len(name)
        dims = int.from_bytes(raw[at:at + 4], "little")
        offset_at = at + 4 + 8 * dims + 4
        _corrupt(path, offset_at, (0).to_bytes(8, "little"))
    elif case == "architecture":
        writer = gguf.GGUFWriter(str(path), "gpt-neox-x")
        writer.add_tensor("token_embd.weight", weights["model.embed_tokens.weight"])
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
    run = _cli("run", str(path), "Hello", "--max-tokens", "2")
    assert run.returncode != 0
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, run.stderr
    assert message in lines[0] and "Traceback" not in run.stderr


# --------------------------------------------------------------------------- references

def _transformers_logits(path: Path, ids: list[int]) -> np.ndarray:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers reads GGUF files with accelerate")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


@pytest.mark.reference
@pytest.mark.parametrize("qtype", [Q.F32, Q.Q8_0, Q.Q4_0])
def test_gguf_matches_transformers_gguf_loader(tmp_path, tokenizer, qtype):
    """transformers dequantizes and reorders the file itself: an independent reading."""
    config = _config(tokenizer)
    write_gguf(tmp_path / "tiny.gguf", config, _hf_weights(config, seed=8), tokenizer, qtype)
    want = _transformers_logits(tmp_path / "tiny.gguf", PROMPT)
    got = _logits(mlxrunner.load(tmp_path / "tiny.gguf").model, PROMPT)
    assert np.abs(got - want).max() < 1e-4 * max(1.0, np.abs(want).max())


def smollm2_gguf() -> Path | None:
    """SmolLM2-135M-Instruct's GGUF where this machine has it: MLXRUNNER_SMOLLM2_GGUF, or the
    model store's default model."""
    named = os.environ.get("MLXRUNNER_SMOLLM2_GGUF")
    candidates = [Path(named)] if named else []
    store = Path(os.environ.get("MLXRUNNER_MODELS", Path.home() / ".mlxrunner" / "models"))
    candidates += sorted(store.glob("*/SmolLM2-135M-Instruct.Q4_1.gguf"))
    return next((p for p in candidates if p.is_file()), None)


def _smollm2_answer() -> tuple[Path, Any, list[int]]:
    path = smollm2_gguf()
    if path is None:
        pytest.skip("SmolLM2-135M-Instruct's GGUF is not on this machine "
                    "(MLXRUNNER_SMOLLM2_GGUF, or `mlxrunner pull smollm2:135m`)")
    bundle = mlxrunner.load(path)
    prompt = bundle.renderer.render([{"role": "user",
                                      "content": "What is the capital of France?"}])
    ids = bundle.tokenizer.encode(prompt)
    result = mlxrunner.generate(bundle.model, ids, options=mlxrunner.SamplerOptions(
        temperature=0), max_tokens=16, eos_ids=bundle.stop_token_ids())
    assert bundle.tokenizer.decode(result.tokens, skip_special_tokens=True).strip() == \
        "The capital of France is Paris."
    return path, bundle, ids


def test_smollm2_answers():
    _smollm2_answer()


@pytest.mark.reference
def test_smollm2_matches_transformers():
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    path, bundle, ids = _smollm2_answer()
    reference = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    assert reference.apply_chat_template([{"role": "user", "content":
                                           "What is the capital of France?"}],
                                         add_generation_prompt=True)["input_ids"] == ids
    want = _transformers_logits(path, ids)
    got = _logits(bundle.model, ids)
    assert np.abs(got - want).max() < 2e-3 * np.abs(want).max()


def test_convert_and_create_write_safetensors_folders_from_a_gguf_file(tmp_path, tokenizer,
                                                                      monkeypatch):
    """`convert` writes the folder of a GGUF file (its 4/8-bit blocks as MLX's affine
    quantization: the same logits; its tokenizer and template: the same prompt ids);
    `--quantize` dequantizes and quantizes again (logits within that quantization's error);
    `create --quantize` from a Modelfile FROM the file stores such a folder."""
    config = _config(tokenizer)
    write_gguf(tmp_path / "tiny.gguf", config, _hf_weights(config, seed=7), tokenizer, Q.Q4_1)
    run = _cli("convert", str(tmp_path / "tiny.gguf"), str(tmp_path / "out"))
    assert run.returncode == 0, run.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [
        "config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    original, folder = mlxrunner.load(tmp_path / "tiny.gguf"), mlxrunner.load(tmp_path / "out")
    want = _logits(original.model, PROMPT)
    assert np.abs(_logits(folder.model, PROMPT) - want).max() < 1e-5 * max(1, np.abs(want).max())
    chat = [{"role": "user", "content": "hello there"}]
    assert folder.tokenizer.encode(folder.renderer.render(chat)) == \
        original.tokenizer.encode(original.renderer.render(chat))
    assert _cli("convert", str(tmp_path / "tiny.gguf"), str(tmp_path / "out")).returncode == 1
    run = _cli("convert", str(tmp_path / "tiny.gguf"), str(tmp_path / "q8"), "--quantize", "q8")
    assert run.returncode == 0, run.stderr
    requantized = _logits(mlxrunner.load(tmp_path / "q8").model, PROMPT)
    assert np.abs(requantized - want).max() < 0.05 * max(1, np.abs(want).max())
    assert json.loads((tmp_path / "q8" / "config.json").read_text())["quantization"][
        "bits"] == 8
    # create --quantize FROM the file
    monkeypatch.setenv("MLXRUNNER_MODELS", str(tmp_path / "store"))
    (tmp_path / "Modelfile").write_text("FROM ./tiny.gguf\nPARAMETER temperature 0\n")
    made = subprocess.run([sys.executable, "-m", "mlxrunner.cli", "create", "tq", "-f",
                           str(tmp_path / "Modelfile"), "--quantize", "q8"],
                          capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr
    from mlxrunner import store

    store.forget_root()  # the store this test named
    try:
        stored = mlxrunner.load("tq")
    finally:
        monkeypatch.delenv("MLXRUNNER_MODELS")
        store.forget_root()
    assert stored.defaults.temperature == 0
    assert np.abs(_logits(stored.model, PROMPT) - requantized).max() < 1e-5 * max(
        1, np.abs(want).max())
    bad = _cli("convert", str(tmp_path / "Modelfile"), str(tmp_path / "x"))
    assert bad.returncode == 1 and "not a GGUF file" in bad.stderr
