"""``mlxrunner bench``: prefill and decode speed, plain and speculative, on the public API
(``mlxrunner.load`` and ``mlxrunner.generate``) alone."""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

import mlxrunner

from .arguments import count


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model")
    p.add_argument("--draft")
    p.add_argument("--no-draft", action="store_true")
    p.add_argument("--prompt", help="prompt text (default: random token ids)")
    p.add_argument("--prompt-tokens", type=count(1), default=512)
    p.add_argument("--max-tokens", type=count(1), default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=count(1), default=1,
                   help="timed runs per mode (best kept)")
    p.add_argument("--warmup", type=count(0), default=1)
    p.add_argument("--dtype")
    p.add_argument("--json", help="write the results here")


def run(args: argparse.Namespace) -> int:
    """Plain (and, with a draft, speculative) decoding of one prompt, the modes taking turns;
    prints a table, ``--json`` also writes it."""
    import mlx.core as mx

    bundle = mlxrunner.load(args.model, draft=args.draft, dtype=args.dtype,
                            use_draft=not args.no_draft)
    tok = bundle.tokenizer
    if args.prompt:
        prompt_ids = tok.encode(args.prompt, add_special_tokens=True)
    else:
        prompt_ids = mx.random.randint(0, bundle.model.vocab_size, (args.prompt_tokens,),
                                       key=mx.random.key(args.seed)).tolist()
    options = bundle.defaults.merged({"temperature": args.temperature, "seed": args.seed})
    modes = ("plain", "speculative") if bundle.draft is not None else ("plain",)
    # the modes take turns (plain, speculative, plain, ...), so that a machine that speeds
    # up or slows down during the run moves both alike
    runs: dict[str, list[Any]] = {mode: [] for mode in modes}
    for _ in range(args.warmup + args.repeats):
        for mode in modes:
            runs[mode].append(mlxrunner.generate(
                bundle.model, prompt_ids, options=options, max_tokens=args.max_tokens,
                eos_ids=frozenset(), draft=bundle.draft if mode == "speculative" else None))
    rows = []
    plain_tokens = None
    for mode in modes:
        timed = runs[mode][args.warmup:]
        # the best of the timed runs: the least disturbed by the rest of the machine
        result = max(timed, key=lambda r: r.stats.tokens_per_second)
        stats = result.stats.as_dict()
        if mode == "plain":
            plain_tokens = result.tokens
        else:
            stats["identical_to_plain"] = all(r.tokens == plain_tokens for r in timed)
        rows.append({"mode": mode, **stats})
    if len(rows) == 2 and rows[0]["tokens_per_second"]:
        rows[1]["speedup"] = round(rows[1]["tokens_per_second"] / rows[0]["tokens_per_second"], 3)
        # each timed speculative run over the plain run just before it: the median
        pairs = [s.stats.tokens_per_second / p.stats.tokens_per_second
                 for p, s in zip(runs["plain"][args.warmup:], runs["speculative"][args.warmup:])]
        rows[1]["speedup_median"] = round(statistics.median(pairs), 3)
    report = {"model": str(bundle.path), "device": str(mx.default_device()),
              "prompt_tokens": len(prompt_ids), "max_tokens": args.max_tokens, "results": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    keys = ["mode", "tokens_per_second", "prefill_tokens_per_second", "tau", "acceptance_rate",
            "speedup", "speedup_median", "identical_to_plain"]
    print("  ".join(f"{k:>16}" for k in keys))
    for row in rows:
        print("  ".join(f"{str(row.get(k, '-')):>16}" for k in keys))
    return 0
