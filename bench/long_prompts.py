"""Prefill time of long prompts on the default model (or MODEL): does it grow much faster
than the prompt? One ``generate`` of one token per prompt length, the lengths taking turns in
each repeat; medians with their range, and the ratio of each length's time to the first's
(medians of per-repeat ratios).

    python bench/long_prompts.py [MODEL] [--lengths 2430 4830] [--repeats 5] [--json F]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import numpy as np

import mlxrunner
from mlxrunner import SamplerOptions


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", nargs="?", default="default")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2430, 4830])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    bundle = mlxrunner.load(args.model)
    rng = np.random.default_rng(0)
    vocab = bundle.model.vocab_size
    prompts = {n: rng.integers(100, vocab - 100, n).tolist() for n in args.lengths}
    greedy = SamplerOptions(temperature=0)
    mlxrunner.generate(bundle.model, prompts[args.lengths[0]][:64], options=greedy,
                       max_tokens=1)  # warm-up
    seconds: dict[int, list[float]] = {n: [] for n in args.lengths}
    for _ in range(args.repeats):
        for n in args.lengths:
            start = time.perf_counter()
            mlxrunner.generate(bundle.model, prompts[n], options=greedy, max_tokens=1)
            seconds[n].append(time.perf_counter() - start)
    first = args.lengths[0]
    rows = []
    print(f"long prompts, {args.model}, {platform.machine()} ({platform.processor() or '?'}), "
          f"{args.repeats} repeats")
    for n in args.lengths:
        ratios = [a / b for a, b in zip(seconds[n], seconds[first])]
        row = {"tokens": n, "seconds_median": statistics.median(seconds[n]),
               "seconds_range": [min(seconds[n]), max(seconds[n])],
               "vs_first_median": statistics.median(ratios),
               "vs_first_range": [min(ratios), max(ratios)], "seconds": seconds[n]}
        rows.append(row)
        print(f"  {n:6d} tokens: {row['seconds_median']:7.2f} s ({min(seconds[n]):.2f}-"
              f"{max(seconds[n]):.2f}); {row['vs_first_median']:.2f}x the {first}-token time "
              f"({min(ratios):.2f}-{max(ratios):.2f})")
    if args.json:
        args.json.write_text(json.dumps({"bench": "long_prompts", "model": args.model,
                                         "machine": platform.processor() or platform.machine(),
                                         "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
