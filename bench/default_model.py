"""The default model with its draft against plain decoding, on held-out chat prompts.

For each held-out prompt (``plugins/smollm2/recipe/prompts.py``, subjects the draft never
trained on), greedy: plain decoding, then speculative decoding with the pair's draft, both
on one warm model in this process. Reports per prompt and in total: tokens, tokens/s of
each, tau (tokens committed per target forward of a round), whether the outputs are
identical, and the speedup (speculative tokens/s over plain tokens/s, summed over prompts).

    python bench/default_model.py [MODEL] [--prompts 40] [--max-tokens 256] [--json F]

MODEL defaults to ``default``; the machine is named in the JSON (device, platform).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx

import mlxrunner

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "plugins" / "smollm2" / "recipe"))
from prompts import prompts  # noqa: E402


def run_one(bundle: Any, ids: list[int], max_tokens: int, draft: Any) -> tuple[Any, float]:
    greedy = mlxrunner.SamplerOptions(temperature=0)
    t0 = time.perf_counter()
    result = mlxrunner.generate(bundle.model, ids, options=greedy, max_tokens=max_tokens,
                                eos_ids=bundle.stop_token_ids(), draft=draft)
    return result, time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="default")
    ap.add_argument("--prompts", type=int, default=40)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=2, help="prompts run first, not counted")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    bundle = mlxrunner.load(args.model)
    if bundle.draft is None:
        print(f"{args.model}: has no draft", file=sys.stderr)
        return 1
    texts = prompts("heldout", args.prompts + args.warmup)
    rows = []
    print(f"{'prompt':52} {'tokens':>6} {'plain/s':>8} {'spec/s':>8} {'tau':>5} same",
          flush=True)
    for n, text in enumerate(texts):
        rendered = bundle.renderer.render([{"role": "user", "content": text}])
        ids = bundle.tokenizer.encode(rendered)
        plain, plain_s = run_one(bundle, ids, args.max_tokens, None)
        spec, spec_s = run_one(bundle, ids, args.max_tokens, bundle.draft)
        if n < args.warmup:
            continue
        stats = spec.stats
        rows.append({"prompt": text, "tokens": len(plain.tokens),
                     "plain_decode_s": plain.stats.decode_seconds,
                     "spec_decode_s": stats.decode_seconds,
                     "plain_total_s": plain_s, "spec_total_s": spec_s,
                     "rounds": stats.rounds, "committed_in_rounds": stats.committed_in_rounds,
                     "tau": stats.tau,
                     "identical": spec.tokens == plain.tokens})
        r = rows[-1]
        print(f"{r['prompt'][:52]:52} {r['tokens']:6d} "
              f"{r['tokens'] / max(r['plain_decode_s'], 1e-9):8.1f} "
              f"{r['tokens'] / max(r['spec_decode_s'], 1e-9):8.1f} {r['tau']:5.2f} "
              f"{'yes' if r['identical'] else 'NO'}", flush=True)
    tokens = sum(r["tokens"] for r in rows)
    plain_s = sum(r["plain_decode_s"] for r in rows)
    spec_s = sum(r["spec_decode_s"] for r in rows)
    rounds = sum(r["rounds"] for r in rows)
    committed = sum(r["committed_in_rounds"] for r in rows)
    summary = {
        "model": str(bundle.path), "draft": str(bundle.draft_path),
        "device": str(mx.default_device()), "platform": platform.platform(),
        "prompts": len(rows), "tokens": tokens,
        "plain_tokens_per_s": tokens / plain_s if plain_s else 0.0,
        "spec_tokens_per_s": tokens / spec_s if spec_s else 0.0,
        "speedup": plain_s / spec_s if spec_s else 0.0,
        "tau": committed / rounds if rounds else 0.0,
        "identical": all(r["identical"] for r in rows),
    }
    print(f"total: {tokens} tokens, plain {summary['plain_tokens_per_s']:.1f} tok/s, "
          f"speculative {summary['spec_tokens_per_s']:.1f} tok/s, speedup "
          f"{summary['speedup']:.2f}x, tau {summary['tau']:.2f}, identical "
          f"{summary['identical']} ({summary['device']})")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"summary": summary, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
