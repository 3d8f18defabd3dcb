"""A prompt's time with its stream handed to the device every k layers
(``MLXRUNNER_PROMPT_SUBMIT_LAYERS``, see ``mlxrunner.nn.Taps``), ours at each k against
mlx-lm on the same random weights: Gemma 4 E2B and the example Llama-3.2-1B shape, bf16.

A prompt here is one chunk of ``--prompts`` tokens prefilled into a fresh cache as the
core's prefill runs a chunk before a prompt's last (``caches_only``), its caches evaluated:
milliseconds from the build's start to the caches' evaluation (``build``: the Python part,
which includes what each submission costs the host). Rows run interleaved, ``--repeats``
times after ``--warmup`` rounds; a ratio is mlx-lm's time over ours, the median of the
per-repeat ratios with their range.

    python bench/prompt_submit.py --json out.json          # GPU: both models, 511 and 2047
    /work/venv/bin/python bench/prompt_submit.py --quick   # CPU-sized shapes
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import device_clock
import gemma4
import harness
import llama
import mlx.core as mx

from mlxrunner import settings


def prompt_ms(model: Any, ids: mx.array, every: int | None) -> tuple[float, float]:
    """(total, build) milliseconds of one prompt chunk into a fresh cache."""
    cache = model.make_cache()
    mx.synchronize()
    changes = {} if every is None else {"prompt_submit_layers": every}
    with settings.overridden(**changes):
        start = time.perf_counter()
        device_clock.fill(model, ids, cache)
        built = time.perf_counter()
        mx.eval([c.state for c in cache if c is not None])
        done = time.perf_counter()
    return 1e3 * (done - start), 1e3 * (built - start)


def compare(ours: Any, reference: Any, ids: mx.array, ks: list[int], repeats: int,
            warmup: int) -> dict[str, Any]:
    rows: dict[str, tuple[Any, int | None]] = {"mlx-lm": (reference, None)}
    rows.update({f"k={k}": (ours, k) for k in ks})
    for _ in range(warmup):
        for model, k in rows.values():
            prompt_ms(model, ids, k)
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in rows}
    for _ in range(repeats):
        for name, (model, k) in rows.items():
            runs[name].append(prompt_ms(model, ids, k))
    result: dict[str, Any] = {}
    for name, times in runs.items():
        totals = [t for t, _ in times]
        result[name] = {"total_ms": statistics.median(totals), "range_ms": [min(totals),
                        max(totals)], "build_ms": statistics.median(b for _, b in times)}
        if name != "mlx-lm":  # (a ratio against mlx-lm's own time, per repeat)
            ratios = [theirs / mine for (theirs, _), mine in zip(runs["mlx-lm"], totals)]
            result[name].update(ratio=statistics.median(ratios),
                                ratio_range=[min(ratios), max(ratios)])
    return result


def models(which: str, quick: bool) -> tuple[Any, Any, int]:
    """(ours as the core runs it, mlx-lm's, vocabulary size) of one bench shape."""
    if which == "gemma4":
        config = gemma4.bench_config(quick)
        model = gemma4.build_ours(config, mx.bfloat16, 0)
        return harness.Ours(model), gemma4.build_mlx_lm(config, model), model.args.vocab_size
    config = dict(llama.LLAMA_3_2_1B)
    if quick:
        config.update(num_hidden_layers=4, hidden_size=256, intermediate_size=512,
                      num_attention_heads=4, num_key_value_heads=1, vocab_size=1024)
    weights = llama.random_weights(llama.ExampleLlama(config), mx.bfloat16, 0)
    example = llama.loaded(llama.ExampleLlama, config, weights)
    return harness.Ours(example), llama.build_mlx_lm(config, weights), config["vocab_size"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", default="gemma4,llama")
    parser.add_argument("--prompts", default="511,2047", help="chunk lengths, comma-separated")
    parser.add_argument("--ks", default="0,1,2,4,8", help="layers between submissions")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--quick", action="store_true",
                        help="CPU-sized shapes, 95 tokens (--prompts unread)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    try:
        names = [n for n in args.models.split(",") if n]
        prompts = [95] if args.quick else [int(p) for p in args.prompts.split(",")]
        ks = [int(k) for k in args.ks.split(",")]
    except ValueError:
        parser.error("--prompts and --ks take comma-separated whole numbers")
    unknown = sorted(set(names) - {"gemma4", "llama"})
    if unknown or any(k < 0 for k in ks) or any(p < 1 for p in prompts):
        parser.error(f"--models: gemma4, llama; --ks >= 0; --prompts >= 1 (got {unknown})")
    print(f"prompt submission: {mx.default_device()}, mlx {mx.__version__}, "
          f"{args.repeats} repeats", flush=True)
    results: dict[str, Any] = {"device": str(mx.default_device()), "mlx": mx.__version__,
                               "repeats": args.repeats, "rows": {}}
    for name in names:
        ours, reference, vocab = models(name, args.quick)
        for length in prompts:
            ids = mx.random.randint(0, vocab, (1, length), key=mx.random.key(0))
            rows = compare(ours, reference, ids, ks, args.repeats, args.warmup)
            results["rows"][f"{name} {length}"] = rows
            print(f"{name}, prompt {length}:", flush=True)
            for row, r in rows.items():
                ratio = "" if row == "mlx-lm" else (
                    f"  mlx-lm / this {r['ratio']:5.2f}x ({r['ratio_range'][0]:.2f}-"
                    f"{r['ratio_range'][1]:.2f})")
                print(f"  {row:7s} {r['total_ms']:8.2f} ms ({r['range_ms'][0]:.2f}-"
                      f"{r['range_ms'][1]:.2f})  build {r['build_ms']:6.2f}{ratio}", flush=True)
        del ours, reference
    harness.write_json(args.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
