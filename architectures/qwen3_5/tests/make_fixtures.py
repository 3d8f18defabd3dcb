"""Write the tiny Qwen3.5 test checkpoints and their transformers reference outputs.

Each fixture folder holds what transformers' ``Qwen3_5ForCausalLM.save_pretrained``
writes (config.json, model.safetensors; float32, CPU torch) plus
``reference.npz``: for each prompt length in ``PROMPT_LENGTHS``, the prompt ids,
the logits and the hidden states transformers reports with
``output_hidden_states`` (embeddings first, then the output of every layer).

Run from the repository root (needs torch and transformers):
    /work/venv/bin/python architectures/qwen3_5/tests/make_fixtures.py

The weights are drawn wider than transformers' initialisation (std 0.2 instead of
0.02, non-zero norm weights, a spread of DeltaNet decay rates) so that every part
of the network moves the logits well above the comparison tolerance.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

FIXTURES = Path(__file__).resolve().parent / "fixtures"
PROMPT_LENGTHS = (1, 7, 130)
VOCAB = 256

# name -> text-config overrides; all share vocab 256, hidden 32, intermediate 64.
SPECS: dict[str, dict[str, Any]] = {
    # Hk != Hv (2 key heads feed 4 value heads), tied embeddings, three DeltaNet layers then
    # one full-attention layer (the real models' pattern).
    "tiny_hk2_hv4_tied": dict(
        num_hidden_layers=4, full_attention_interval=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8,
        tie_word_embeddings=True,
    ),
    # Untied head, full attention first, Hk == Hv, Dk != Dv, one KV head.
    "tiny_fullfirst_untied": dict(
        num_hidden_layers=3,
        layer_types=["full_attention", "linear_attention", "linear_attention"],
        num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        linear_num_key_heads=2, linear_num_value_heads=2,
        linear_key_head_dim=16, linear_value_head_dim=8,
        tie_word_embeddings=False,
    ),
    # Alternating pattern from full_attention_interval 2, one key head for three value heads.
    "tiny_alternating_hk1_hv3": dict(
        num_hidden_layers=4, full_attention_interval=2,
        num_attention_heads=2, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=1, linear_num_value_heads=3,
        linear_key_head_dim=8, linear_value_head_dim=8,
        tie_word_embeddings=True,
    ),
}


def text_config(name: str) -> dict[str, Any]:
    base: dict[str, Any] = dict(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, rms_norm_eps=1e-6,
        linear_conv_kernel_dim=4, max_position_embeddings=4096, initializer_range=0.2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0]},
    )
    base.update(SPECS[name])
    return base


def build_model(name: str, seed: int = 0) -> Any:
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(seed)
    config = Qwen3_5TextConfig(**text_config(name))
    model = Qwen3_5ForCausalLM(config).eval().to(torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if pname.endswith("A_log"):
                # decay rates from fast (A ~ 1) to slow (A ~ 1e-3): state survives chunk ends
                n = param.numel()
                param.copy_(torch.linspace(-7.0, 0.0, n) + 0.1 * torch.randn(n, generator=gen))
            elif pname.endswith("dt_bias"):
                param.copy_(torch.randn(param.shape, generator=gen) * 0.5)
            elif pname.endswith("linear_attn.norm.weight"):
                param.copy_(1.0 + 0.2 * torch.randn(param.shape, generator=gen))
            elif "norm" in pname:  # zero-centred norms: exercise the 1 + w convention
                param.copy_(0.2 * torch.randn(param.shape, generator=gen))
            elif pname.endswith("conv1d.weight"):
                param.copy_(0.5 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(0.2 * torch.randn(param.shape, generator=gen))
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


def write_fixture(name: str, folder: Path) -> None:
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
    # keep only what the tests read (no generation_config.json)
    for extra in folder.iterdir():
        if extra.name not in ("config.json", "model.safetensors", "reference.npz"):
            extra.unlink()


def main(argv: list[str]) -> int:
    names = argv or list(SPECS)
    for name in names:
        folder = FIXTURES / name
        write_fixture(name, folder)
        size = sum(p.stat().st_size for p in folder.iterdir())
        print(f"{folder}: {size / 1024:.0f} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
