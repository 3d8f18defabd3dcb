"""Qwen3.5 MoE (the 35B-A3B shape) quantized prefill and decode: mlxrunner against mlx-lm.

Both models hold the same random quantized weights, quantized as mlx-lm converts this
model (routers and shared-expert gates at 8 bits, group 64; everything else, embedding and
head included, at ``--bits``, group ``--group-size``), filled straight into the packed
tensors so the 35B float weights never exist. mlx-lm's copy gets them under its names
(``switch_mlp.{gate,up,down}_proj`` split from our packed ``gate_up_proj``; ``1 + w`` norms).
Then the loop of bench/qwen3_5.py: prefill the prompt minus its last token, greedy-decode
``--new`` tokens with the next step queued before the previous is read, best of
``--repeats``; plus one verify forward of ``--verify-block`` tokens against one decode step.

    .venv/bin/python bench/qwen3_5_moe.py --tiny          # CPU check: a small MoE shape
    python bench/qwen3_5_moe.py --json out.json           # GPU: 35B-A3B, 4-bit, 512 + 128

35B-A3B (Qwen/Qwen3.5-35B-A3B's text config): hidden 2048, 40 layers (every 4th full
attention: 16 query / 2 KV heads of 256), 256 experts with 8 per token of width 512, a
shared expert of width 512, Gated DeltaNet 16 key / 32 value heads of 128, vocabulary
248320; about 18 GiB at 4 bits.
"""

from __future__ import annotations

import argparse
import platform
import sys
from typing import Any

import harness
import mlx.core as mx
import mlx.nn as nn
from harness import DTYPES, text_config
from mlx.utils import tree_flatten
from mlxrunner_qwen3_5.moe import Qwen3_5Moe
from qwen3_5 import shrink, verify_cost

A3B_TEXT: dict[str, Any] = {
    "model_type": "qwen3_5_moe_text", "vocab_size": 248320, "hidden_size": 2048,
    "num_hidden_layers": 40, "full_attention_interval": 4,
    "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256,
    "linear_num_key_heads": 16, "linear_num_value_heads": 32,
    "linear_key_head_dim": 128, "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4,
    "num_experts": 256, "num_experts_per_tok": 8, "moe_intermediate_size": 512,
    "shared_expert_intermediate_size": 512, "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False, "hidden_act": "silu",
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000,
                        "partial_rotary_factor": 0.25, "mrope_section": [11, 11, 10]},
}
#: --tiny: the same structure at a CPU size (every width a multiple of 64)
TINY_CHANGES: dict[str, Any] = {
    "vocab_size": 4096, "hidden_size": 256, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "linear_key_head_dim": 64, "linear_value_head_dim": 64,
    "num_experts": 16, "num_experts_per_tok": 4, "moe_intermediate_size": 128,
    "shared_expert_intermediate_size": 128,
}
ROUTER_QUANT = {"group_size": 64, "bits": 8}
ZERO_CENTRED = ("input_layernorm.weight", "post_attention_layernorm.weight",
                "q_norm.weight", "k_norm.weight")


def composite(text: dict[str, Any]) -> dict[str, Any]:
    return {"architectures": ["Qwen3_5MoeForConditionalGeneration"],
            "model_type": "qwen3_5_moe", "text_config": text,
            "tie_word_embeddings": text["tie_word_embeddings"]}


def quant_predicate(group_size: int, bits: int):
    """mlx-lm's choice for this model: routers at 8 bits, the rest at ``bits`` where the
    input width fits the group."""
    def predicate(path: str, module: nn.Module) -> bool | dict[str, int]:
        if not hasattr(module, "to_quantized") or module.weight.shape[-1] % group_size:
            return False
        if path.endswith(("mlp.gate", "shared_expert_gate")):
            return ROUTER_QUANT
        return {"group_size": group_size, "bits": bits}
    return predicate


def fill_quantized(module: nn.Module, std: float, key: mx.array) -> None:
    """Random packed weights whose dequantized values are uniform with ``std``."""
    levels = 2 ** module.bits - 1
    scale = 2 * std * 3 ** 0.5 / levels
    module.weight = mx.random.randint(-(2 ** 31), 2 ** 31 - 1, module.weight.shape,
                                      dtype=mx.int32, key=key).view(mx.uint32)
    module.scales = mx.full(module.scales.shape, scale, mx.float32)
    module.biases = mx.full(module.biases.shape, -scale * levels / 2, mx.float32)


