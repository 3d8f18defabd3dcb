"""Write the tiny Gemma 4 reference checkpoints and their transformers outputs.

    /work/venv/bin/python architectures/gemma4/tests/make_fixtures.py [OUT_DIR]

For each config below: build transformers' ``Gemma4ForCausalLM`` (CPU torch,
float32, eager attention), give it random weights of a useful size (the
default init is so small that every layer is almost the identity), write it
with ``save_pretrained``, run it on random prompts and store the logits and
all hidden states in ``reference.npz``:

- ``ids_{L}`` ``[L]``, ``logits_{L}`` ``[L, V]``,
- ``hidden_{L}`` ``[layers + 1, L, hidden]`` (transformers' hidden_states: the
  embedding output, the output of every layer, the last one after the final norm).

Prompt lengths: 1, 9 (past the window of 8) and 20 (past twice the window).
Deterministic: the same files come out on every run.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

FIXTURES = Path(__file__).parent / "fixtures"
PROMPT_LENGTHS = (1, 9, 20)
WINDOW = 8

_COMMON = {
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 32,
    "num_attention_heads": 4,
    "head_dim": 16,
    "global_head_dim": 32,
    "rms_norm_eps": 1e-6,
    "sliding_window": WINDOW,
    "final_logit_softcapping": 30.0,
    "max_position_embeddings": 256,
    "tie_word_embeddings": True,
    "pad_token_id": 0,
    "bos_token_id": 2,
    "eos_token_id": 1,
}

_S, _F = "sliding_attention", "full_attention"

CONFIGS: dict[str, dict] = {
    # E2B-like: (4 sliding + 1 full) x 2, 1 KV head, the last 4 layers share K/V
    # (layers 6-9 reuse 5 and 4), double-wide MLP there, per-layer inputs.
    "e2b": {
        **_COMMON,
        "num_hidden_layers": 10,
        "num_key_value_heads": 1,
        "layer_types": ([_S] * 4 + [_F]) * 2,
        "num_kv_shared_layers": 4,
        "use_double_wide_mlp": True,
        "hidden_size_per_layer_input": 8,
        "vocab_size_per_layer_input": 128,
        "attention_k_eq_v": False,
    },
    # 31B-like: (5 sliding + 1 full) x 1 + sliding + full, K=V full layers with
    # their own KV head count, no per-layer inputs, no sharing.
    "dense": {
        **_COMMON,
        "num_hidden_layers": 8,
        "num_key_value_heads": 2,
        "num_global_key_value_heads": 1,
        "layer_types": [_S] * 5 + [_F] + [_S, _F],
        "num_kv_shared_layers": 0,
        "hidden_size_per_layer_input": 0,
        "attention_k_eq_v": True,
    },
    # 26B-A4B-like: the dense layout plus the MoE block (4 experts, top 2).
    "moe": {
        **_COMMON,
        "num_hidden_layers": 6,
        "num_key_value_heads": 2,
        "num_global_key_value_heads": 1,
        "layer_types": [_S] * 5 + [_F],
        "num_kv_shared_layers": 0,
        "hidden_size_per_layer_input": 0,
        "attention_k_eq_v": True,
        "enable_moe_block": True,
        "num_experts": 4,
        "top_k_experts": 2,
        "moe_intermediate_size": 16,
    },
}


def _randomize(model, seed: int) -> None:
    """Weights of O(1) effect: linear maps ~ N(0, 1/fan_in), norms and scalars near 1.

    q/k norm weights near 0.5 keep attention scores (scale 1.0) at a spread of
    a few units: with peakier softmaxes float32 itself drifts by ~1e-4.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.copy_(0.5 + 0.1 * torch.randn(p.shape, generator=gen))
            elif name.endswith("norm.weight") or name.endswith(".scale"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=gen))
            elif "per_expert_scale" in name:
                p.copy_(0.5 + torch.rand(p.shape, generator=gen))
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)
            else:
                fan_in = p.shape[-1]
                p.copy_(torch.randn(p.shape, generator=gen) * fan_in ** -0.5)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(0.6 + 0.8 * torch.rand(b.shape, generator=gen))


def write_fixture(name: str, out_dir: Path) -> Path:
    """Write checkpoint folder ``out_dir / name`` with ``reference.npz``; return it."""
    import torch
    from transformers import Gemma4ForCausalLM, Gemma4TextConfig

    torch.manual_seed(0)
    config = Gemma4TextConfig(**CONFIGS[name], attn_implementation="eager")
    model = Gemma4ForCausalLM(config).eval().float()
    _randomize(model, seed=sum(map(ord, name)))
    folder = out_dir / name
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder, safe_serialization=True)
    rng = np.random.default_rng(len(name))
    arrays = {}
    for length in PROMPT_LENGTHS:
        ids = rng.integers(3, config.vocab_size, size=length)
        with torch.no_grad():
            out = model(torch.tensor(ids)[None], use_cache=False, output_hidden_states=True)
        arrays[f"ids_{length}"] = ids.astype(np.int32)
        arrays[f"logits_{length}"] = out.logits[0].numpy().astype(np.float32)
        arrays[f"hidden_{length}"] = torch.stack(out.hidden_states)[:, 0].numpy()
    np.savez_compressed(folder / "reference.npz", **arrays)
    for extra in ("generation_config.json",):
        (folder / extra).unlink(missing_ok=True)
    return folder


def main(argv: list[str]) -> None:
    out_dir = Path(argv[1]) if len(argv) > 1 else FIXTURES
    for name in CONFIGS:
        folder = write_fixture(name, out_dir)
        size = sum(f.stat().st_size for f in folder.iterdir())
        config = json.loads((folder / "config.json").read_text())
        print(f"{folder}: {size / 1024:.0f} KiB, {config['num_hidden_layers']} layers")


if __name__ == "__main__":
    main(sys.argv)
