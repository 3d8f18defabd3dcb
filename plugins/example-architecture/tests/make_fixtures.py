"""Write the tiny test checkpoints and their reference outputs (needs torch + transformers).

    /work/venv/bin/python plugins/example-architecture/tests/make_fixtures.py

Each fixture folder is a complete model folder: a real transformers ``LlamaForCausalLM``
checkpoint with random weights, written by ``save_pretrained`` on the CPU in float32, whose
config.json is then renamed to this plugin's architecture (``ExampleLlamaForCausalLM`` /
``example_llama``) so that it cannot be mistaken for a real Llama, plus a character-level
tokenizer and a chat template (so ``mlxrunner run`` works on it). ``reference.npz`` holds
transformers' outputs for fixed token ids:

- ``ids``: ``[B, L]`` int32 token ids;
- ``logits``: ``[B, L, V]`` float32;
- ``hidden_states``: ``[num_layers + 1, B, L, hidden]`` float32 in transformers'
  ``output_hidden_states`` order (entry 0 the embeddings, entry i + 1 after layer i), except
  that the last entry is the residual stream *before* the final norm (transformers puts the
  normed one there), which is what mlxrunner's taps return.

The tests import this module for ``FIXTURES``, ``fixture_path`` and (reference tests only)
``write_fixture`` / ``torch_reference``; torch is imported inside those functions only.
"""

from __future__ import annotations

import json
import string
from pathlib import Path
from typing import Any

import numpy as np

FIXTURES_DIR = Path(__file__).resolve().parent / "fixtures"
ARCHITECTURE = "ExampleLlamaForCausalLM"
MODEL_TYPE = "example_llama"

# name -> (transformers LlamaConfig fields, seed). Kept tiny: each folder is < 150 KB.
FIXTURES: dict[str, tuple[dict[str, Any], int]] = {
    "tiny-example-llama": (dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        tie_word_embeddings=False), 0),
    "tiny-example-llama-tied": (dict(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=8, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True), 1),
}
BATCH, LENGTH = 2, 9

# A character-level tokenizer so that a fixture is a complete model folder (`mlxrunner run`
# works on it): 3 special tokens + 61 characters = the fixtures' vocabulary of 64.
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]  # ids 0, 1, 2: LlamaConfig's bos/eos defaults
CHARACTERS = " " + string.ascii_lowercase + string.ascii_uppercase + ".,!?'-:\n"
CHAT_TEMPLATE = (
    "{% for message in messages %}<s>{{ message.role }}: {{ message.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<s>assistant: {% endif %}"
)


def fixture_path(name: str) -> Path:
    return FIXTURES_DIR / name


def reference_ids(vocab_size: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab_size, (BATCH, LENGTH)).astype(np.int32)


def _random_llama(fields: dict[str, Any], seed: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**fields)).float().eval()
    # transformers' init (std 0.02, norms at 1) gives near-zero logits that would hide
    # mistakes; larger weights and uneven norm scales make every part of the model matter.
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1.0 + 0.3 * torch.randn_like(param))
            else:
                param.copy_(0.25 * torch.randn_like(param))
    return model


def torch_reference(model, ids: np.ndarray) -> dict[str, np.ndarray]:
    """Logits and hidden states (last one before the final norm) of a torch Llama."""
    import torch

    captured: dict[str, torch.Tensor] = {}

    def keep_last_layer_output(_module, _inputs, output):
        captured["last"] = output[0] if isinstance(output, tuple) else output

    hook = model.model.layers[-1].register_forward_hook(keep_last_layer_output)
    try:
        with torch.no_grad():
            out = model(torch.from_numpy(ids).long(), output_hidden_states=True)
    finally:
        hook.remove()
    hidden = [h.float().numpy() for h in out.hidden_states]
    with torch.no_grad():
        normed = model.model.norm(captured["last"])
    # Guard the convention this file documents: transformers' last entry is the normed one.
    assert np.allclose(hidden[-1], normed.numpy(), atol=1e-6), "unexpected hidden_states layout"
    hidden[-1] = captured["last"].float().numpy()
    return {"ids": ids, "logits": out.logits.float().numpy(), "hidden_states": np.stack(hidden)}


def torch_model_from_folder(folder: Path):
    """A transformers Llama holding a fixture folder's weights (config renamed back)."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    config = json.loads((folder / "config.json").read_text())
    fields = {k: v for k, v in config.items()
              if k not in ("architectures", "model_type", "transformers_version")}
    model = LlamaForCausalLM(LlamaConfig(**fields)).float().eval()
    state = load_file(str(folder / "model.safetensors"))
    missing, unexpected = model.load_state_dict(state, strict=False)
    allowed_missing = {"lm_head.weight"} if config.get("tie_word_embeddings") else set()
    assert set(missing) <= allowed_missing and not unexpected, (missing, unexpected)
    model.tie_weights()
    return model


def write_tokenizer(folder: Path) -> None:
    """tokenizer.json, tokenizer_config.json and chat_template.jinja of the fixtures."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS + list(CHARACTERS))}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False)
                                  for t in SPECIAL_TOKENS])
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>",
              "tokenizer_class": "PreTrainedTokenizerFast"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)


def write_fixture(folder: Path, fields: dict[str, Any], seed: int) -> dict[str, np.ndarray]:
    """Write a model folder (checkpoint, tokenizer) plus reference.npz; return the reference."""
    assert fields["vocab_size"] == len(SPECIAL_TOKENS) + len(CHARACTERS)
    model = _random_llama(fields, seed)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    config_path = folder / "config.json"
    config = json.loads(config_path.read_text())
    config["architectures"] = [ARCHITECTURE]
    config["model_type"] = MODEL_TYPE
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    write_tokenizer(folder)
    reference = torch_reference(model, reference_ids(fields["vocab_size"], seed))
    np.savez(folder / "reference.npz", **reference)
    return reference


def main() -> None:
    for name, (fields, seed) in FIXTURES.items():
        folder = fixture_path(name)
        write_fixture(folder, fields, seed)
        size = sum(f.stat().st_size for f in folder.iterdir())
        print(f"{folder}: {size / 1024:.0f} KB")


if __name__ == "__main__":
    main()
