"""Gemma 4 prefill and decode throughput: mlxrunner's plugin against mlx-lm, side by side.

Both models get the same random weights (an E2B-shaped checkpoint in memory: our
parameters under mlx-lm's names), the same dtype and the same loop: prefill the
prompt minus its last token (evaluating only the caches, as mlx-lm's generate
does), then greedy-decode ``--new`` tokens one at a time with the next step
queued before the previous token is read (``mx.async_eval``). Rows: mlxrunner
(compiled one-token steps, the default), mlxrunner with eager steps, mlx-lm.
Runs unchanged on the CPU and on CUDA/Metal (``mx.default_device()``); mlx-lm is
compared when importable (``--no-mlx-lm`` to skip).

    /work/venv/bin/python bench/gemma4.py --quick --json /tmp/gemma4.json   # CPU-sized
    python bench/gemma4.py --json out.json     # GPU: E2B, bf16, prompt 512, 128 new
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
from pathlib import Path
from typing import Any

import harness
import mlx.core as mx
from harness import DTYPES, SHARED, text_config
from mlx.utils import tree_flatten
from mlxrunner_gemma4 import Gemma4Model

DEFAULT_CONFIG = SHARED / "configs" / "gemma-4-E2B-it.config.text-fields-from-ollama-tests.json"

# E2B's layout (4 sliding + 1 full, KV sharing, per-layer inputs, double-wide MLP)
# scaled down for a 2-core CPU.
QUICK_TEXT_CONFIG: dict[str, Any] = {
    "model_type": "gemma4_text", "hidden_size": 512, "num_hidden_layers": 10,
    "intermediate_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 1,
    "head_dim": 64, "global_head_dim": 128, "vocab_size": 16384,
    "vocab_size_per_layer_input": 16384, "hidden_size_per_layer_input": 64,
    "num_kv_shared_layers": 4, "use_double_wide_mlp": True, "sliding_window": 64,
    "layer_types": (["sliding_attention"] * 4 + ["full_attention"]) * 2,
    "final_logit_softcapping": 30.0, "rms_norm_eps": 1e-6, "attention_k_eq_v": False,
    "tie_word_embeddings": True,
    "rope_parameters": {
        "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1e6,
                           "rope_type": "proportional"},
        "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"}},
}


# gemma-4-E2B-it's text config (as in the shared data), for machines without that folder.
E2B_TEXT_CONFIG: dict[str, Any] = {
    **QUICK_TEXT_CONFIG,
    "hidden_size": 1536, "num_hidden_layers": 35, "intermediate_size": 6144,
    "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 256,
    "global_head_dim": 512, "vocab_size": 262144, "vocab_size_per_layer_input": 262144,
    "hidden_size_per_layer_input": 256, "num_kv_shared_layers": 20, "sliding_window": 512,
    "layer_types": (["sliding_attention"] * 4 + ["full_attention"]) * 7,
}


def bench_config(quick: bool) -> dict[str, Any]:
    """The composite config a bench without ``--config`` runs: the CPU-sized layout where
    ``quick``, else the shared E2B config where it is present, else its built-in copy."""
    if quick:
        return composite(QUICK_TEXT_CONFIG)
    return composite(json.loads(DEFAULT_CONFIG.read_text()) if DEFAULT_CONFIG.is_file()
                     else E2B_TEXT_CONFIG)


def composite(config: dict[str, Any]) -> dict[str, Any]:
    """Hub layout: the text part under ``text_config``."""
    if "text_config" in config:
        return config
    return {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4",
            "tie_word_embeddings": True, "vocab_size": config["vocab_size"],
            "text_config": config}


def build_ours(config: dict[str, Any], dtype: mx.Dtype, seed: int) -> Gemma4Model:
    model = Gemma4Model(text_config(config))
    keys = mx.random.split(mx.random.key(seed), len(tree_flatten(model.parameters())))
    params = []
    for i, (name, value) in enumerate(tree_flatten(model.parameters())):
        if "norm" in name or name.endswith(("layer_scalar", ".scale", "per_expert_scale")):
            w = mx.ones(value.shape, dtype)
        else:  # trained-scale weights keep bf16 activations finite
            w = mx.random.normal(value.shape, dtype, key=keys[i]) * 0.02
        mx.eval(w)  # one tensor at a time: no float32 copy of the 2.3B-entry table
        params.append((name, w))
    model.load_weights(params)
    return model


def build_mlx_lm(config: dict[str, Any], ours: Gemma4Model) -> Any:
    from mlx_lm.models import gemma4 as mlx_lm_gemma4

    model = mlx_lm_gemma4.Model(mlx_lm_gemma4.ModelArgs.from_dict(config))
    # The same tensors (shared, not copied) under mlx-lm's names.
    weights = {"language_model." + name: value for name, value in
               tree_flatten(ours.parameters())}
    if any(".experts." in k for k in weights):
        weights = model.sanitize({"model.language_model." + k.removeprefix(
            "language_model.model."): v for k, v in weights.items()})
    model.load_weights(list(weights.items()))
    return model


def first_token(model: Gemma4Model, reference: Any, prompt: mx.array,
                repeats: int) -> dict[str, Any]:
    """Milliseconds from the prompt to its first token through each tool's own generation:
    ``mlxrunner.generate`` (its prefill wants the last position's logits alone) and
    mlx-lm's ``generate_step`` (all but the last token prefilled, then a step on it); one
    warm-up each, then ``repeats`` taking turns. Printed as medians, with the per-repeat
    ratios' median and range."""
    import time

    from mlx_lm.generate import generate_step

    import mlxrunner

    ids, greedy = prompt.tolist(), mlxrunner.SamplerOptions(temperature=0)

    def ours() -> tuple[float, int]:
        mx.synchronize()
        start = time.perf_counter()
        token = mlxrunner.generate(model, ids, options=greedy, max_tokens=1).tokens[0]
        return 1e3 * (time.perf_counter() - start), token

    def theirs() -> tuple[float, int]:
        mx.synchronize()
        start = time.perf_counter()
        token, _ = next(generate_step(prompt, reference, max_tokens=1))
        return 1e3 * (time.perf_counter() - start), int(token)

    ours(), theirs()
    runs = [(ours(), theirs()) for _ in range(repeats)]
    mine, other = [r[0][0] for r in runs], [r[1][0] for r in runs]
    spread = harness.ratio_spread([1 / t for t in mine], [1 / t for t in other])
    same = all(r[0][1] == r[1][1] for r in runs)
    print(f"  first token: mlxrunner {statistics.median(mine):.1f} ms, mlx-lm "
          f"{statistics.median(other):.1f} ms; speed ratio median {spread['median']:.2f}x "
          f"(range {spread['min']:.2f}-{spread['max']:.2f}, {spread['n']} repeats); "
          f"same token: {same}", flush=True)
    return {"mlxrunner_ms": mine, "mlx_lm_ms": other, "ratio": spread, "same_token": same}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG,
                        help="a Gemma 4 config.json (default: E2B from the shared data, or "
                             "a built-in copy when that is absent)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    parser.add_argument("--new", type=int, default=128, help="generated tokens")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per row")
    parser.add_argument("--quick", action="store_true",
                        help="CPU-sized run: a scaled-down E2B layout, prompt 160, 16 new "
                             "tokens")
    parser.add_argument("--no-eager", action="store_true",
                        help="skip the row with eager (uncompiled) decode steps")
    harness.add_switched_argument(parser, "attention=folded")
    harness.add_common_arguments(parser)
    args = parser.parse_args(argv)
    harness.apply_common_arguments(args)
    if args.quick:
        config, config_name = composite(QUICK_TEXT_CONFIG), "quick (E2B layout, scaled down)"
        args.prompt, args.new = 160, 16
    elif args.config.is_file():
        config, config_name = composite(json.loads(args.config.read_text())), args.config.name
    elif args.config == DEFAULT_CONFIG:
        config, config_name = composite(E2B_TEXT_CONFIG), "E2B (built-in copy of the config)"
    else:
        print(f"gemma4 bench: config not found: {args.config}", file=sys.stderr)
        return 2
    dtype = DTYPES[args.dtype]
    device = str(mx.default_device())
    print(f"Gemma 4 bench: {config_name}, {args.dtype}, prompt {args.prompt}, "
          f"{args.new} new tokens, device {device}, mlx {mx.__version__}", flush=True)
    print(f"  MLX settings for every row: {harness.mlx_settings()}", flush=True)

    model = build_ours(config, dtype, args.seed)
    ours = harness.Ours(model)
    prompt = mx.random.randint(0, model.vocab_size, (args.prompt,), key=mx.random.key(args.seed))

    reference, reference_version = harness.load_reference(
        lambda: build_mlx_lm(config, model), skip=args.no_mlx_lm)

    results: dict[str, Any] = {
        "config": config_name, "dtype": args.dtype, "prompt": args.prompt, "new": args.new,
        "device": device, "mlx": mx.__version__, "platform": platform.platform(),
        "mlx_settings": harness.mlx_settings(), "mlx_lm": None,
    }
    if reference is not None:
        harness.record_parity(ours, reference, prompt, results)

    rows: dict[str, Any] = {"mlxrunner": ours}
    switched = harness.switched_rows(args.switched, lambda: build_ours(config, dtype, args.seed))
    rows.update(switched)
    if not args.no_eager:
        rows["mlxrunner (eager)"] = harness.Ours(model, compile=False)
    if reference is not None:
        rows["mlx-lm"] = reference
    # (the eager row's graph: what our compiled step traces, its views included)
    nodes = {name: harness.decode_graph_nodes(model, prompt) for name, model in rows.items()}
    results["decode_graph_nodes"] = nodes
    harness.print_nodes(nodes)
    best = harness.measure(rows, prompt, args.new, args.repeats,
                           name_width=max([18] + [len(name) for name in switched]))
    results["mlxrunner"] = best["mlxrunner"]
    results["switched"] = {name: dict(best[name], switch={k: str(v) for k, v in
                                                         row.changes.items()})
                           for name, row in switched.items()}
    if not args.no_eager:
        results["mlxrunner_eager_steps"] = best["mlxrunner (eager)"]
    if reference is not None:
        harness.record_reference(results, best, reference_version,
                                 rows=("mlxrunner", *switched))
        results["first_token"] = first_token(model, reference, prompt, args.repeats)
    harness.write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
