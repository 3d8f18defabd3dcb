"""Qwen3-0.6B-shape decode and prefill: a Qwen3 written as the plugin docs teach
(``docs_qwen3.py``: ``mlxrunner.nn`` layers, ``mlxrunner.nn.attend`` with its own masks) through
the core, against mlx-lm's qwen3 on the same random weights, side by side in one process.

Ratios are the median of per-repeat ratios (the rows take turns in each repeat) with their
range; the run also says whether the compiled step stayed on and how many steps replayed.

    python bench/qwen3.py --repeats 5 --json out.json     # GPU: 0.6B shape, prompt 512, 128 new
    python bench/qwen3.py --quick                         # CPU-sized: 4 layers, vocab 16384
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import harness
import mlx.core as mx
from docs_qwen3 import DocsQwen3
from harness import DTYPES
from llama import random_weights
from mlx.utils import tree_unflatten

#: Qwen3-0.6B's config.json (the fields these models read)
QWEN3_0_6B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
    "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 151936, "rms_norm_eps": 1e-6, "tie_word_embeddings": True,
    "max_position_embeddings": 40960, "rope_theta": 1000000.0, "hidden_act": "silu",
}


def build_mlx_lm(config: dict[str, Any], weights: dict[str, mx.array]) -> Any:
    from mlx_lm.models import qwen3
    from mlx_lm.models.cache import KVCache

    class Reference(qwen3.Model):  # mlx-lm's generate makes these caches for it
        def make_cache(self) -> list[Any]:
            return [KVCache() for _ in self.layers]

    model = Reference(qwen3.ModelArgs.from_dict(config))
    model.update(tree_unflatten(list(weights.items())))
    return model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    harness.add_shape_arguments(parser, repeats=5)
    harness.add_switched_argument(parser, "compile=0")
    harness.add_common_arguments(parser)
    args = parser.parse_args(argv)
    harness.apply_common_arguments(args)
    config = harness.quick_shape(args, QWEN3_0_6B)
    dtype = DTYPES[args.dtype]
    device = str(mx.default_device())
    print(f"Qwen3 bench (written as the docs teach): 0.6B shape (layers "
          f"{config['num_hidden_layers']}, vocab {config['vocab_size']}), {args.dtype}, prompt "
          f"{args.prompt}, {args.new} new tokens, device {device}, mlx {mx.__version__}",
          flush=True)
    weights = random_weights(DocsQwen3(config), dtype, args.seed)

    def build() -> Any:
        model = DocsQwen3(config)
        model.update(tree_unflatten(list(weights.items())))
        return model

    docs = build()
    ours = harness.Ours(docs)
    prompt = mx.random.randint(0, config["vocab_size"], (args.prompt,),
                               key=mx.random.key(args.seed))
    reference, reference_version = harness.load_reference(
        lambda: build_mlx_lm(config, weights), skip=args.no_mlx_lm)
    results = harness.results_header("Qwen3-0.6B shape", config, args, device)
    if reference is not None:
        harness.record_parity(ours, reference, prompt, results)
    rows: dict[str, Any] = {"mlxrunner": ours}
    rows.update(harness.switched_rows(args.switched, build))
    if reference is not None:
        rows["mlx-lm"] = reference
    best = harness.measure(rows, prompt, args.new, args.repeats,
                           name_width=max([12] + [len(name) for name in rows]))
    results["mlxrunner"] = best["mlxrunner"]
    results["rows"] = best
    from mlxrunner.testing import compiled_steps

    steps = compiled_steps(docs)
    results["compiled_step"] = {"enabled": steps.enabled, "replays": steps.replays(),
                                "fallback": steps.fallback}
    print(f"  compiled step: {'on' if steps.enabled else 'OFF'}, {steps.replays()} replays"
          + (f" ({steps.fallback})" if steps.fallback else ""), flush=True)
    if reference is not None:
        harness.record_reference(results, best, reference_version,
                                 rows=tuple(name for name in best if name != "mlx-lm"))
    harness.write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
