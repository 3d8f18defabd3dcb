"""Matrix products on MLX's CPU device: MLX's own (its Linux wheel links the reference BLAS;
quantized weights through its own loops) against the host BLAS route
(``mlxrunner.nn.kernels.host_products``: numpy's OpenBLAS, quantized weights dequantized once), and
what that makes of decoding.

Sections (each a row of the JSON and a printed table):

- ``products``: one decode step's products of a model, every projection layer of the loaded
  model with its own weights (cold: distinct weights, as a step reads them), for 1, 2, 8
  and 16 rows (a decode step, verify blocks, a batch), MLX's route against the host's, and
  the [rows, 576] x [576, 1536] product alone; medians of ``--repeats``.
- ``decode``: plain greedy decoding of the default model (``mlxrunner.generate``) with the
  route on and off, and mlx-lm's llama on the very same weights (SmolLM2 is a
  LlamaForCausalLM), each run a fresh process, the rows taking turns; medians.
- ``speculative``: the demo pair (``demo-qwen3.5``) speculative against plain, route on and
  off, fresh processes taking turns; medians and whether the outputs were identical.

    python bench/cpu_products.py [--model smollm2:135m] [--repeats 3] [--json PATH]
    python bench/cpu_products.py --only products --blas-threads 1

``--blas-threads N`` sets ``OPENBLAS_NUM_THREADS`` for every run (unset: numpy's default, one
thread per core). CPU figures on a shared machine move by 30%: compare medians of runs that
took turns.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
PROMPT = "Write a short story about a robot who learns to paint."
ROWS = (1, 2, 8, 16)


# -- one process's work (run by the parent through --child) ------------------------------

def child_products(model_name: str, repeats: int) -> dict[str, Any]:
    import mlx.core as mx
    import mlx.nn as nn

    import mlxrunner
    import mlxrunner.nn as mnn
    from mlxrunner import settings

    bundle = mlxrunner.load(model_name)
    layers: list[tuple[str, Any]] = []
    for name, module in bundle.model.named_modules():
        if isinstance(module, (nn.Linear, nn.QuantizedLinear)):
            layers.append((name, module))
    head = _tied_head(bundle.model)
    if head is not None:
        layers.append(("head", head))

    def product(module: Any, x: Any) -> Any:
        return module.as_linear(x) if hasattr(module, "as_linear") else module(x)

    def one_step(rows: int, host: bool) -> float:
        xs = {dims: mx.random.normal((rows, dims)) for dims in {_in_dims(m) for _, m in layers}}
        mx.eval(list(xs.values()))
        with settings.overridden(host_products=host):
            start = time.perf_counter()
            for _, module in layers:
                mx.eval(product(module, xs[_in_dims(module)]))
            return time.perf_counter() - start

    result: dict[str, Any] = {"model": model_name, "layers": len(layers),
                              "weights": sorted({_shape(m) for _, m in layers}), "rows": {}}
    for host in (True, False):  # warm: first-use checks, dequantized copies
        one_step(1, host)
    for rows in ROWS:
        runs: dict[str, list[float]] = {"mlx": [], "host": []}
        for _ in range(repeats):
            for route in ("host", "mlx"):
                runs[route].append(1e3 * one_step(rows, route == "host"))
        result["rows"][rows] = {k: statistics.median(v) for k, v in runs.items()}
        result["rows"][rows]["runs"] = runs
    # the brief's shape alone: [rows, 576] x [576, 1536], float32 and 4-bit
    mx.random.seed(0)
    alone: dict[int, dict[str, float]] = {}
    w = mnn.Linear(576, 1536, bias=False)
    q = mnn.Linear(576, 1536, bias=False).to_quantized(group_size=32, bits=4)
    mx.eval(w.parameters(), q.parameters())
    for rows in ROWS:
        x = mx.random.normal((rows, 576))
        mx.eval(x)
        alone[rows] = {}
        for label, layer in (("float32", w), ("q4", q)):
            for host in (True, False):
                with settings.overridden(host_products=host):
                    mx.eval(layer(x))
                    times = []
                    for _ in range(max(5, 3 * repeats)):
                        t0 = time.perf_counter()
                        mx.eval(layer(x))
                        times.append(time.perf_counter() - t0)
                alone[rows][f"{label} {'host' if host else 'mlx'}"] = \
                    1e3 * statistics.median(times)
    result["576x1536"] = alone
    # float32 agreement of the two routes on this model's logits
    ids = mx.array(bundle.tokenizer.encode(PROMPT))[None]
    with settings.overridden(host_products=True):
        on = bundle.model(ids)
    with settings.overridden(host_products=False):
        off = bundle.model(ids)
    result["logits_max_abs_diff"] = float(mx.abs(on - off).max())
    result["logits_max_abs"] = float(mx.abs(off).max())
    return result


def _tied_head(model: Any) -> Any:
    inner = getattr(model, "model", None)
    tied = getattr(getattr(model, "cfg", None), "tied", None)
    if tied is None:
        tied = not hasattr(model, "lm_head")
    embed = getattr(inner, "embed_tokens", None)
    return embed if tied and embed is not None else None


def _in_dims(module: Any) -> int:
    w = module["weight"]
    return int(w.shape[1] * 32 // module.bits) if "scales" in module else int(w.shape[1])


def _shape(module: Any) -> tuple[int, int]:
    return int(module["weight"].shape[0]), _in_dims(module)


def child_decode(model_name: str, engine: str, tokens: int) -> dict[str, Any]:
    import mlx.core as mx

    import mlxrunner

    bundle = mlxrunner.load(model_name)
    ids = bundle.tokenizer.encode(PROMPT)
    if engine == "mlx-lm":
        return _mlx_lm_decode(bundle, ids, tokens)
    greedy = mlxrunner.SamplerOptions(temperature=0)
    mlxrunner.generate(bundle.model, ids, options=greedy, max_tokens=4, eos_ids=set())
    result = mlxrunner.generate(bundle.model, ids, options=greedy, max_tokens=tokens,
                                eos_ids=set())
    s = result.stats
    del mx
    return {"prefill_tok_s": s.prompt_tokens / s.prefill_seconds,
            "decode_tok_s": (s.generated_tokens - 1) / s.decode_seconds,
            "tokens": result.tokens}


def _mlx_lm_decode(bundle: Any, ids: list[int], tokens: int) -> dict[str, Any]:
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.generate import generate_step
    from mlx_lm.models import llama

    ours = bundle.model
    config = dict(bundle.config)
    config.pop("quantization", None)
    model = llama.Model(llama.ModelArgs.from_dict(config))
    quantized = {name: (m.group_size, m.bits, m.mode) for name, m in ours.named_modules()
                 if "scales" in m}

    def predicate(path: str, module: Any) -> Any:
        if path not in quantized:
            return False
        group, bits, mode = quantized[path]
        return {"group_size": group, "bits": bits, "mode": mode}

    nn.quantize(model, class_predicate=predicate)
    model.load_weights(list(tree_flatten(ours.parameters())), strict=True)
    mx.eval(model.parameters())
    prompt = mx.array(ids)

    def run(n: int) -> tuple[float, float, list[int]]:
        out: list[int] = []
        t0 = time.perf_counter()
        t_first = t0
        for token, _ in generate_step(prompt, model, max_tokens=n,
                                      sampler=lambda logits: mx.argmax(logits, axis=-1)):
            if not out:
                t_first = time.perf_counter()
            out.append(int(token))
        return t_first - t0, time.perf_counter() - t_first, out

    run(4)
    prefill_s, decode_s, out = run(tokens)
    return {"prefill_tok_s": len(ids) / prefill_s, "decode_tok_s": (len(out) - 1) / decode_s,
            "tokens": out}


def child_speculative(model_name: str, tokens: int) -> dict[str, Any]:
    import mlxrunner

    bundle = mlxrunner.load(model_name)
    ids = bundle.tokenizer.encode("def fibonacci(n):")
    greedy = mlxrunner.SamplerOptions(temperature=0)
    out: dict[str, Any] = {}
    for label, draft in (("plain", None), ("speculative", bundle.draft), ("plain", None),
                         ("speculative", bundle.draft)):  # the first of each warms up
        t0 = time.perf_counter()
        result = mlxrunner.generate(bundle.model, ids, options=greedy, max_tokens=tokens,
                                    eos_ids=set(), draft=draft)
        s = result.stats
        out[label] = {"decode_tok_s": (s.generated_tokens - 1) / s.decode_seconds,
                      "seconds": time.perf_counter() - t0, "tokens": result.tokens}
    out["identical"] = out["plain"]["tokens"] == out["speculative"]["tokens"]
    out["speedup"] = out["speculative"]["decode_tok_s"] / out["plain"]["decode_tok_s"]
    return out


# -- the parent ------------------------------------------------------------------------

def spawn(args: argparse.Namespace, host: bool, *child: str) -> dict[str, Any]:
    env = dict(os.environ, MLXRUNNER_HOST_PRODUCTS="1" if host else "0")
    if args.blas_threads:
        env["OPENBLAS_NUM_THREADS"] = str(args.blas_threads)
    done = subprocess.run([sys.executable, __file__, "--child", *child], env=env,
                          capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise SystemExit(f"a run failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def median_of(runs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2:135m")
    parser.add_argument("--pair", default="demo-qwen3.5")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--only", choices=("products", "decode", "speculative"), action="append")
    parser.add_argument("--no-mlx-lm", action="store_true")
    parser.add_argument("--blas-threads", type=int)
    parser.add_argument("--json", type=Path)
    parser.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        kind, *rest = args.child
        if kind == "products":
            out = child_products(rest[0], int(rest[1]))
        elif kind == "decode":
            out = child_decode(rest[0], rest[1], int(rest[2]))
        else:
            out = child_speculative(rest[0], int(rest[1]))
        print(json.dumps(out))
        return 0

    sections = args.only or ["products", "decode", "speculative"]
    results: dict[str, Any] = {
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                    "python": platform.python_version(),
                    "openblas_threads": args.blas_threads or "numpy's default"},
        "load_average_start": os.getloadavg()}
    if "products" in sections:
        print(f"products of one {args.model} decode step (ms, medians of {args.repeats})")
        p = results["products"] = spawn(args, True, "products", args.model, str(args.repeats))
        print(f"  {'rows':>4s} {'MLX':>10s} {'host':>10s} {'ratio':>7s}")
        for rows, row in p["rows"].items():
            print(f"  {rows:>4s} {row['mlx']:10.1f} {row['host']:10.1f} "
                  f"{row['mlx'] / row['host']:7.1f}x")
        print("  [rows, 576] x [576, 1536] alone (ms):")
        for rows, row in p["576x1536"].items():
            print(f"  {rows:>4s} " + "  ".join(f"{k} {v:.3f}" for k, v in row.items()))
        print(f"  logits, route on vs off: max |diff| {p['logits_max_abs_diff']:.3g} "
              f"(largest |logit| {p['logits_max_abs']:.3g})")
    if "decode" in sections:
        engines = [("mlxrunner host", True, "ours"), ("mlxrunner MLX", False, "ours")]
        if not args.no_mlx_lm:
            engines.append(("mlx-lm", False, "mlx-lm"))
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _, _ in engines}
        for repeat in range(args.repeats):
            shift = repeat % len(engines)
            for name, host, engine in engines[shift:] + engines[:shift]:
                runs[name].append(spawn(args, host, "decode", args.model, engine,
                                        str(args.tokens)))
        d = results["decode"] = {}
        print(f"plain greedy decoding of {args.model}, {args.tokens} tokens "
              f"(medians of {args.repeats} fresh processes taking turns)")
        for name, got in runs.items():
            d[name] = {"decode_tok_s": median_of(got, "decode_tok_s"),
                       "prefill_tok_s": median_of(got, "prefill_tok_s"),
                       "decode_runs": [r["decode_tok_s"] for r in got],
                       "tokens": got[0]["tokens"]}
            print(f"  {name:15s} decode {d[name]['decode_tok_s']:7.2f} tok/s   prefill "
                  f"{d[name]['prefill_tok_s']:7.1f} tok/s   runs "
                  + " ".join(f"{r:.2f}" for r in d[name]["decode_runs"]))
        same = len({tuple(v["tokens"]) for v in d.values()}) == 1
        d["identical_tokens"] = same
        print(f"  the same tokens from every row: {same}")
    if "speculative" in sections:
        rows = {"host": True, "MLX": False}
        spec: dict[str, list[dict[str, Any]]] = {name: [] for name in rows}
        for repeat in range(args.repeats):
            order = list(rows) if repeat % 2 == 0 else list(rows)[::-1]
            for name in order:
                spec[name].append(spawn(args, rows[name], "speculative", args.pair,
                                        str(4 * args.tokens)))
        s = results["speculative"] = {}
        print(f"{args.pair}: speculative against plain, {4 * args.tokens} greedy tokens")
        for name, got in spec.items():
            s[name] = {"plain_tok_s": statistics.median(g["plain"]["decode_tok_s"] for g in got),
                       "speculative_tok_s": statistics.median(
                           g["speculative"]["decode_tok_s"] for g in got),
                       "speedup": statistics.median(g["speedup"] for g in got),
                       "identical": all(g["identical"] for g in got)}
            print(f"  route {name:5s} plain {s[name]['plain_tok_s']:8.1f} tok/s   speculative "
                  f"{s[name]['speculative_tok_s']:8.1f} tok/s   speedup "
                  f"{s[name]['speedup']:.2f}x   identical {s[name]['identical']}")
    results["load_average_end"] = os.getloadavg()
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        print(f"  wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
