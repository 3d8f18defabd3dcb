"""The default model on this machine's CPU: mlxrunner against llama.cpp on the same GGUF file.

Rows, each a median over ``--repeats`` rounds in which the tools take turns (one process
each, both loaded, greedy, the same token ids):

- ``decode``: tokens/s writing ``--max-tokens`` tokens after a short chat prompt (ours:
  ``mlxrunner.generate``'s decode rate; llama.cpp: ``Llama.eval`` of one token at a time
  after greedy sampling, as its generate loop does).
- ``prompt``: tokens/s reading a ``--prompt-tokens`` prompt from an empty cache.
- ``first token``: seconds from a chat turn "Hi" (rendered with the model's own template)
  to its first token in a process that has just loaded the model, as the conversation
  meets it (ours only; a fresh process per repeat).

llama.cpp comes from llama-cpp-python (an optional bench dependency: ``pip install
llama-cpp-python``; the rows are skipped without it), run with 1 thread and with every core
(``--llama-threads``). CPU figures on a shared machine move by 30%: compare the ratio
medians, whose range is printed beside them.

    python bench/default_model.py [--model default] [--repeats 5] [--json out.json]
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

import mlxrunner

PROMPT = "Write a short poem about the sea."
LONG_TEXT = ("The history of the sea is long, and sailors have told stories about it for as "
             "long as there have been ships. ")


def gguf_file(bundle: Any, model: str) -> Path:
    """The GGUF file the bundle was loaded from."""
    path = Path(bundle.path)
    if path.is_file():
        return path
    files = sorted(path.glob("*.gguf"))
    if not files:
        raise SystemExit(f"{model}: not a GGUF model ({path})")
    return files[0]


def ours_rates(bundle: Any, chat_ids: list[int], long_ids: list[int],
               max_tokens: int) -> tuple[float, float]:
    greedy = mlxrunner.SamplerOptions(temperature=0)
    decoded = mlxrunner.generate(bundle.model, chat_ids, options=greedy, max_tokens=max_tokens)
    read = mlxrunner.generate(bundle.model, long_ids, options=greedy, max_tokens=1)
    return decoded.stats.tokens_per_second, read.stats.prefill_tokens_per_second


def llama_rates(llm: Any, chat_ids: list[int], long_ids: list[int],
                max_tokens: int) -> tuple[float, float]:
    llm.reset()
    llm.eval(chat_ids)
    start = time.perf_counter()
    for _ in range(max_tokens):
        token = llm.sample(temp=0.0)
        llm.eval([token])
    decode = max_tokens / (time.perf_counter() - start)
    llm.reset()
    start = time.perf_counter()
    llm.eval(long_ids)
    prompt = len(long_ids) / (time.perf_counter() - start)
    return decode, prompt


FIRST_TOKEN = """
import sys, time, mlxrunner
bundle = mlxrunner.load(sys.argv[1])
start = time.perf_counter()
ids = bundle.tokenizer.encode(bundle.renderer.render([{"role": "user", "content": "Hi"}]))
seen = []
mlxrunner.generate(bundle.model, ids, options=mlxrunner.SamplerOptions(temperature=0),
                   max_tokens=1, on_token=lambda t: seen.append(time.perf_counter()))
print(seen[0] - start)
"""


def first_token_seconds(model: str) -> float:
    out = subprocess.run([sys.executable, "-c", FIRST_TOKEN, model], capture_output=True,
                         text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=320)
    ap.add_argument("--llama-threads", default=f"1,{os.cpu_count() or 1}",
                    help="comma-separated thread counts for llama.cpp")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)

    bundle = mlxrunner.load(args.model)
    tokenizer = bundle.tokenizer
    chat_ids = tokenizer.encode(bundle.renderer.render([{"role": "user", "content": PROMPT}]))
    long_ids = tokenizer.encode(LONG_TEXT * (1 + args.prompt_tokens // 20))[:args.prompt_tokens]
    # a warm-up: first-use checks, the host kernels' build
    ours_rates(bundle, chat_ids, long_ids[:32], 8)

    peers: dict[str, Any] = {}
    try:
        from llama_cpp import Llama
    except ImportError:
        print("llama-cpp-python is not installed: its rows are skipped "
              "(pip install llama-cpp-python)", file=sys.stderr)
    else:
        path = gguf_file(bundle, args.model)
        for threads in sorted({int(t) for t in args.llama_threads.split(",") if t.strip()}):
            llm = Llama(str(path), n_ctx=4096, n_threads=threads, n_threads_batch=threads,
                        verbose=False)
            llama_rates(llm, chat_ids, long_ids[:32], 8)
            peers[f"llama.cpp {threads} thread{'s' if threads > 1 else ''}"] = llm

    ours: dict[str, list[float]] = {"decode": [], "prompt": []}
    theirs: dict[str, dict[str, list[float]]] = {n: {"decode": [], "prompt": []} for n in peers}
    for _ in range(args.repeats):
        d, p = ours_rates(bundle, chat_ids, long_ids, args.max_tokens)
        ours["decode"].append(d)
        ours["prompt"].append(p)
        for name, llm in peers.items():
            d, p = llama_rates(llm, chat_ids, long_ids, args.max_tokens)
            theirs[name]["decode"].append(d)
            theirs[name]["prompt"].append(p)
    first = [first_token_seconds(args.model) for _ in range(args.repeats)]

    rows: list[dict[str, Any]] = []
    for what in ("decode", "prompt"):
        row: dict[str, Any] = {"row": what, "unit": "tokens/s", "ours": spread(ours[what])}
        for name in peers:
            ratios = [a / b for a, b in zip(ours[what], theirs[name][what])]
            row[name] = spread(theirs[name][what])
            row[f"ours / {name}"] = spread(ratios)
        rows.append(row)
    rows.append({"row": "first token of 'Hi'", "unit": "s", "ours": spread(first)})

    header = f"{'':22} {'ours':>16}" + "".join(f" {n:>22} {'ratio':>18}" for n in peers)
    print(header)
    for row in rows:
        o = row["ours"]
        line = f"{row['row'] + ' (' + row['unit'] + ')':22} {o['median']:8.2f} " \
               f"[{o['min']:.1f}-{o['max']:.1f}]"
        for name in peers:
            if name in row:
                t, r = row[name], row[f"ours / {name}"]
                line += f" {t['median']:12.1f} [{t['min']:.0f}-{t['max']:.0f}]" \
                        f" {r['median']:6.2f}x [{r['min']:.2f}-{r['max']:.2f}]"
        print(line)
    if args.json:
        result = {"bench": "default_model", "model": args.model,
                  "machine": {"platform": platform.platform(), "processor": platform.processor(),
                              "cpus": os.cpu_count()},
                  "repeats": args.repeats, "max_tokens": args.max_tokens,
                  "prompt_tokens": len(long_ids), "rows": rows}
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
