"""Write the tiny Qwen3.5 MoE test checkpoint and its transformers reference outputs.

The folder (``moe_fixtures/tiny_moe``, beside the dense ``fixtures/`` so the dense tests do
not pick it up) holds what transformers' ``Qwen3_5MoeForCausalLM.save_pretrained`` writes
(config.json, model.safetensors; float32, CPU torch). transformers 5.24 keeps the experts
fused in memory (``mlp.experts.gate_up_proj [E, 2I, H]``, ``mlp.experts.down_proj``) and
writes them per expert (``mlp.experts.N.{gate,up,down}_proj.weight``); the tests derive the
fused and mlx-lm (``switch_mlp``) layouts from these tensors by re-keying them.

``reference.npz``: for each prompt length in ``PROMPT_LENGTHS``, the prompt ids, the logits
and the hidden states transformers reports with ``output_hidden_states`` (embeddings first,
then the output of every layer, the last one after the final norm).

Run from the repository root (needs torch and transformers):
    .venv/bin/python architectures/qwen3_5/tests/make_moe_fixtures.py

Hidden size 64 and expert width 32 let mlx-lm quantize every projection at group size 32
(its routers at 8 bits, group 64). Weights are drawn wider than transformers'
initialisation (std 0.08, non-zero norm weights, a spread of DeltaNet decay rates) so every
part of the network, the router included, moves the logits well above the tolerance.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

FIXTURES = Path(__file__).resolve().parent / "moe_fixtures"
PROMPT_LENGTHS = (1, 7, 40)
VOCAB = 256

SPECS: dict[str, dict[str, Any]] = {
    # three DeltaNet layers then one full-attention layer (the released pattern), Hk != Hv,
    # 8 experts with 3 per token, a shared expert, untied head
    "tiny_moe": dict(
        num_hidden_layers=4, full_attention_interval=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=8,
        num_experts=8, num_experts_per_tok=3,
        moe_intermediate_size=32, shared_expert_intermediate_size=32,
        tie_word_embeddings=False,
    ),
}


def text_config(name: str) -> dict[str, Any]:
    base: dict[str, Any] = dict(
        vocab_size=VOCAB, hidden_size=64, rms_norm_eps=1e-6, linear_conv_kernel_dim=4,
        max_position_embeddings=4096, initializer_range=0.08,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                         "partial_rotary_factor": 0.25, "mrope_section": [1, 1, 0]},
    )
    base.update(SPECS[name])
    return base


def build_model(name: str, seed: int = 0) -> Any:
    import torch
    from transformers import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

    torch.manual_seed(seed)
    config = Qwen3_5MoeTextConfig(**text_config(name))
    model = Qwen3_5MoeForCausalLM(config).eval().to(torch.float32)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if pname.endswith("A_log"):
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
            elif pname.endswith("mlp.gate.weight"):  # routers: clear top-k margins
                param.copy_(0.5 * torch.randn(param.shape, generator=gen))
            else:
                param.copy_(0.08 * torch.randn(param.shape, generator=gen))
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
    for extra in folder.iterdir():  # keep only what the tests read
        if extra.name not in ("config.json", "model.safetensors", "reference.npz"):
            extra.unlink()


def main(argv: list[str]) -> int:
    for name in argv or list(SPECS):
        folder = FIXTURES / name
        write_fixture(name, folder)
        size = sum(p.stat().st_size for p in folder.iterdir())
        print(f"{folder}: {size / 1024:.0f} KiB")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
