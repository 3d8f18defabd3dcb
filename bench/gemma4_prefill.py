"""Where a Gemma 4 prefill's time goes, ours against mlx-lm's on the same weights: the
whole prompt (caches evaluated, as ``bench/gemma4.py`` times it), the embeddings with the
per-layer inputs, and each cache-writing layer on its own (from the same evaluated input,
with a fresh cache; the first of each kind also in parts: attention, and within it the
heads, the cache write and the attention alone; MLP; per-layer input), medians of
``--repeats`` synchronised runs in milliseconds; and the time Python takes to build the
whole prompt's graph alone (``--profile``: ours and mlx-lm's, by function). ``--series``:
only each prompt's build and evaluation times in turn, ``--repeats`` of them a tool, back to
back, in ``bench/gemma4.py``'s own turns, after a 128-token decode of its own or of the other
tool's, after 20 ms with the host idle, after ``gemma4.py``'s parity check, after a CPU pass
that reads the weights and after ``mx.clear_cache()``: what slows a tool's prompt.

    python bench/gemma4_prefill.py [--quick] [--prompt 512] [--repeats 7] [--profile]
        [--build-only] [--series] [--json PATH]
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import json
import pstats
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import device_clock
import gemma4
import harness
import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import scaled_dot_product_attention as sdpa

import mlxrunner.nn as mnn


def timed(fn: Callable[[], Any], repeats: int) -> float:
    """Median milliseconds of ``fn`` (its result evaluated), after one warm-up."""
    mx.eval(fn())
    times = []
    for _ in range(repeats):
        mx.synchronize()
        start = time.perf_counter()
        mx.eval(fn())
        mx.synchronize()
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="the CPU-sized layout")
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--profile", action="store_true",
                        help="print where Python's time goes building each prompt's graph")
    parser.add_argument("--build-only", action="store_true",
                        help="only the time Python takes to build the whole prompt's graph "
                             "(after one evaluated prompt each)")
    parser.add_argument("--series", action="store_true",
                        help="only each prompt's build and evaluation times in turn")
    args = parser.parse_args(argv)
    config = gemma4.bench_config(args.quick)
    model = gemma4.build_ours(config, mx.bfloat16, 0)
    reference = gemma4.build_mlx_lm(config, model)
    ours_row = harness.Ours(model)
    a = model.args
    ids = mx.random.randint(0, a.vocab_size, (1, args.prompt - 1), key=mx.random.key(0))
    rows: dict[str, dict[str, float]] = {}

    def row(name: str, mine: Callable[[], Any], theirs: Callable[[], Any]) -> None:
        rows[name] = {"mlxrunner": timed(mine, args.repeats),
                      "mlx-lm": timed(theirs, args.repeats)}
        r = rows[name]
        print(f"  {name:<28} mlxrunner {r['mlxrunner']:8.3f} ms   mlx-lm {r['mlx-lm']:8.3f} ms"
              f"   ratio {r['mlx-lm'] / r['mlxrunner']:5.2f}x", flush=True)

    def whole(fn: Any) -> Callable[[], Any]:
        def run() -> Any:
            cache = fn.make_cache()
            device_clock.fill(fn, ids, cache)
            return [c.state for c in cache if c is not None]
        return run

    print(f"Gemma 4 prefill parts: {args.prompt - 1} tokens, {mx.default_device()}, "
          f"mlx {mx.__version__}", flush=True)
    if args.series:
        series = prompt_series(ours_row, reference, ids, args.repeats)
        if args.json:
            args.json.write_text(json.dumps({"prompt": args.prompt, "mlx": mx.__version__,
                                             "device": str(mx.default_device()),
                                             "series": series}, indent=1))
        return 0
    if args.build_only:  # (the first prompt settles checks and derived weights)
        mx.eval(whole(ours_row)(), whole(reference)())
    else:
        row("whole (caches)", whole(ours_row), whole(reference))
        row("whole, eager model", whole(model), whole(reference))

    def built(fn: Any) -> Callable[[], float]:
        """Milliseconds Python takes to build the whole prompt's graph (nothing evaluated:
        the build's result is dropped unevaluated)."""
        def run() -> float:
            cache = fn.make_cache()
            start = time.perf_counter()
            device_clock.fill(fn, ids, cache)
            return 1e3 * (time.perf_counter() - start)
        return run

    build = {name: statistics.median(built(fn)() for _ in range(args.repeats))
             for name, fn in (("mlxrunner", ours_row), ("mlx-lm", reference))}
    rows["whole, building alone"] = build
    print(f"  {'whole, building alone':<28} mlxrunner {build['mlxrunner']:8.3f} ms   mlx-lm "
          f"{build['mlx-lm']:8.3f} ms   ratio {build['mlx-lm'] / build['mlxrunner']:5.2f}x",
          flush=True)
    if args.profile:  # (mlx-lm's too: what each spends a layer's calls on, on this host)
        for name, fn in (("mlxrunner", ours_row), ("mlx-lm", reference)):
            profile = cProfile.Profile()
            profile.enable()
            for _ in range(args.repeats):
                built(fn)()
            profile.disable()
            print(f"  building {name}'s prompt, {args.repeats} times:", flush=True)
            pstats.Stats(profile, stream=sys.stdout).sort_stats("tottime").print_stats(30)
    if not args.build_only:
        layer_parts(model, reference, ids, row)
    if args.json:
        args.json.write_text(json.dumps({"prompt": args.prompt, "device": str(mx.default_device()),
                                         "mlx": mx.__version__, "rows": rows}, indent=1))
    return 0


