"""16 concurrent clients of ``serve`` against the same 16 requests one at a time.

    python bench/serve_concurrency.py [MODEL] [--clients 16] [--tokens 32] [--repeats 3]
                                      [--json F]

MODEL defaults to ``default`` (the default model from the store). Two in-process servers on
loopback over one loaded model: one whose engine batches up to ``--clients`` requests and one
with ``max_batch=1`` (one at a time, as serve was). Each repeat sends the batched server
``--clients`` concurrent completions and the other the same requests one after another;
prompts differ per repeat (the prefix cache would otherwise hold them) and every request
decodes exactly ``--tokens`` tokens (greedy, EOS ignored through the token budget only where
the model does not stop first: the token counts are reported). Aggregate rate: completion
tokens of all requests / wall time from the first request to the last reply. The replies of
the two servers must be identical. Median over repeats.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

import mlxrunner
from mlxrunner.serve import Listener, Service, bind, create_app

TOPICS = ["a binary search", "a linked list", "quick sort", "a stack", "a queue",
          "merge sort", "a hash map", "a trie", "bubble sort", "a heap", "a graph search",
          "a matrix product", "string reversal", "prime numbers", "fibonacci numbers",
          "a binary tree"]


def bodies(clients: int, tokens: int, repeat: int) -> list[dict[str, Any]]:
    return [{"prompt": f"# {repeat}.{i}: Python code for {TOPICS[i % len(TOPICS)]}\ndef",
             "max_tokens": tokens, "temperature": 0} for i in range(clients)]


async def concurrent(url: str, requests: list[dict[str, Any]]) -> list[Any]:
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        async def one(body: dict[str, Any]) -> Any:
            return (await client.post("/v1/completions", json=body)).json()
        return list(await asyncio.gather(*(one(b) for b in requests)))


def sequential(url: str, requests: list[dict[str, Any]]) -> list[Any]:
    with httpx.Client(base_url=url, timeout=600) as client:
        return [client.post("/v1/completions", json=b).json() for b in requests]


def summary(replies: list[Any], seconds: float) -> dict[str, Any]:
    tokens = sum(r["usage"]["completion_tokens"] for r in replies)
    return {"seconds": round(seconds, 3), "tokens": tokens,
            "tokens_per_second": round(tokens / seconds, 2)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model", nargs="?", default="default")
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    bundle = mlxrunner.load(args.model)
    batched = Service(bundle, name="bench", max_batch=args.clients)
    alone = Service(bundle, name="bench", max_batch=1)
    servers = [Listener(create_app(s), bind("127.0.0.1", 0)).start() for s in (batched, alone)]
    try:
        # warm both engines' traces (each worker thread traces its own)
        warm = bodies(args.clients, args.tokens, -1)
        asyncio.run(concurrent(servers[0].url, warm))
        sequential(servers[1].url, warm[:2])
        rows = []
        for repeat in range(args.repeats):
            requests = bodies(args.clients, args.tokens, repeat)
            t0 = time.perf_counter()
            together = asyncio.run(concurrent(servers[0].url, requests))
            t1 = time.perf_counter()
            one_by_one = sequential(servers[1].url, requests)
            t2 = time.perf_counter()
            same = [r["choices"][0]["text"] for r in together] == \
                [r["choices"][0]["text"] for r in one_by_one]
            row = {"repeat": repeat, "concurrent": summary(together, t1 - t0),
                   "one_at_a_time": summary(one_by_one, t2 - t1), "same_replies": same}
            row["speedup"] = round(row["concurrent"]["tokens_per_second"] /
                                   row["one_at_a_time"]["tokens_per_second"], 3)
            rows.append(row)
    finally:
        for server in servers:
            server.stop()
    report = {"model": args.model, "clients": args.clients, "tokens": args.tokens,
              "machine": platform.machine(), "processor": platform.processor(),
              "draft": bundle.draft is not None, "repeats": rows,
              "median_speedup": statistics.median(r["speedup"] for r in rows),
              "all_same": all(r["same_replies"] for r in rows)}
    print(f"serve, {args.clients} clients x {args.tokens} tokens, {args.model}")
    print(f"  {'repeat':>6} {'concurrent tok/s':>17} {'one-at-a-time tok/s':>20} "
          f"{'speedup':>8} {'same':>5}")
    for r in rows:
        print(f"  {r['repeat']:6d} {r['concurrent']['tokens_per_second']:17.2f} "
              f"{r['one_at_a_time']['tokens_per_second']:20.2f} {r['speedup']:8.2f} "
              f"{str(r['same_replies']):>5}")
    print(f"  median speedup {report['median_speedup']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0 if report["all_same"] else 1


if __name__ == "__main__":
    sys.exit(main())
