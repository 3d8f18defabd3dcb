"""A Gemma 4 E2B decode step's products, one row each, through ``mlxrunner.nn`` (on CUDA the
core's fused product kernels) against MLX's own (``x @ w.T``; the gated MLP as mlx-lm writes
it), on the default device: time per call and the weight bytes read per second.

Each case is called ``--count`` times in one evaluation, on distinct inputs and on enough
distinct copies of its weights that together they pass ``--cache-mb`` (so the device reads
them from its memory, not from its L2 cache, as a decode step does). The calls' graph is
built first (Python's time, shown apart: a traced decode step replays it without Python),
then evaluated: a figure is the larger of the host's submission and the device's work per
call: a product of a few MB is bound by the host, a large one by the device, whose rate the
GB/s column then gives (an H100 SXM's memory reads about 3,350 GB/s). On CUDA also the
device's own time for one call alone (``bench/device_clock.py``: its kernels and their
launches, as a decode step's chain of dependent calls pays them), median of 15, each on the
next copy of the weights.

    python bench/product_bandwidth.py [--count 64] [--cache-mb 160] [--quick] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections.abc import Callable
from typing import Any

import device_clock
import harness
import mlx.core as mx
import mlx.nn as nn

import mlxrunner.nn as mnn

HIDDEN, INTER, HEAD_DIM, FULL_HEAD_DIM, HEADS, PER_LAYER, VOCAB = \
    1536, 6144, 256, 512, 8, 256, 262144


def cases(scale: int) -> dict[str, tuple[int, list[int], str]]:
    """name: (input width, output widths of the layers reading that input, kind); ``scale``
    divides every width (the CPU-sized layout)."""
    h, i, d, fd = HIDDEN // scale, INTER // scale, HEAD_DIM // scale, FULL_HEAD_DIM // scale
    heads, p, v = HEADS, PER_LAYER // scale, VOCAB // scale
    return {
        "q/k/v, sliding layer": (h, [heads * d, d, d], "linears"),
        "q/k/v, full layer": (h, [heads * fd, fd, fd], "linears"),
        "o, sliding layer": (heads * d, [h], "linears"),
        "MLP (gate/up, GELU, down)": (h, [i], "mlp"),
        "MLP, KV-sharing layer (double)": (h, [2 * i], "mlp"),
        "per-layer input gate": (h, [p], "linears"),
        "per-layer projection": (p, [h], "linears"),
        "output head": (h, [v], "linears"),
    }


def _weight(rows: int, cols: int, key: mx.array) -> mx.array:
    return (mx.random.normal((rows, cols), key=key) * cols ** -0.5).astype(mx.bfloat16)


def build(width: int, outs: list[int], kind: str, copies: int
          ) -> tuple[list[Callable[[mx.array], Any]], list[Callable[[mx.array], Any]], int]:
    """``copies`` callables of ours and of MLX's for one case, and the weight bytes one call
    reads."""
    ours: list[Callable[[mx.array], Any]] = []
    theirs: list[Callable[[mx.array], Any]] = []
    nbytes = 0
    for c in range(copies):
        keys = mx.random.split(mx.random.key(c), 3)
        if kind == "mlp":
            mlp = mnn.GatedMLP(width, outs[0], "gelu_pytorch_tanh")
            mlp.gate_proj.weight = _weight(outs[0], width, keys[0])
            mlp.up_proj.weight = _weight(outs[0], width, keys[1])
            mlp.down_proj.weight = _weight(width, outs[0], keys[2])
            mx.eval(mlp.parameters())
            gate, up, down = (mlp.gate_proj.weight, mlp.up_proj.weight,
                              mlp.down_proj.weight)
            ours.append(mlp)
            theirs.append(lambda x, g=gate, u=up, d=down:
                          (nn.gelu_approx(x @ g.T) * (x @ u.T)) @ d.T)
            nbytes = 3 * width * outs[0] * 2
        else:
            layers = []
            for j, out in enumerate(outs):
                layer = mnn.Linear(width, out, bias=False)
                layer.weight = _weight(out, width, mx.random.split(keys[0], len(outs))[j])
                layers.append(layer)
            mx.eval([layer.parameters() for layer in layers])
            weights = [layer.weight for layer in layers]
            ours.append(lambda x, ls=tuple(layers): mnn.linears(x, *ls))
            theirs.append(lambda x, ws=tuple(weights): [x @ w.T for w in ws])
            nbytes = sum(outs) * width * 2
    return ours, theirs, nbytes


def _device_part(row: dict[str, Any]) -> str:
    if "mlx_device_us" not in row:
        return ""
    ours, theirs = row["mlxrunner_device_us"], row["mlx_device_us"]
    if ours is None or theirs is None:
        return "   (device: host behind)"
    return f"   device a call alone: {ours:.1f} / {theirs:.1f} us"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cache-mb", type=harness.at_least(1), default=160,
                        help="the weights' copies of a case pass this many MB together")
    harness.add_call_arguments(parser, "every width / 8 (the CPU)")
    args = parser.parse_args(argv)
    scale = 8 if args.quick else 1
    print(f"product bandwidth: {mx.default_device()}, mlx {mx.__version__}, {args.count} "
          f"calls queued, weights past {args.cache_mb:g} MB, medians of {args.repeats}",
          flush=True)
    results: dict[str, dict[str, float]] = {}
    for name, (width, outs, kind) in cases(scale).items():
        one = (3 if kind == "mlp" else 1) * sum(outs) * width * 2
        copies = max(1, math.ceil(args.cache_mb * 2 ** 20 / one))
        ours, theirs, nbytes = build(width, outs, kind, copies)
        xs = [mx.random.normal((1, 1, width), key=mx.random.key(1000 + n)).astype(mx.bfloat16)
              for n in range(args.count)]
        mx.eval(xs)
        times: dict[str, list[tuple[float, float]]] = {"mlxrunner": [], "mlx": []}
        harness.queued_us(ours, xs)  # warm-up: traces, kernel checks, JIT, each copy's first use
        harness.queued_us(theirs, xs)
        for _ in range(args.repeats):
            times["mlxrunner"].append(harness.queued_us(ours, xs))
            times["mlx"].append(harness.queued_us(theirs, xs))
        row = {}
        for who, t in times.items():
            row[f"{who}_build_us"] = statistics.median(b for b, _ in t)
            row[f"{who}_us"] = statistics.median(e for _, e in t)
            row[f"{who}_gb_s"] = nbytes / 1e3 / row[f"{who}_us"]
        row.update(weight_mb=nbytes / 2 ** 20, copies=copies)
        if device_clock.available():  # one call alone on the device: a decode step's chain
            row["mlxrunner_device_us"] = device_clock.call_us(ours, xs[0])
            row["mlx_device_us"] = device_clock.call_us(theirs, xs[0])
        results[name] = row
        print(f"  {name:32s} {row['weight_mb']:7.1f} MB   mlxrunner {row['mlxrunner_us']:8.2f} us "
              f"({row['mlxrunner_gb_s']:6.0f} GB/s)   MLX {row['mlx_us']:8.2f} us "
              f"({row['mlx_gb_s']:6.0f} GB/s)   ratio {row['mlx_us'] / row['mlxrunner_us']:5.2f}x"
              f"   (building a call: {row['mlxrunner_build_us']:.1f} / "
              f"{row['mlx_build_us']:.1f} us)" + _device_part(row), flush=True)
        del ours, theirs
    if args.json:
        args.json.write_text(json.dumps({"device": str(mx.default_device()),
                                         "mlx": mx.__version__, "count": args.count,
                                         "cases": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