def prompt_series(ours: Any, reference: Any, ids: mx.array, repeats: int
                  ) -> dict[str, dict[str, list[list[float]]]]:
    """Each tool's prompt ``repeats`` times in turn, [build ms, evaluation ms] each (the
    evaluation with the device's tail): back to back; in ``bench/gemma4.py``'s own turns
    (``harness.run`` of each tool in turn, a 128-token decode after each prompt and a
    ``gc.collect``); each after a 128-token decode of its own or of the other tool's; after
    20 ms with the host idle; then back to back and in the bench's turns again after the
    bench's parity check (``harness.record_parity``); in its turns after a float32 pass on
    the CPU that casts the shared weights there (as that check did before its casts moved
    to the GPU: on MLX's CUDA backend an array the CPU reads moves to host memory for good,
    and the buffers the pass frees, host memory too, stay in MLX's cache for later GPU
    arrays of their sizes); and in its turns once more after ``mx.clear_cache()`` (which
    frees those buffers, not the weights)."""
    prompt = mx.concatenate([ids[0], ids[0, -1:]])
    tools = {"mlxrunner": ours, "mlx-lm": reference}

    def one(fn: Any) -> list[float]:
        cache = fn.make_cache()
        mx.synchronize()
        start = time.perf_counter()
        device_clock.fill(fn, ids, cache)
        built = time.perf_counter()
        harness.eval_cache(cache)
        mx.synchronize()
        done = time.perf_counter()
        return [round(1e3 * (built - start), 3), round(1e3 * (done - built), 3)]

    def turns() -> dict[str, list[list[float]]]:
        runs: dict[str, list[list[float]]] = {name: [] for name in tools}
        for _ in range(repeats):
            for name, fn in tools.items():
                result = harness.run(fn, fn.make_cache(), prompt, 128)
                gc.collect()
                built = result["prefill_build_ms"]
                runs[name].append([round(built, 3),
                                   round(1e3 * result["prefill_s"] - built, 3)])
        return runs

    for fn in tools.values():
        one(fn)
    out: dict[str, dict[str, list[list[float]]]] = {}
    other = {"mlxrunner": reference, "mlx-lm": ours}
    for label in ("back to back", "in the bench's turns", "after a decode",
                  "after the other's decode", "after 20 ms idle", "after gemma4.py's parity",
                  "in the bench's turns after the parity",
                  "in the bench's turns after a CPU pass reading the weights",
                  "in the bench's turns after mx.clear_cache()"):
        if label == "after gemma4.py's parity":  # (its float32 pass swaps every weight)
            harness.record_parity(ours, reference, prompt, {})
        elif "CPU pass" in label:  # (the CPU reads the weights themselves: see the docstring)
            with mx.stream(mx.cpu):
                for fn in tools.values():
                    harness.float32_logits(fn, prompt[None, :16])
        elif "clear_cache" in label:
            mx.clear_cache()
        if "turns" in label:
            out[label] = turns()
        for name, fn in tools.items():
            if "turns" not in label:
                runs = []
                for _ in range(repeats):
                    if label == "after a decode":
                        harness.run(fn, fn.make_cache(), prompt, 128)
                    elif label == "after the other's decode":
                        harness.run(other[name], other[name].make_cache(), prompt, 128)
                    elif label == "after 20 ms idle":  # (a host core left idle: its clock?)
                        time.sleep(0.02)
                    runs.append(one(fn))
                out.setdefault(label, {})[name] = runs
            print(f"  {label:<58} {name:<10} build / evaluation ms: "
                  + "  ".join(f"{b:.2f}/{e:.2f}" for b, e in out[label][name]), flush=True)
    return out


