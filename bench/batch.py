"""Continuous batching: aggregate decode rate of N concurrent greedy streams on the Qwen3.5
shape (random weights), mlxrunner's scheduler against mlx-lm's BatchGenerator on the same
weights.

For each N (``--streams``, default 1 4 16 32) both engines get N distinct random prompts of
``--prompt`` tokens and generate ``--new`` tokens for each, greedily. The aggregate decode
rate counts the tokens of the steps that only decoded (no prompt was being prefilled in
them: every stream is then running) over those steps' time; ``wall_tok_s`` is all generated
tokens over the whole run, prefill included. ``solo`` is ``mlxrunner.generate`` alone on
one prompt (the pipelined single-sequence loop), the reference of the "N streams against
one" ratio. A warm-up run per N first (traces, allocations); the best of ``--repeats``
runs is kept.

    python bench/batch.py --tiny                       # CPU: 4 layers, small vocabulary
    python bench/batch.py --json out.json              # GPU: the 0.8B shape, bfloat16
    python bench/batch.py --pair demo-qwen3.5          # a shipped pair: drafts in the batch

``--pair NAME`` loads a model with the draft it ships (a registered name or a folder) and
measures the same streams decoding with their drafts in the batch against without (Python
source prompts, which the demo pair's draft was trained on: its acceptance is the pair's).

On this CPU the figures say little: MLX's Linux CPU wheel links reference BLAS, whose
matrix products cost about linearly in their rows, so batching saves little there.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import harness
import mlx.core as mx
from harness import DTYPES
from qwen3_5 import DEFAULT_CONFIG, build_mlx_lm, build_ours, shrink

import mlxrunner
from mlxrunner import SamplerOptions
from mlxrunner.batch import BatchRequest, Scheduler

GREEDY = SamplerOptions(temperature=0)


def prompts_for(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    key = mx.random.key(seed)
    return mx.random.randint(0, vocab, (n, length), key=key).tolist()


def run_ours(model: Any, prompts: list[list[int]], new: int,
             draft: Any = None) -> dict[str, Any]:
    scheduler = Scheduler(model, max_sequences=len(prompts))
    requests = [scheduler.submit(BatchRequest(prompt, GREEDY, new, draft=draft))
                for prompt in prompts]
    decode_tokens, decode_s = 0, 0.0
    mx.synchronize()
    start = time.perf_counter()
    more = True
    while more:
        decoding_only = not (scheduler.waiting or scheduler.prefilling)
        before = sum(len(r.tokens) for r in requests)
        t0 = time.perf_counter()
        more = scheduler.step()
        if decoding_only:
            decode_s += time.perf_counter() - t0
            decode_tokens += sum(len(r.tokens) for r in requests) - before
    wall_s = time.perf_counter() - start
    total = len(prompts) * new
    result: dict[str, Any] = {"decode_tok_s": decode_tokens / decode_s if decode_s else 0.0,
                              "decode_tokens": decode_tokens, "wall_s": wall_s,
                              "wall_tok_s": total / wall_s}
    if draft is not None:  # how the rounds went: steps per depth, tokens per target forward
        result["round_depths"] = dict(sorted(scheduler.round_depths.items()))
        forwards = sum(r.stats.target_forwards for r in requests)
        result["tokens_per_forward"] = sum(len(r.tokens) for r in requests) / max(forwards, 1)
    return result


def run_mlx_lm(model: Any, prompts: list[list[int]], new: int) -> dict[str, float]:
    from mlx_lm.generate import BatchGenerator

    n = len(prompts)
    generator = BatchGenerator(model, max_tokens=new, completion_batch_size=n,
                               prefill_batch_size=min(n, 8))
    generator.insert(prompts, [new] * n)
    decode_tokens, decode_s, total = 0, 0.0, 0
    mx.synchronize()
    start = time.perf_counter()
    while True:
        t0 = time.perf_counter()
        prompt_responses, generated = generator.next()
        elapsed = time.perf_counter() - t0
        total += len(generated)
        if not prompt_responses and not generated:
            break
        if not prompt_responses and len(generated) == n:
            decode_s += elapsed
            decode_tokens += len(generated)
    wall_s = time.perf_counter() - start
    generator.close()
    return {"decode_tok_s": decode_tokens / decode_s if decode_s else 0.0,
            "decode_tokens": decode_tokens, "wall_s": wall_s, "wall_tok_s": total / wall_s}


def run_solo(model: Any, prompt: list[int], new: int, draft: Any = None) -> dict[str, float]:
    result = mlxrunner.generate(model, prompt, options=GREEDY, max_tokens=new, draft=draft)
    return {"decode_tok_s": result.stats.tokens_per_second}


def best_of(fn: Any, repeats: int) -> dict[str, float]:
    fn()  # warm-up: traces for every row count the batch grows through, allocations
    best: dict[str, float] | None = None
    runs = []
    for _ in range(repeats):
        result = fn()
        gc.collect()
        runs.append(result["decode_tok_s"])
        if best is None or result["decode_tok_s"] > best["decode_tok_s"]:
            best = result
    assert best is not None
    return dict(best, decode_runs=runs)


def interleaved(runs: dict[str, Any], repeats: int) -> dict[str, list[dict[str, Any]]]:
    """Each of ``runs`` (name: a function) ``repeats`` times, taking turns within each
    repeat (after one warm-up each), so that a ratio of two is measured under the same
    conditions repeat by repeat."""
    for fn in runs.values():
        fn()
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, fn in runs.items():
            results[name].append(fn())
            gc.collect()
    return results


def median_run(results: list[dict[str, Any]]) -> dict[str, Any]:
    """The run of median decode rate, with every run's rate."""
    ordered = sorted(results, key=lambda r: r["decode_tok_s"])
    return dict(ordered[len(ordered) // 2], decode_runs=[r["decode_tok_s"] for r in results])


SOURCE_STARTS = ["def fibonacci(n):", "class Stack:", "import os\n\ndef walk(path):",
                 "def quicksort(items):", "def read_config(path):", "class LinkedList:",
                 "def parse_args():", "def merge(a, b):"]


def main_pair(args: argparse.Namespace) -> int:
    """Streams with their drafts in the batch against the same streams without."""
    try:
        bundle = mlxrunner.load(args.pair)
    except mlxrunner.MLXRunnerError as exc:
        print(f"batch bench: {exc}", file=sys.stderr)
        return 2
    if bundle.draft is None:
        print(f"batch bench: {args.pair} ships no draft (--pair needs a pair)", file=sys.stderr)
        return 2
    model, draft = bundle.model, bundle.draft
    streams = args.streams or [1, 4, 16, 32]
    new = args.new or 128
    print(f"Batch bench, drafts in the batch: {args.pair} ({type(model).__name__}, "
          f"{type(draft).__name__}), {new} new per stream, device {mx.default_device()}",
          flush=True)
    rows = []
    for n in streams:
        prompts = [bundle.tokenizer.encode(SOURCE_STARTS[i % len(SOURCE_STARTS)])
                   for i in range(n)]
        runs = interleaved({"plain": lambda p=prompts: run_ours(model, p, new),
                            "drafts": lambda p=prompts: run_ours(model, p, new, draft)},
                           args.repeats)
        spread = harness.ratio_spread([r["decode_tok_s"] for r in runs["drafts"]],
                                      [r["decode_tok_s"] for r in runs["plain"]])
        row = {"streams": n, "plain": median_run(runs["plain"]),
               "drafts": median_run(runs["drafts"]), "drafts / plain": spread}
        rows.append(row)
        plain, drafted = row["plain"]["decode_tok_s"], row["drafts"]["decode_tok_s"]
        print(f"  {n:3d} streams: without drafts {plain:9.1f} tok/s, with drafts "
              f"{drafted:9.1f} tok/s: median {spread['median']:.2f}x (range "
              f"{spread['min']:.2f}-{spread['max']:.2f}, {spread['n']} repeats); steps per depth "
              f"{row['drafts']['round_depths']}, {row['drafts']['tokens_per_forward']:.2f} "
              f"tokens a forward", flush=True)
    # one stream through generate, with its draft against without (the speculative path a
    # CLI run takes)
    prompt = bundle.tokenizer.encode(SOURCE_STARTS[0])
    runs = interleaved({"plain": lambda: run_solo(model, prompt, new),
                        "drafts": lambda: run_solo(model, prompt, new, draft)}, args.repeats)
    spread = harness.ratio_spread([r["decode_tok_s"] for r in runs["drafts"]],
                                  [r["decode_tok_s"] for r in runs["plain"]])
    alone = {"plain": median_run(runs["plain"]), "drafts": median_run(runs["drafts"]),
             "drafts / plain": spread}
    print(f"  generate alone: without the draft {alone['plain']['decode_tok_s']:9.1f} tok/s, "
          f"with it {alone['drafts']['decode_tok_s']:9.1f} tok/s: median "
          f"{spread['median']:.2f}x (range {spread['min']:.2f}-{spread['max']:.2f}, "
          f"{spread['n']} repeats)", flush=True)
    harness.write_json(args.json, {"bench": "batch-pair", "pair": args.pair, "new": new,
                                   "device": str(mx.default_device()), "mlx": mx.__version__,
                                   "rows": rows, "generate_alone": alone})
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--dtype", choices=sorted(DTYPES),
                        help="default bfloat16 (float32 with --tiny)")
    parser.add_argument("--streams", type=int, nargs="+", help="default 1 4 16 32 (--tiny: "
                        "1 4 8)")
    parser.add_argument("--prompt", type=int, help="prompt tokens per stream (default 128; "
                        "--tiny 16)")
    parser.add_argument("--new", type=int, help="tokens generated per stream (default 128; "
                        "--tiny 16)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="timed runs (best kept; --pair: taking turns, the median)")
    parser.add_argument("--layers", type=int, help="keep only the first N layers")
    parser.add_argument("--vocab", type=int, help="override the vocabulary size")
    parser.add_argument("--tiny", action="store_true",
                        help="a CPU-sized run: 4 layers, vocabulary 4096, float32, fewer tokens")
    parser.add_argument("--no-mlx-lm", action="store_true", help="skip mlx-lm's BatchGenerator")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pair", help="a model with the draft it ships (e.g. demo-qwen3.5): "
                        "streams with their drafts in the batch against without")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    if args.pair:
        return main_pair(args)
    if not args.config.exists():
        print(f"batch bench: config not found: {args.config}", file=sys.stderr)
        return 2
    if any(n < 1 for n in args.streams or [1]):
        print("batch bench: --streams must be positive", file=sys.stderr)
        return 2
    tiny = args.tiny
    streams = args.streams or ([1, 4, 8] if tiny else [1, 4, 16, 32])
    prompt_len = args.prompt or (16 if tiny else 128)
    new = args.new or (16 if tiny else 128)
    dtype = args.dtype or ("float32" if tiny else "bfloat16")
    config = shrink(json.loads(args.config.read_text()), args.layers or (4 if tiny else None),
                    args.vocab or (4096 if tiny else None))
    text = config.get("text_config", config)
    ours = build_ours(config, DTYPES[dtype], args.seed)
    reference = None
    if not args.no_mlx_lm:
        try:
            reference = build_mlx_lm(config, ours)
        except ImportError as exc:
            print(f"  mlx-lm not importable ({exc}): ours alone", flush=True)
    print(f"Batch bench: {args.config.name}, {text['num_hidden_layers']} layers, vocabulary "
          f"{text['vocab_size']}, {dtype}, prompt {prompt_len}, {new} new per stream, "
          f"device {mx.default_device()}", flush=True)
    vocab = text["vocab_size"]
    solo = best_of(lambda: run_solo(ours, prompts_for(1, prompt_len, vocab, args.seed)[0], new),
                   args.repeats)
    print(f"  solo generate: decode {solo['decode_tok_s']:9.1f} tok/s", flush=True)
    rows: list[dict[str, Any]] = []
    for n in streams:
        prompts = prompts_for(n, prompt_len, vocab, args.seed + n)
        row: dict[str, Any] = {"streams": n,
                               "ours": best_of(lambda p=prompts: run_ours(ours, p, new),
                                               args.repeats)}
        if reference is not None:
            row["mlx_lm"] = best_of(lambda p=prompts: run_mlx_lm(reference, p, new),
                                    args.repeats)
        rows.append(row)
        line = (f"  {n:3d} streams: ours {row['ours']['decode_tok_s']:9.1f} tok/s "
                f"({row['ours']['decode_tok_s'] / solo['decode_tok_s']:5.2f}x solo, wall "
                f"{row['ours']['wall_tok_s']:8.1f})")
        if "mlx_lm" in row:
            lm = row["mlx_lm"]["decode_tok_s"]
            line += (f"   mlx-lm {lm:9.1f} tok/s (wall {row['mlx_lm']['wall_tok_s']:8.1f})"
                     f"   ours/mlx-lm {row['ours']['decode_tok_s'] / lm:5.2f}x" if lm else "")
        print(line, flush=True)
    print()
    print(f"  {'streams':>7}  {'ours tok/s':>10}  {'x solo':>6}  {'mlx-lm tok/s':>12}  "
          f"{'ours/mlx-lm':>11}")
    for row in rows:
        ours_rate = row["ours"]["decode_tok_s"]
        lm_rate = row.get("mlx_lm", {}).get("decode_tok_s")
        print(f"  {row['streams']:7d}  {ours_rate:10.1f}  {ours_rate / solo['decode_tok_s']:6.2f}"
              f"  {lm_rate or 0:12.1f}  {(ours_rate / lm_rate) if lm_rate else 0:11.2f}")
    results = {
        "bench": "batch", "config": args.config.name, "layers": text["num_hidden_layers"],
        "vocab": vocab, "dtype": dtype, "prompt": prompt_len, "new": new,
        "device": str(mx.default_device()), "platform": platform.platform(),
        "mlx": mx.__version__, "mlx_settings": harness.mlx_settings(), "solo": solo,
        "rows": rows,
    }
    harness.write_json(args.json, results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
