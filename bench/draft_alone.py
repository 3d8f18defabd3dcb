"""The demo pair (``demo-qwen3.5``) through ``mlxrunner.generate`` alone, greedy, 128
tokens: its rate with the draft and without, taking turns, medians of 5 after one warm-up
each, and the median with range of the per-repeat ratios. The argument labels the line
(e.g. which core ran it: ``PYTHONPATH=.gpu/before/core python bench/draft_alone.py before``).
"""

import statistics
import sys

import mlxrunner as m

bundle = m.load("demo-qwen3.5")
greedy = m.SamplerOptions(temperature=0)
prompt = bundle.tokenizer.encode("def fibonacci(n):")


def rate(draft: object) -> float:
    return m.generate(bundle.model, prompt, options=greedy, max_tokens=128,
                      draft=draft).stats.tokens_per_second


rate(None)
rate(bundle.draft)
runs: dict[str, list[float]] = {"plain": [], "draft": []}
for _ in range(5):
    runs["plain"].append(rate(None))
    runs["draft"].append(rate(bundle.draft))
ratios = [a / b for a, b in zip(runs["draft"], runs["plain"])]
print(sys.argv[1] if len(sys.argv) > 1 else "", {k: round(statistics.median(v))
                                                 for k, v in runs.items()},
      f"ratio median {statistics.median(ratios):.2f} range {min(ratios):.2f}-{max(ratios):.2f}",
      flush=True)
