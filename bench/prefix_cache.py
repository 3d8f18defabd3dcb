"""A chat's second turn with the prefix cache: its time to first token against the first turn's.

The first turn is a conversation of about ``--tokens`` prompt tokens (a system message and a
long user message, rendered by the model's renderer as the chat renders it); its reply is
kept as the assistant's message and a short second question follows, as in
``mlxrunner run MODEL``. Both turns go through one :class:`mlxrunner.cache.PrefixCache`, so
the second prefills only what is new; the second turn is also run cold (no prefix cache) for
reference, and its tokens compared with the cached run's (greedy: they must be the same).
Issue 20's goals: the second turn's time to first token at most 20% of the first's on a
CPU (2k tokens), at most 10% on a GPU (4k tokens).

    python bench/prefix_cache.py [MODEL] [--tokens 2048] [--reply 32] [--json F]
    python bench/prefix_cache.py --random-config CONFIG.json --tokens 4096   # GPU

MODEL defaults to ``default`` (the default model, when the store has it or can pull it);
where it cannot be loaded the embedded demo pair (``demo-qwen3.5``) runs, and the JSON says
which ran. The model's draft, if it has one, decodes (the speculative path's prefix cache).
``--random-config`` builds a Qwen3.5 of that config (e.g. the 0.8B's, from the shared
data) with random weights in bfloat16 instead, and the turns are token ids: random ones,
then the first turn's prompt and reply followed by ``--new`` more (what a renderer adds
for the next message), as a chat's second turn is.
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
from mlxrunner.cache import PrefixCache

GOALS = {"cpu": 0.20, "gpu": 0.10}
SYSTEM = "You are a careful assistant who answers questions about the records below."
QUESTION = "Which city has the most records, and what is its largest measurement?"
CITIES = ["Lyon", "Porto", "Turku", "Ghent", "Brno", "Cork", "Split", "Graz", "Bari", "Pecs"]
THINGS = ["river level", "rainfall", "wind speed", "air pressure", "snow depth", "humidity"]


def records(count: int, first: int = 0) -> str:
    """``count`` lines of made-up measurements (varied, so no two lines tokenize alike)."""
    return "\n".join(
        f"Record {i}: in {CITIES[(i * 7) % len(CITIES)]} the {THINGS[(i * 5) % len(THINGS)]} "
        f"was {(i * 37) % 1000 / 10:.1f} units on day {(i * 13) % 365 + 1}."
        for i in range(first, first + count))


def first_messages(bundle: Any, tokens: int, first: int = 0) -> list[dict[str, str]]:
    """A conversation whose rendered prompt holds about ``tokens`` tokens."""
    def length(count: int) -> int:
        return len(encode(bundle, messages(count)))

    def messages(count: int) -> list[dict[str, str]]:
        return [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"{records(count, first)}\n\n{QUESTION}"}]

    per_line = max(1.0, (length(40) - length(0)) / 40)
    count = max(1, int((tokens - length(0)) / per_line))
    while count > 1 and length(count) > tokens:
        count -= 1
    return messages(count)


def encode(bundle: Any, messages: list[dict[str, str]]) -> list[int]:
    prompt = bundle.renderer.render(messages, None, add_generation_prompt=True)
    return list(bundle.tokenizer.encode(prompt, add_special_tokens=False))


class RandomBundle:
    """A Qwen3.5 of ``config`` with random weights, no tokenizer: turns are token ids."""

    renderer = None
    draft = None

    def __init__(self, config_path: Path) -> None:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from qwen3_5 import build_ours

        self.path = config_path
        self.model = build_ours(json.loads(config_path.read_text()), mx.bfloat16, seed=0)

    def stop_token_ids(self) -> frozenset[int]:
        return frozenset()


def timed_turn(bundle: Any, ids: list[int], reply: int, cache: PrefixCache | None
               ) -> tuple[Any, float, float]:
    """(result, seconds to the first token, seconds in all)."""
    first: list[float] = []
    t0 = time.perf_counter()

    def on_token(token: int) -> None:
        if not first:
            first.append(time.perf_counter() - t0)

    result = mlxrunner.generate(bundle.model, ids, options=mlxrunner.SamplerOptions(
        temperature=0), max_tokens=reply, eos_ids=bundle.stop_token_ids(), draft=bundle.draft,
        on_token=on_token, prefix_cache=cache)
    return result, first[0], time.perf_counter() - t0


def random_ids(bundle: Any, count: int, seed: int) -> list[int]:
    return [int(t) for t in mx.random.randint(
        3, bundle.model.vocab_size, (count,), key=mx.random.key(seed)).tolist()]


def breakdown(bundle: Any, cache: PrefixCache, ids: list[int]) -> dict[str, float]:
    """Where a cached turn's time to first token goes, each part timed alone (medians of 3):
    the lookup (caches rebuilt and evaluated) and the prefill of what is new through them,
    each before the timed turn (which stores the whole prompt: a later lookup would hit it
    whole)."""
    from mlxrunner.decode import prefill

    def median(values: list[float]) -> float:
        return round(1e3 * sorted(values)[len(values) // 2], 2)

    lookup: list[float] = []
    fill: list[float] = []
    for _ in range(3):
        mx.synchronize()
        t0 = time.perf_counter()
        hit = cache.lookup(ids)
        mx.eval([s for c in hit.caches if c is not None for s in c.state])
        t1 = time.perf_counter()
        logits, _ = prefill(bundle.model, ids, hit.caches, start=hit.length)
        mx.eval(logits)
        t2 = time.perf_counter()
        lookup.append(t1 - t0)
        fill.append(t2 - t1)
    return {"lookup": median(lookup), "prefill_new": median(fill),
            "new_tokens": len(ids) - hit.length}


def load(name: str) -> tuple[Any, str]:
    try:
        return mlxrunner.load(name), name
    except mlxrunner.MLXRunnerError as exc:
        print(f"{name}: {exc}; running demo-qwen3.5 instead", file=sys.stderr)
        return mlxrunner.load("demo-qwen3.5"), "demo-qwen3.5"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="default")
    ap.add_argument("--tokens", type=int, default=2048, help="the first turn's prompt tokens")
    ap.add_argument("--reply", type=int, default=32, help="tokens each reply may have")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--random-config", type=Path, default=None,
                    help="a Qwen3.5 config.json: random weights, token-id turns")
    ap.add_argument("--new", type=int, default=24,
                    help="(--random-config) tokens the second turn adds after the reply")
    ap.add_argument("--rounds", type=int, default=None,
                    help="whole conversations run first, not counted (default: 1 on a GPU, "
                         "which compiles kernels for each new shape; 0 on a CPU)")
    args = ap.parse_args(argv)
    if args.random_config is not None:
        bundle, ran = RandomBundle(args.random_config), f"random {args.random_config.name}"
    else:
        bundle, ran = load(args.model)
        if bundle.renderer is None:
            print(f"{ran}: no chat format to chat with", file=sys.stderr)
            return 1
    device = "gpu" if mx.default_device() == mx.gpu else "cpu"
    chat = bundle.renderer is not None


    # warm-up: traces made once, outside the timed turns
    warm = encode(bundle, first_messages(bundle, 96, 90000)) if chat else \
        random_ids(bundle, 96, 1)
    timed_turn(bundle, warm, 4, None)
    timed_turn(bundle, warm, 4, PrefixCache(bundle.model.make_cache))
    rounds = args.rounds if args.rounds is not None else int(device == "gpu")
    ratios: list[float] = []
    for variant in range(rounds + 1):  # the last one counts
        cache = PrefixCache(bundle.model.make_cache)
        if chat:
            messages = first_messages(bundle, args.tokens, 5000 * variant)
            first_ids = encode(bundle, messages)
        else:
            first_ids = random_ids(bundle, args.tokens, 2 + 10 * variant)
        first, first_ttft, _ = timed_turn(bundle, first_ids, args.reply, cache)
        if chat:
            stops = bundle.stop_token_ids()
            answer = bundle.tokenizer.decode([t for t in first.tokens if t not in stops])
            messages += [{"role": "assistant", "content": answer},
                         {"role": "user", "content": "And which city has the fewest?"}]
            second_ids = encode(bundle, messages)
        else:
            second_ids = first_ids + first.tokens + random_ids(bundle, args.new, 3 + 10 * variant)
        if variant == rounds:  # before the timed turn, which stores the whole prompt
            parts = breakdown(bundle, cache, second_ids)
        second, second_ttft, _ = timed_turn(bundle, second_ids, args.reply, cache)
        cold, cold_ttft, _ = timed_turn(bundle, second_ids, args.reply, None)
        ratios.append(round(second_ttft / first_ttft, 4))
    ratio = second_ttft / first_ttft
    report = {
        "model": ran, "model_folder": bundle.path.name,
        "draft": type(bundle.draft).__name__ if bundle.draft else None,
        "device": device, "platform": platform.platform(), "mlx": mx.__version__,
        "first_turn": {"prompt_tokens": len(first_ids), "cached_tokens":
                       first.stats.cached_tokens, "ttft_s": round(first_ttft, 4)},
        "second_turn": {"prompt_tokens": len(second_ids),
                        "cached_tokens": second.stats.cached_tokens,
                        "ttft_s": round(second_ttft, 4)},
        "second_turn_cold": {"prompt_tokens": len(second_ids), "ttft_s": round(cold_ttft, 4)},
        "rounds_before": rounds,
        "second_over_first": round(ratio, 4),
        "second_over_first_each_round": ratios,
        "second_turn_parts_ms": parts,
        "second_over_second_cold": round(second_ttft / cold_ttft, 4), "goal": GOALS[device],
        "goal_met": ratio <= GOALS[device],
        "same_tokens_as_cold": second.tokens == cold.tokens,
        "prefix_cache_mib": round(cache.bytes / 2**20, 2),
    }
    print(f"prefix cache, {ran} on {device} (draft: {report['draft'] or 'none'})")
    print(f"  {'turn':18} {'prompt':>7} {'cached':>7} {'TTFT ms':>9}")
    print(f"  {'first':18} {len(first_ids):7d} {first.stats.cached_tokens:7d} "
          f"{1e3 * first_ttft:9.1f}")
    print(f"  {'second (cached)':18} {len(second_ids):7d} {second.stats.cached_tokens:7d} "
          f"{1e3 * second_ttft:9.1f}")
    print(f"  {'second (cold)':18} {len(second_ids):7d} {0:7d} {1e3 * cold_ttft:9.1f}")
    print(f"  second/first TTFT {ratio:.3f}, second/second cold "
          f"{report['second_over_second_cold']:.3f} (goal <= {GOALS[device]}: "
          f"{'met' if report['goal_met'] else 'not met'}); same tokens as cold: "
          f"{report['same_tokens_as_cold']}; cache holds {report['prefix_cache_mib']} MiB")
    print(f"  every round's second/first: {ratios}; the second turn's parts (ms, median of "
          f"3): " + ", ".join(f"{k} {v}" for k, v in parts.items()))
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
