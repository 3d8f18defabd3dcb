"""Write the tiny Llama-family test checkpoints and their transformers reference outputs.

Each fixture folder holds what transformers' ``save_pretrained`` writes (config.json,
model.safetensors; float32, CPU torch) plus ``reference.npz``: for each prompt length in
``PROMPT_LENGTHS``, the prompt ids, the logits and the hidden states transformers reports
with ``output_hidden_states`` (embeddings first, then the output of every layer, the last
one after the final norm).

Run from the repository root (needs torch and transformers):
    .venv/bin/python architectures/llama/tests/make_fixtures.py [NAME ...]

The weights are drawn wider than transformers' initialisation (std 0.2, norm weights
1 + 0.2 N(0, 1), non-zero biases) so that every part of the network moves the logits well
above the comparison tolerance. The RoPE scalings use a 16-token original context, so that
40-token prompts reach the scaled frequencies.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

FIXTURES = Path(__file__).resolve().parent / "fixtures"
PROMPT_LENGTHS = (1, 7, 40)
VOCAB = 128

#: name -> (transformers class name, config overrides); all share vocab 128, hidden 32,
#: intermediate 64, two layers.
SPECS: dict[str, tuple[str, dict[str, Any]]] = {
    # SmolLM2 / Llama 3.2 style: tied head, llama3 RoPE, GQA 2:1, head_dim = hidden / heads.
    "tied_llama3": ("LlamaForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
        rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 16},
    )),
    # Untied head, biases in every projection, explicit head_dim (heads * head_dim != hidden),
    # linear RoPE scaling, one KV head per query head.
    "untied_bias_linear": ("LlamaForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=4, head_dim=16, tie_word_embeddings=False,
        attention_bias=True, mlp_bias=True, rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "linear", "rope_theta": 500000.0, "factor": 2.0},
    )),
    # A Mistral-style config (full attention), GQA 4:1, yarn RoPE.
    "mistral_gqa4_yarn": ("MistralForCausalLM", dict(
        num_attention_heads=8, num_key_value_heads=2, head_dim=8, tie_word_embeddings=False,
        sliding_window=None, max_position_embeddings=64,  # = factor * original: yarn's ratio
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 16},
    )),
}


def config_kwargs(name: str) -> dict[str, Any]:
    base: dict[str, Any] = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        rms_norm_eps=1e-6, max_position_embeddings=256, initializer_range=0.2,
        bos_token_id=1, eos_token_id=2, pad_token_id=None,
    )
    base.update(SPECS[name][1])
    return base


def build_model(name: str, seed: int = 0) -> Any:
    import torch
    import transformers

    class_name = SPECS[name][0]
    config_class = getattr(transformers, class_name.replace("ForCausalLM", "Config"))
    torch.manual_seed(seed)
    config = config_class(**config_kwargs(name))
    model = getattr(transformers, class_name)(config).eval().to(torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for pname, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1.0 + 0.2 * noise if "norm" in pname else 0.2 * noise)
    return model


def prompts(seed: int = 1234) -> dict[int, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {n: rng.integers(0, VOCAB, size=(1, n), dtype=np.int64) for n in PROMPT_LENGTHS}


def reference_outputs(model: Any, ids: np.ndarray) -> dict[str, np.ndarray]:
    import torch

    with torch.no_grad():
        out = model(input_ids=torch.from_numpy(ids), output_hidden_states=True, use_cache=False)
    hidden = torch.stack([h[0] for h in out.hidden_states]).numpy()
    return {"logits": out.logits[0].numpy(), "hidden": hidden}


def write_fixture(name: str, folder: Path) -> Path:
    model = build_model(name)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    arrays: dict[str, np.ndarray] = {}
    for n, ids in prompts().items():
        ref = reference_outputs(model, ids)
        arrays[f"ids_{n}"] = ids.astype(np.int32)
        arrays[f"logits_{n}"] = ref["logits"].astype(np.float32)
        arrays[f"hidden_{n}"] = ref["hidden"].astype(np.float32)
    np.savez_compressed(folder / "reference.npz", **arrays)
    for extra in folder.iterdir():  # keep only what the tests read
        if extra.name not in ("config.json", "model.safetensors", "reference.npz"):
            extra.unlink()
    return folder


def main(argv: list[str]) -> int:
    for name in argv or list(SPECS):
        folder = write_fixture(name, FIXTURES / name)
        size = sum(p.stat().st_size for p in folder.iterdir())
        print(f"{folder}: {size / 1024:.0f} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
