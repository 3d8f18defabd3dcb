"""A soak of ``serve``: mixed requests from several clients for a while, the server's resident
memory sampled throughout.

    python bench/serve_soak.py [MODEL] [--minutes 30] [--clients 4] [--json F]

MODEL defaults to ``default``. The server runs as users run it (``mlxrunner serve MODEL``, a
process of its own, its prefix cache at its default budget, which ``--verbose`` states). Each
client loops over a random mix: OpenAI chat (whole and streamed, a fifth of the streams left
after their first piece), completions with stop strings, Ollama chat, Anthropic messages, a
JSON-object format, a long prompt (about 1,500 tokens) now and then, and bad requests
(malformed JSON, a negative ``max_tokens``, an unknown model) that must get a 4xx. Prompts
draw from a small set with random tails, so the prefix cache both hits and evicts.

Reported: requests per kind and status (no 5xx allowed), the resident size (VmRSS) after the
warm-up, its largest and its last value, and the budget: the warm size plus what ``serve
--verbose`` states for the prefix cache and the batch's caches plus ``--allowance`` MiB for
the allocator and a step's transient arrays. The run passes
when no reply was a 5xx, the server is alive at the end and its largest resident size stayed
within the budget.

    python bench/serve_soak.py demo-qwen3.5 --bursts --requests 2000 --json F   # a GPU

``--bursts``: the batch's shapes instead of its memory. Requests come in bursts of a random
size (1 to ``--max-burst``, 32), all at once, the next burst when the last has ended; prompts
of random length (a few tokens to 250 sentences, 3,700 tokens of the demo model), half of
the chat requests asking for logprobs (which decode without the model's draft: drafts on
and off in one batch). Reported besides: the traced step shapes the server holds at the end
(``/api/ps``'s ``traced_shapes``, bounded as docs/batching.md says). Passes when no reply
was a 5xx and the server is alive.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import httpx

TOPICS = ["the sea", "a cat", "Paris", "sleep", "pancakes", "the moon", "Python", "trees"]
ASKS = ["Tell me about {}.", "Write two sentences about {}.", "What is special about {}?",
        "Give me three facts about {}."]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rss_mib(pid: int) -> float:
    text = Path(f"/proc/{pid}/status").read_text()
    found = re.search(r"VmRSS:\s+(\d+) kB", text)
    return int(found.group(1)) / 1024 if found else 0.0


def prompt(rng: random.Random, notes: int = 0) -> str:
    """An ask with ``notes`` sentences before it (about ten tokens each)."""
    text = rng.choice(ASKS).format(rng.choice(TOPICS))
    if notes:
        text = " ".join(f"Note {i}: {rng.choice(TOPICS)} is worth a thought." for i in
                        range(notes)) + " " + text
    return text + ("" if rng.random() < 0.5 else f" ({rng.randint(0, 999)})")


def one_request(client: httpx.Client, rng: random.Random, model: str, shapes: bool = False
                ) -> tuple[str, int]:
    """One random request: (kind, status); a stream left early counts as its status.
    ``shapes``: prompts of any length up to 250 sentences, and half of the chat requests
    asking for logprobs (no draft)."""
    kind = rng.choices(["chat", "stream", "completion", "ollama", "anthropic", "json", "long",
                        "bad"], weights=[4, 4, 2, 2, 2, 1, 1, 1])[0]
    if shapes:
        notes = rng.choice([0, rng.randint(1, 30), rng.randint(30, 250)])
    else:
        notes = 150 if kind == "long" else 0
    chat = [{"role": "user", "content": prompt(rng, notes)}]
    tokens = rng.randint(8, 48) if not shapes else rng.randint(1, 96)
    if kind in ("chat", "long", "json"):
        body: dict[str, Any] = {"model": model, "messages": chat, "max_tokens": tokens}
        if kind == "json":
            body["response_format"] = {"type": "json_object"}
        if shapes and rng.random() < 0.5:
            kind, body["logprobs"] = kind + "+logprobs", True
        return kind, client.post("/v1/chat/completions", json=body).status_code
    if kind == "stream":
        leave = rng.random() < 0.2
        with client.stream("POST", "/v1/chat/completions", json={
                "model": model, "messages": chat, "max_tokens": tokens, "stream": True}) as r:
            for _ in r.iter_lines():
                if leave:
                    break
            return kind, r.status_code
    if kind == "completion":
        return kind, client.post("/v1/completions", json={
            "model": model, "prompt": chat[0]["content"], "max_tokens": tokens,
            "stop": ["\n\n"]}).status_code
    if kind == "ollama":
        return kind, client.post("/api/chat", json={
            "model": model, "messages": chat, "stream": rng.random() < 0.5,
            "options": {"num_predict": tokens}}).status_code
    if kind == "anthropic":
        return kind, client.post("/v1/messages", json={
            "model": model, "messages": chat, "max_tokens": tokens}).status_code
    bad = rng.choice([
        lambda: client.post("/v1/chat/completions", content=b"{not json",
                            headers={"content-type": "application/json"}),
        lambda: client.post("/v1/chat/completions", json={
            "model": model, "messages": chat, "max_tokens": -1}),
        lambda: client.post("/v1/chat/completions", json={
            "model": "no-such-model", "messages": chat})])
    return "bad", bad().status_code


def device() -> str:
    """The GPU's name where nvidia-smi answers, else the CPU's."""
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10,
                              check=True).stdout.strip().splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return platform.processor() or platform.machine()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", nargs="?", default="default")
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--allowance", type=float, default=256.0,
                        help="MiB over the warm size and the stated cache budgets for the "
                             "allocator and a step's transient arrays (default 256)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--bursts", action="store_true",
                        help="bursts of random size instead of --clients (see the module)")
    parser.add_argument("--max-burst", type=int, default=32)
    parser.add_argument("--requests", type=int,
                        help="stop after this many requests (default: --minutes decides)")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "mlxrunner.cli", "serve", args.model,
                               "--port", str(port), "--verbose"],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(server.stdout or []), daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while True:
        try:
            if httpx.get(url + "/api/tags", timeout=5).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if server.poll() is not None or time.monotonic() > deadline:
            print("soak: the server did not start:\n" + "".join(lines), file=sys.stderr)
            return 1
        time.sleep(0.5)
    stated = next((re.search(r"prefix cache up to (\d+) MiB", line) for line in lines
                   if "prefix cache up to" in line), None)
    prefix_mib = float(stated.group(1)) if stated else 0.0
    stated = next((re.search(r"batch caches up to (\d+) MiB", line) for line in lines
                   if "batch caches up to" in line), None)
    batch_mib = float(stated.group(1)) if stated else 0.0
    warm = random.Random(args.seed)
    with httpx.Client(base_url=url, timeout=600) as client:  # traces, first allocations
        for _ in range(6):
            one_request(client, warm, args.model)
    warm_mib = rss_mib(server.pid)
    budget = warm_mib + prefix_mib + batch_mib + args.allowance
    counts: Counter[tuple[str, int]] = Counter()
    samples: list[tuple[float, float]] = []
    stop = time.monotonic() + 60 * args.minutes
    failures: list[str] = []

    def done() -> bool:
        return time.monotonic() >= stop or (args.requests is not None
                                            and sum(counts.values()) >= args.requests)

    def client_loop(seed: int) -> None:
        rng = random.Random(seed)
        with httpx.Client(base_url=url, timeout=600) as client:
            while not done():
                try:
                    counts[one_request(client, rng, args.model, args.bursts)] += 1
                except httpx.HTTPError as exc:
                    failures.append(f"{type(exc).__name__}: {exc}")

    def burst_loop() -> None:
        rng = random.Random(args.seed + 1)
        while not done():
            size = rng.randint(1, args.max_burst)
            if args.requests is not None:
                size = min(size, args.requests - sum(counts.values()))
            burst = [threading.Thread(target=one_client, args=(rng.randrange(1 << 30),))
                     for _ in range(size)]
            for t in burst:
                t.start()
            for t in burst:
                t.join()
            bursts.append(size)

    def one_client(seed: int) -> None:
        with httpx.Client(base_url=url, timeout=600) as client:
            try:
                counts[one_request(client, random.Random(seed), args.model, True)] += 1
            except httpx.HTTPError as exc:
                failures.append(f"{type(exc).__name__}: {exc}")

    bursts: list[int] = []
    threads = [threading.Thread(target=burst_loop)] if args.bursts else [
        threading.Thread(target=client_loop, args=(args.seed + 1 + i,))
        for i in range(args.clients)]
    start = time.monotonic()
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        samples.append((time.monotonic() - start, rss_mib(server.pid)))
        time.sleep(5)
    minutes = (time.monotonic() - start) / 60
    shapes = None
    if server.poll() is None:
        try:
            loaded = httpx.get(url + "/api/ps", timeout=30).json()["models"]
            shapes = max((m.get("traced_shapes", 0) for m in loaded), default=None)
        except (httpx.HTTPError, ValueError, KeyError):
            pass
    alive = server.poll() is None
    last_mib = rss_mib(server.pid) if alive else 0.0
    server.terminate()
    server.wait(30)
    largest = max(m for _, m in samples)
    errors = sum(n for (kind, status), n in counts.items() if status >= 500)
    unexpected = sum(n for (kind, status), n in counts.items()
                     if (kind == "bad") != (400 <= status < 500))
    half = [m for t, m in samples if t >= samples[-1][0] / 2]
    result = {"bench": "serve-soak", "model": args.model, "minutes": round(minutes, 2),
              "clients": "bursts" if args.bursts else args.clients, "bursts": bursts,
              "traced_shapes": shapes, "device": device(), "requests": sum(counts.values()),
              "by_kind_and_status": {f"{k} {s}": n for (k, s), n in sorted(counts.items())},
              "client_errors": failures[:10], "server_alive": alive, "replies_5xx": errors,
              "unexpected_status": unexpected, "warm_rss_mib": round(warm_mib, 1),
              "largest_rss_mib": round(largest, 1), "last_rss_mib": round(last_mib, 1),
              "second_half_rss_mib": [round(min(half), 1), round(max(half), 1)],
              "prefix_cache_budget_mib": prefix_mib, "batch_budget_mib": batch_mib,
              "allowance_mib": args.allowance,
              "budget_mib": round(budget, 1), "samples": samples}
    ok = alive and errors == 0 and unexpected == 0 and not failures and (
        args.bursts or largest <= budget)
    who = (f"{len(bursts)} bursts of 1-{args.max_burst} (median {sorted(bursts)[len(bursts) // 2]})"
           if bursts else f"{args.clients} clients")
    print(f"soak of {args.model} on {result['device']}: {result['requests']} requests in "
          f"{minutes:.1f} min from {who}; 5xx {errors}, unexpected statuses {unexpected}, "
          f"client errors {len(failures)}; server alive: {alive}; traced step shapes held: "
          f"{shapes}")
    print(f"  resident: warm {warm_mib:.0f} MiB, largest {largest:.0f}, last {last_mib:.0f}, "
          f"second half {min(half):.0f}-{max(half):.0f}; budget {budget:.0f} (warm + prefix "
          f"cache {prefix_mib:.0f} + batch {batch_mib:.0f} + {args.allowance:.0f}): "
          f"{'within' if largest <= budget else 'NOT MET'}")
    for (kind, status), n in sorted(counts.items()):
        print(f"  {kind:10} {status}  {n}")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
