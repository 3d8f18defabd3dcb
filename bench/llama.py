"""Llama-3.2-1B-shape prefill and decode throughput: the example architecture (built from
``mlxrunner.nn``) and a plain ``mlx.nn`` Llama (``plain_llama.py``, what the core's
compiled step alone gives an architecture) against mlx-lm's llama, side by side.

All three models hold the same random weights (one set of arrays), the same dtype and the
same loop (``harness.run``: prefill the prompt minus its last token, then greedy steps,
each queued before the previous token is read).

    python bench/llama.py --json out.json                 # GPU: 1B shape, prompt 512, 128 new
    python bench/llama.py --quick                          # CPU-sized: 4 layers, vocab 16384
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import harness
import mlx.core as mx
from harness import DTYPES
from mlx.utils import tree_flatten, tree_unflatten
from mlxrunner_example_architecture.model import ExampleLlama
from plain_llama import PlainLlama

#: Llama-3.2-1B's config.json (the fields these models read)
LLAMA_3_2_1B = {
    "architectures": ["ExampleLlamaForCausalLM"], "model_type": "example_llama",
    "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
    "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
    "vocab_size": 128256, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
    "max_position_embeddings": 131072, "hidden_act": "silu",
    "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                        "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 8192},
}


def random_weights(model: Any, dtype: mx.Dtype, seed: int) -> dict[str, mx.array]:
    mx.random.seed(seed)
    weights = {}
    for name, value in tree_flatten(model.parameters()):
        weights[name] = (mx.ones(value.shape) if "norm" in name else
                         mx.random.normal(value.shape) * 0.02).astype(dtype)
    mx.eval(list(weights.values()))
    return weights


def loaded(cls: type, config: dict[str, Any], weights: dict[str, mx.array]) -> Any:
    """A ``cls(config)`` model holding ``weights``."""
    model = cls(config)
    model.update(tree_unflatten(list(weights.items())))
    return model


def build_mlx_lm(config: dict[str, Any], weights: dict[str, mx.array]) -> Any:
    from mlx_lm.models import llama

    rope = config["rope_parameters"]
    args = llama.ModelArgs.from_dict({**config, "model_type": "llama",
                                      "rope_theta": rope["rope_theta"], "rope_scaling": rope})
    model = llama.Model(args)
    model.update(tree_unflatten(list(weights.items())))
    return model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_shape_arguments(parser, repeats=3)
    parser.add_argument("--narrow", action="store_true",
                        help="the same layers and operations at a width (hidden 256, "
                        "vocabulary 2048) that leaves the GPU idle: a step's host time alone")
    parser.add_argument("--no-plain", action="store_true", help="skip the plain mlx.nn row")
    harness.add_switched_argument(parser, "compile=0")
    harness.add_common_arguments(parser)
    args = parser.parse_args(argv)
    harness.apply_common_arguments(args)
    config = harness.quick_shape(args, LLAMA_3_2_1B)
    if args.narrow:
        config.update(hidden_size=256, intermediate_size=1024, num_attention_heads=4,
                      num_key_value_heads=1, vocab_size=2048)
    dtype = DTYPES[args.dtype]
    device = str(mx.default_device())
    shape = "Llama-3.2-1B shape" + (" (narrow)" if args.narrow else "")
    print(f"Llama bench: {shape} (layers {config['num_hidden_layers']}, vocab "
          f"{config['vocab_size']}), {args.dtype}, prompt {args.prompt}, {args.new} new "
          f"tokens, device {device}, mlx {mx.__version__}", flush=True)
    print(f"  MLX settings for every row: {harness.mlx_settings()}", flush=True)

    example = ExampleLlama(config)
    weights = random_weights(example, dtype, args.seed)

    def build(cls: type) -> Any:
        return loaded(cls, config, weights)

    example = build(ExampleLlama)
    ours = harness.Ours(example)
    prompt = mx.random.randint(0, example.vocab_size, (args.prompt,),
                               key=mx.random.key(args.seed))
    reference, reference_version = harness.load_reference(
        lambda: build_mlx_lm(config, weights), skip=args.no_mlx_lm)
    results = harness.results_header(shape, config, args, device)
    if reference is not None:
        harness.record_parity(ours, reference, prompt, results)
    rows: dict[str, Any] = {"mlxrunner": ours}
    if not args.no_plain:
        rows["plain mlx.nn"] = harness.Ours(build(PlainLlama))
    switched = harness.switched_rows(args.switched, lambda: build(ExampleLlama))
    rows.update(switched)
    if reference is not None:
        rows["mlx-lm"] = reference
    best = harness.measure(rows, prompt, args.new, args.repeats,
                           name_width=max([12] + [len(name) for name in rows]))
    results["mlxrunner"] = best["mlxrunner"]
    results["rows"] = best
    if reference is not None:
        ratio = harness.record_reference(
            results, best, reference_version,
            rows=tuple(name for name in best if name != "mlx-lm"))
        if ratio is not None and "plain mlx.nn" in best:
            results["ratio_plain"] = results["ratios"]["plain mlx.nn"]
    harness.write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