def layer_parts(model: Any, reference: Any, ids: mx.array,
                row: Callable[[str, Callable[[], Any], Callable[[], Any]], None]) -> None:
    """The embeddings with the per-layer inputs, and each cache-writing layer on its own
    (the first of each kind also in parts), ours against mlx-lm's, as ``row`` rows."""
    text = reference.language_model.model
    a = model.args

    def ours_inputs() -> Any:
        h = model.model.embed_tokens(ids)
        return [h, *model.model.per_layer_inputs(ids, h, a)]

    def their_inputs() -> Any:
        e = text.embed_tokens(ids)
        h = e * text.embed_scale
        return [h, text._project_per_layer_inputs(h, text._get_per_layer_inputs(ids, e))]

    row("embeddings + per-layer", ours_inputs, their_inputs)
    h0, *per_layer = ours_inputs()
    mx.eval(h0, per_layer)
    their_per_layer = mx.stack(per_layer, axis=2)
    mx.eval(their_per_layer)
    def parts(i: int, layer: Any, theirs: Any, x: mx.array, pli: mx.array,
              their_pli: mx.array, kind: str) -> None:
        """A layer's attention (its input norm, projections, heads, cache write, attention
        and output projection), MLP (with its norm) and per-layer-input block alone."""
        def attention_mine() -> Any:
            cache = model.make_cache()[i]
            out, _ = layer.self_attn(layer.input_layernorm(x), cache, 0, None)
            return [out, *cache.state]

        def attention_theirs() -> Any:
            cache = reference.make_cache()
            out, _, _ = theirs.self_attn(theirs.input_layernorm(x),
                                         text._make_masks(x, cache)[i], cache[i])
            return [out, *cache[i].state]

        row(f"  attention ({kind})", attention_mine, attention_theirs)
        attention_parts(i, layer.self_attn, theirs.self_attn, x, kind)
        row(f"  MLP ({kind})", lambda: layer.mlp(layer.pre_feedforward_layernorm(x)),
            lambda: theirs.mlp(theirs.pre_feedforward_layernorm(x)))

        def per_layer_mine() -> Any:
            gate = mnn.gelu_tanh_mul(layer.per_layer_input_gate(x), pli)
            return layer.post_per_layer_input_norm(layer.per_layer_projection(gate))

        def per_layer_theirs() -> Any:
            gate = nn.gelu_approx(theirs.per_layer_input_gate(x)) * their_pli
            return theirs.post_per_layer_input_norm(theirs.per_layer_projection(gate))

        row(f"  per-layer input ({kind})", per_layer_mine, per_layer_theirs)

    def attention_parts(i: int, mine: Any, theirs: Any, x: mx.array, kind: str) -> None:
        """The attention's heads (norms, RoPE, layout: ours from the same projections),
        its cache write (with theirs, the mask) and the attention itself, each from the
        same evaluated inputs."""
        B, L, _ = x.shape
        q, k, v = (y.reshape(B, L, -1, mine.head_dim) for y in
                   mnn.linears(x, mine.q_proj, mine.k_proj, mine.v_proj))
        mx.eval(q, k, v)

        def heads_mine() -> Any:
            return mnn.attention_heads(0, (q, mine.q_norm, mine.rope), (k, mine.k_norm, mine.rope),
                                       (v, mine.eps, None))

        def heads_theirs() -> Any:
            qq, kk, vv = (norm(y).transpose(0, 2, 1, 3) for norm, y in
                          ((theirs.q_norm, q), (theirs.k_norm, k), (theirs.v_norm, v)))
            return [theirs.rope(qq, offset=0), theirs.rope(kk, offset=0), vv]

        qh, kh, vh = heads_mine()
        mx.eval(qh, kh, vh)

        def store_mine() -> Any:
            kv = mnn.store(model.make_cache()[i], kh, vh, mine.window)
            return [kv.keys, kv.values, *([kv.mask] if isinstance(kv.mask, mx.array) else [])]

        def store_theirs() -> Any:
            cache = reference.make_cache()
            mask = text._make_masks(x, cache)[i]
            keys, values = cache[i].update_and_fetch(kh, vh)
            return [keys, values, *([mask] if isinstance(mask, mx.array) else [])]

        ours_kv, their_kv = store_mine(), store_theirs()
        mx.eval(ours_kv, their_kv)
        ours_mask = mnn.store(model.make_cache()[i], kh, vh, mine.window).mask
        their_mask = text._make_masks(x, reference.make_cache())[i]
        row(f"    heads ({kind})", heads_mine, heads_theirs)
        row(f"    cache write ({kind})", store_mine, store_theirs)
        row(f"    attend ({kind})",
            lambda: mnn.attend(qh, *ours_kv[:2], ours_mask, scale=1.0),
            lambda: sdpa(qh, *their_kv[:2], cache=None, scale=1.0, mask=their_mask))

    writers = [i for i in range(a.num_layers) if a.kv_source[i] == i]
    h = h0
    for i in writers:
        layer, theirs = model.layers[i], text.layers[i]
        x = h

        def mine(layer: Any = layer, x: mx.array = x, i: int = i) -> Any:
            cache = model.make_cache()[i]
            out, _ = layer(x, cache, 0, None, per_layer[i])
            return [out, *cache.state]

        def their(theirs: Any = theirs, x: mx.array = x, i: int = i) -> Any:
            cache = reference.make_cache()
            mask = text._make_masks(x, cache)[i]
            out, _, _ = theirs(x, mask, cache[i], per_layer_input=their_per_layer[:, :, i],
                               shared_kv=None, offset=None)
            return [out, *cache[i].state]

        kind = a.layer_types[i].split('_')[0]
        row(f"layer {i} ({kind})", mine, their)
        if i == a.layer_types.index(a.layer_types[i]):  # the first layer of its kind: parts
            parts(i, layer, theirs, x, per_layer[i], their_per_layer[:, :, i], kind)
        h = mine()[0]
        mx.eval(h)


if __name__ == "__main__":
    sys.exit(main())
