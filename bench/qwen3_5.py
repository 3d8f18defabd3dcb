"""Qwen3.5 prefill and decode throughput: mlxrunner's plugin against mlx-lm, side by side.

Both models get the same random weights (our parameters, renamed for mlx-lm),
the same dtype and the same loop: prefill the prompt minus its last token
(evaluating only the caches, as mlx-lm's generate does), then greedy-decode
``--new`` tokens one at a time with the next step queued before the previous
token is read (``mx.async_eval``). Runs unchanged on the CPU and on CUDA/Metal
(``mx.default_device()``); mlx-lm is compared when importable (``--no-mlx-lm``
to skip).

    /work/venv/bin/python bench/qwen3_5.py --quick --json /tmp/qwen3_5.json
    python bench/qwen3_5.py --json out.json          # GPU: 0.8B, prompt 512, 128 new

Also reports the cost of one speculative verify forward (8 tokens through the prompt's
caches, with snapshot scheduling and a restore) relative to one decode step. Our decode
steps and short forwards go through the core's compiled step (``mx.compile``): the decode
graph count then shows the traced call's nodes; ``--eager`` counts (and times) the
untraced graph.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import harness
import mlx.core as mx
from harness import DTYPES, SHARED, eval_cache, text_config
from mlx.utils import tree_flatten
from mlxrunner_qwen3_5 import Qwen3_5

DEFAULT_CONFIG = SHARED / "configs" / "Qwen3.5-0.8B-Base.config.json"


def shrink(config: dict[str, Any], layers: int | None, vocab: int | None) -> dict[str, Any]:
    """The config with fewer layers and/or another vocabulary size (CPU-sized runs)."""
    config = json.loads(json.dumps(config))
    text = config.get("text_config", config)
    if layers:
        text["num_hidden_layers"] = layers
        if "layer_types" in text:
            text["layer_types"] = text["layer_types"][:layers]
    if vocab:
        text["vocab_size"] = vocab
    return config


def build_ours(config: dict[str, Any], dtype: mx.Dtype, seed: int) -> Qwen3_5:
    mx.random.seed(seed)
    model = Qwen3_5(text_config(config))
    # Init like a trained model's scale: small weights keep bf16 activations finite.
    params = []
    for name, value in tree_flatten(model.parameters()):
        if name.endswith(("A_log", "dt_bias")) or "norm" in name:
            params.append((name, value))
        else:
            params.append((name, mx.random.normal(value.shape) * 0.02))
    model.load_weights(params)
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model


def build_mlx_lm(config: dict[str, Any], ours: Qwen3_5) -> Any:
    from mlx_lm.models import qwen3_5 as mlx_lm_qwen3_5

    composite = dict(config)
    if "text_config" not in composite:
        composite = {"model_type": "qwen3_5", "text_config": composite}
    args = mlx_lm_qwen3_5.ModelArgs.from_dict(composite)
    model = mlx_lm_qwen3_5.Model(args)
    # mlx-lm holds the zero-centred norms' 1 + w (ours hold w); the same [C, K, 1] conv.
    zero_centred = ("input_layernorm.weight", "post_attention_layernorm.weight",
                    "q_norm.weight", "k_norm.weight")
    weights = [("language_model." + name, value + 1.0 if name == "model.norm.weight"
                or name.endswith(zero_centred) else value)
               for name, value in tree_flatten(ours.parameters())]
    model.load_weights(weights)
    mx.eval(model.parameters())
    return model


def _lm_rollback(cache: list[Any], offset: int) -> None:
    """mlx-lm's caches back to ``offset`` for timing only: KV caches are trimmed, the
    recurrent ones keep their newer state (mlx-lm has no snapshot rollback)."""
    for c in cache:
        if hasattr(c, "trim") and c.is_trimmable():
            c.trim(c.offset - offset)


def verify_cost(model: Any, prompt: mx.array, block: int, reps: int,
                ours: bool) -> dict[str, float]:
    """Milliseconds of one decode step and of one verify forward of ``block`` tokens through
    caches holding the prompt (each call evaluated on its own). Ours runs the verify as the
    speculative round does: snapshots scheduled at every interior offset, then a restore to
    one accepted token (the restore's arrays evaluated inside the timing); the context thus
    grows by one token per call, like decoding."""
    cache = model.make_cache()
    model(prompt[None], cache=cache)
    eval_cache(cache)
    tokens = mx.random.randint(0, prompt.size, (1, block), key=mx.random.key(7))
    pos = prompt.size

    def decode() -> None:
        nonlocal pos
        mx.eval(model(tokens[:, :1], cache=cache), [c.state for c in cache])
        pos += 1

    def verify() -> None:
        nonlocal pos
        if ours:
            for c in cache:
                c.schedule_snapshots(range(pos + 1, pos + block + 1))
        mx.eval(model(tokens, cache=cache), [c.state for c in cache])
        pos += 1
        if ours:
            for c in cache:
                c.restore(pos)
            eval_cache(cache)
        else:
            _lm_rollback(cache, pos)

    result = {}
    for name, fn in (("decode_ms", decode), ("verify_ms", verify)):
        for _ in range(3):  # warm-up: trace, compile
            fn()
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append(time.perf_counter() - start)
        result[name] = 1e3 * sorted(times)[len(times) // 2]  # median
    result["verify_over_decode"] = result["verify_ms"] / result["decode_ms"]
    return result


def _time(fn: Any, reps: int) -> dict[str, float]:
    """Milliseconds per call: building the graph alone, and building plus evaluating it."""
    mx.eval(fn())  # warm-up
    build = total = 0.0
    for _ in range(reps):
        start = time.perf_counter()
        out = fn()
        built = time.perf_counter()
        mx.eval(out)
        done = time.perf_counter()
        build, total = build + built - start, total + done - start
    return {"build_ms": 1e3 * build / reps, "total_ms": 1e3 * total / reps}


def profile(ours: Qwen3_5, reference: Any, context: int, reps: int) -> dict[str, Any]:
    """Per-component time of one decode step (and of a prefill over ``context`` tokens):
    a DeltaNet layer, a full-attention layer reading ``context`` cached tokens, the
    output head. Tells where a whole-model difference comes from."""
    from mlxrunner.plugin import KVCache

    dtype = ours.dtype
    hidden = ours.hidden_size
    one = mx.random.normal((1, 1, hidden)).astype(dtype)
    many = mx.random.normal((1, context, hidden)).astype(dtype)
    lin = next(i for i, layer in enumerate(ours.layers) if layer.is_linear)
    att = next(i for i, layer in enumerate(ours.layers) if not layer.is_linear)
    filled = mx.random.normal((1, ours.config.num_key_value_heads, context,
                               ours.config.head_dim)).astype(dtype)
    ours_kv = KVCache()
    ours_kv.update_and_fetch(filled, filled)

    def ours_attention_step() -> mx.array:
        ours_kv.offset = context
        return ours.layers[att](one, ours_kv)

    rows: dict[str, Any] = {"ours": {
        "deltanet_decode": _time(lambda: ours.layers[lin](one, None), reps),
        "attention_decode": _time(ours_attention_step, reps),
        "head_decode": _time(lambda: ours.raw_logits(one), reps),
        "deltanet_prefill": _time(lambda: ours.layers[lin](many, None), max(2, reps // 10)),
        "attention_prefill": _time(lambda: ours.layers[att](many, None), max(2, reps // 10)),
    }}
    if reference is not None:
        from mlx_lm.models.cache import KVCache as LmKVCache

        layers = reference.language_model.model.layers
        lm_kv = LmKVCache()
        lm_kv.update_and_fetch(filled, filled)

        def lm_attention_step() -> mx.array:
            lm_kv.offset = context
            return layers[att](one, None, lm_kv)

        head = reference.language_model
        rows["mlx_lm"] = {
            "deltanet_decode": _time(lambda: layers[lin](one, None, None), reps),
            "attention_decode": _time(lm_attention_step, reps),
            "head_decode": _time(
                lambda: head.model.embed_tokens.as_linear(one) if head.args.tie_word_embeddings
                else head.lm_head(one), reps),
            "deltanet_prefill": _time(lambda: layers[lin](many, None, None),
                                      max(2, reps // 10)),
            "attention_prefill": _time(lambda: layers[att](many, "causal", None),
                                       max(2, reps // 10)),
        }
    print("  per call (ms, build+eval / build only):")
    for part in rows["ours"]:
        line = f"    {part:18s} mlxrunner {rows['ours'][part]['total_ms']:8.3f} / " \
               f"{rows['ours'][part]['build_ms']:6.3f}"
        if "mlx_lm" in rows:
            line += f"   mlx-lm {rows['mlx_lm'][part]['total_ms']:8.3f} / " \
                    f"{rows['mlx_lm'][part]['build_ms']:6.3f}"
        print(line, flush=True)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--prompt", type=int, help="prompt tokens (default 512; quick 128)")
    parser.add_argument("--new", type=int, help="generated tokens (default 128; quick 16)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs (best kept)")
    parser.add_argument("--layers", type=int, help="keep only the first N layers (default all)")
    parser.add_argument("--vocab", type=int, help="override the vocabulary size")
    parser.add_argument("--quick", action="store_true",
                        help="CPU-sized run: the first 4 layers (3 DeltaNet + 1 attention), "
                             "vocabulary 16384, prompt 128, 16 new tokens")
    parser.add_argument("--eager", action="store_true",
                        help="run our short forwards untraced (no mx.compile of the step)")
    parser.add_argument("--profile", action="store_true",
                        help="also time one DeltaNet layer, one attention layer and the head")
    parser.add_argument("--verify-block", type=int, default=8,
                        help="also time one verify forward of this many tokens through the "
                             "prompt's caches against one decode step (0: skip)")
    harness.add_switched_argument(parser, "kernels=attention (the DeltaNet kernels off)")
    harness.add_common_arguments(parser)
    args = parser.parse_args(argv)
    harness.apply_common_arguments(args)
    if args.quick:
        args.prompt, args.new = args.prompt or 128, args.new or 16
        args.layers = args.layers or 4
        args.vocab = args.vocab or 16384
    args.prompt, args.new = args.prompt or 512, args.new or 128
    if not args.config.is_file():
        print(f"qwen3_5 bench: config not found: {args.config}", file=sys.stderr)
        return 2
    config = json.loads(args.config.read_text())
    config = shrink(config, args.layers, args.vocab)
    dtype = DTYPES[args.dtype]
    device = str(mx.default_device())
    shape = "" if not (args.layers or args.vocab) else \
        f" (layers {args.layers or 'all'}, vocab {args.vocab or 'as configured'})"
    print(f"Qwen3.5 bench: {args.config.name}{shape}, {args.dtype}, prompt {args.prompt}, "
          f"{args.new} new tokens, device {device}, mlx {mx.__version__}", flush=True)
    print(f"  MLX settings for every row: {harness.mlx_settings()}", flush=True)

    base = {"compile": False} if args.eager else {}
    model = build_ours(config, dtype, args.seed)
    ours = harness.Ours(model, **base)
    prompt = mx.random.randint(0, ours.vocab_size, (args.prompt,), key=mx.random.key(args.seed))

    reference, reference_version = harness.load_reference(
        lambda: build_mlx_lm(config, model), skip=args.no_mlx_lm)

    results: dict[str, Any] = {
        "config": args.config.name, "layers": args.layers, "vocab": args.vocab,
        "dtype": args.dtype, "prompt": args.prompt, "new": args.new, "device": device,
        "mlx": mx.__version__, "traced_steps": not args.eager,
        "platform": platform.platform(), "mlx_settings": harness.mlx_settings(),
        "mlx_lm": None,
    }
    if reference is not None:
        harness.record_parity(ours, reference, prompt, results)

    models: dict[str, Any] = {"mlxrunner": ours}
    switched = harness.switched_rows(args.switched, lambda: build_ours(config, dtype, args.seed),
                                     **base)
    models.update(switched)
    if reference is not None:
        models["mlx-lm"] = reference
    nodes = {name: harness.decode_graph_nodes(model, prompt) for name, model in models.items()}
    results["decode_graph_nodes"] = nodes
    harness.print_nodes(nodes)
    best = harness.measure(models, prompt, args.new, args.repeats,
                           name_width=max([10] + [len(name) for name in switched]))
    results["mlxrunner"] = best["mlxrunner"]
    results["switched"] = {name: dict(best[name], switch={k: str(v) for k, v in
                                                         row.changes.items()})
                           for name, row in switched.items()}
    if reference is not None:
        harness.record_reference(results, best, reference_version,
                                 rows=("mlxrunner", *switched))
    if args.verify_block:
        rows = {}
        for name, model in models.items():
            if name in switched:
                continue
            rows[name] = verify_cost(model, prompt, args.verify_block,
                                     10 if args.quick else 30, ours=name == "mlxrunner")
            print(f"  verify {args.verify_block} tokens at context {args.prompt}: {name:10s} "
                  f"{rows[name]['verify_ms']:8.2f} ms = {rows[name]['verify_over_decode']:5.2f}"
                  f" x one decode step ({rows[name]['decode_ms']:.2f} ms)"
                  + ("  [mlx-lm: no DeltaNet rollback]" if name != "mlxrunner" else ""),
                  flush=True)
        results["verify"] = dict(rows, block=args.verify_block, context=args.prompt)
    if args.profile:
        results["profile"] = profile(model, reference, args.prompt, 10 if args.quick else 100)
    harness.write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