def build_ours(config: dict[str, Any], bits: int, group_size: int, dtype: mx.Dtype,
               seed: int) -> Qwen3_5Moe:
    model = Qwen3_5Moe(text_config(config))
    nn.quantize(model, group_size, bits, class_predicate=quant_predicate(group_size, bits))
    for i, (_, module) in enumerate(model.named_modules()):
        if hasattr(module, "scales"):
            fill_quantized(module, 0.02, mx.random.key(seed * 100_003 + i))
    params = []
    for name, value in tree_flatten(model.parameters()):
        if name.endswith((".scales", ".biases")) or value.dtype == mx.uint32:
            continue
        if not (name.endswith(("A_log", "dt_bias")) or "norm" in name):
            value = mx.random.normal(value.shape, key=mx.random.key(seed + len(params))) * 0.02
        params.append((name, value))
    model.load_weights(params, strict=False)
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def mlx_lm_weights(ours: Qwen3_5Moe) -> list[tuple[str, mx.array]]:
    out = []
    for name, value in tree_flatten(ours.parameters()):
        if name == "model.norm.weight" or name.endswith(ZERO_CENTRED):
            value = value + 1.0
        if ".mlp.experts.gate_up_proj." in name:
            # contiguous copies: MLX's CUDA gather_qmm has no kernel for strided weights
            gate, up = (mx.contiguous(half) for half in mx.split(value, 2, axis=-2))
            out.append((name.replace("experts.gate_up_proj", "switch_mlp.gate_proj"), gate))
            out.append((name.replace("experts.gate_up_proj", "switch_mlp.up_proj"), up))
            continue
        out.append((name.replace("experts.down_proj", "switch_mlp.down_proj"), value))
    return [("language_model." + name, value) for name, value in out]


def build_mlx_lm(config: dict[str, Any], ours: Qwen3_5Moe, bits: int, group_size: int) -> Any:
    from mlx_lm.models import qwen3_5_moe

    model = qwen3_5_moe.Model(qwen3_5_moe.ModelArgs.from_dict(config))
    nn.quantize(model, group_size, bits, class_predicate=quant_predicate(group_size, bits))
    model.load_weights(mlx_lm_weights(ours))  # strict: every tensor named alike
    model.set_dtype(ours.dtype)
    mx.eval(model.parameters())
    return model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--bits", type=int, choices=(4, 8), default=4)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--prompt", type=int, help="prompt tokens (default 512; tiny 64)")
    parser.add_argument("--new", type=int, help="generated tokens (default 128; tiny 8)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs (best kept)")
    parser.add_argument("--layers", type=int, help="keep only the first N layers (default all)")
    parser.add_argument("--vocab", type=int, help="override the vocabulary size")
    parser.add_argument("--tiny", action="store_true",
                        help="CPU-sized run: hidden 256, 4 layers, 16 experts (4 per token), "
                             "vocabulary 4096, prompt 64, 8 new tokens")
    parser.add_argument("--verify-block", type=int, default=8,
                        help="also time one verify forward of this many tokens through the "
                             "prompt's caches against one decode step (0: skip)")
    harness.add_common_arguments(parser)
    args = parser.parse_args(argv)
    harness.apply_common_arguments(args)
    text = dict(A3B_TEXT, **(TINY_CHANGES if args.tiny else {}))
    if args.tiny:
        args.prompt, args.new = args.prompt or 64, args.new or 8
    args.prompt, args.new = args.prompt or 512, args.new or 128
    config = shrink(composite(text), args.layers, args.vocab)
    dtype = DTYPES[args.dtype]
    device = str(mx.default_device())
    shape = "tiny" if args.tiny else "35B-A3B"
    print(f"Qwen3.5 MoE bench: {shape} (layers {args.layers or 'all'}, vocab "
          f"{args.vocab or 'as configured'}), {args.bits}-bit group {args.group_size}, "
          f"{args.dtype}, prompt {args.prompt}, {args.new} new tokens, device {device}, "
          f"mlx {mx.__version__}", flush=True)

    model = build_ours(config, args.bits, args.group_size, dtype, args.seed)
    ours = harness.Ours(model)
    prompt = mx.random.randint(0, ours.vocab_size, (args.prompt,), key=mx.random.key(args.seed))
    reference, reference_version = harness.load_reference(
        lambda: build_mlx_lm(config, model, args.bits, args.group_size), skip=args.no_mlx_lm)
    results: dict[str, Any] = {
        "shape": shape, "text_config": config["text_config"], "bits": args.bits,
        "group_size": args.group_size, "dtype": args.dtype, "prompt": args.prompt,
        "new": args.new, "device": device, "mlx": mx.__version__,
        "platform": platform.platform(), "mlx_settings": harness.mlx_settings(),
        "mlx_lm": None,
    }
    if reference is not None:
        harness.record_parity(ours, reference, prompt, results)
    models: dict[str, Any] = {"mlxrunner": ours}
    if reference is not None:
        models["mlx-lm"] = reference
    nodes = {name: harness.decode_graph_nodes(m, prompt) for name, m in models.items()}
    results["decode_graph_nodes"] = nodes
    harness.print_nodes(nodes)
    best = harness.measure(models, prompt, args.new, args.repeats, name_width=10)
    results["mlxrunner"] = best["mlxrunner"]
    if reference is not None:
        harness.record_reference(results, best, reference_version)
    if args.verify_block:
        rows = {}
        for name, m in models.items():
            rows[name] = verify_cost(m, prompt, args.verify_block, 10 if args.tiny else 30,
                                     ours=name == "mlxrunner")
            print(f"  verify {args.verify_block} tokens at context {args.prompt}: {name:10s} "
                  f"{rows[name]['verify_ms']:8.2f} ms = {rows[name]['verify_over_decode']:5.2f}"
                  f" x one decode step ({rows[name]['decode_ms']:.2f} ms)", flush=True)
        results["verify"] = dict(rows, block=args.verify_block, context=args.prompt)
    harness.write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
