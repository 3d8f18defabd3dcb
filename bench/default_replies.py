"""The default model's replies to 20 varied chat prompts with its own defaults: does any reply
repeat a sentence three times or more, and does every reply cut at the token cap say so.

Each prompt goes through ``mlxrunner run default PROMPT`` (a fresh process, the model's
Modelfile defaults: greedy, repeat penalty 1.15 over the last 256 tokens; the 256-token
cap), as a user would type it.
A sentence is a run of text ending in ``.``, ``!``, ``?`` or a line end, compared after
trimming and lower-casing; one said three or more times counts as a loop. A reply that
reached the cap must be followed by the cap notice on stderr.

    python bench/default_replies.py [--model default] [--json out.json] [RUN OPTIONS...]

Options it does not know go to every ``mlxrunner run`` (e.g. ``--repeat-penalty 1.2``).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

PROMPTS = [
    "Hi",
    "What is the capital of France?",
    "Tell me about yourself.",
    "Write a short poem about the sea.",
    "How do I boil an egg?",
    "Explain photosynthesis to a child.",
    "What are three tips for better sleep?",
    "Give me a recipe for pancakes.",
    "Why is the sky blue?",
    "Write a haiku about autumn.",
    "What is 17 times 23?",
    "Summarize the plot of Romeo and Juliet.",
    "How can I learn Python quickly?",
    "What should I pack for a weekend hike?",
    "Translate 'good morning' into Spanish.",
    "Write a limerick about a cat.",
    "What is the difference between weather and climate?",
    "Suggest a name for a coffee shop.",
    "How do vaccines work?",
    "Tell me a fun fact about octopuses.",
]
CAP_NOTICE = "reached the"


def repeated_sentence(text: str) -> tuple[str, int] | None:
    """The most repeated sentence of ``text`` when said three or more times."""
    sentences = [s.strip().lower() for s in re.split(r"(?<=[.!?])\s+|\n+", text)]
    counts = Counter(s for s in sentences if len(s) > 8)
    if not counts:
        return None
    sentence, times = counts.most_common(1)[0]
    return (sentence, times) if times >= 3 else None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--prompts", type=Path, default=None,
                    help="a file of other prompts, one a line (default: the 20 above)")
    args, run_options = ap.parse_known_args(argv)
    prompts = PROMPTS if args.prompts is None else [
        line.strip() for line in args.prompts.read_text(encoding="utf-8").splitlines()
        if line.strip()]
    rows = []
    for prompt in prompts:
        run = subprocess.run([sys.executable, "-m", "mlxrunner.cli", "run", args.model, prompt,
                              *run_options],
                             capture_output=True, text=True, timeout=600)
        if run.returncode != 0:
            print(f"{prompt!r}: exit {run.returncode}: {run.stderr.strip()[-300:]}",
                  file=sys.stderr)
            return 1
        loop = repeated_sentence(run.stdout)
        capped = CAP_NOTICE in run.stderr
        rows.append({"prompt": prompt, "chars": len(run.stdout), "capped": capped,
                     "repeated": loop[0] if loop else None, "times": loop[1] if loop else 0})
        print(f"{prompt[:40]:42} {len(run.stdout):6d} chars  "
              f"{'capped (said so)' if capped else 'ended':16} "
              f"{'LOOP x' + str(loop[1]) if loop else ''}", flush=True)
    loops = sum(1 for r in rows if r["repeated"])
    capped = sum(1 for r in rows if r["capped"])
    print(f"{len(rows)} replies: {loops} repeat a sentence 3+ times; {capped} reached the cap, "
          "each saying so")
    if args.json:
        args.json.write_text(json.dumps({"bench": "default_replies", "model": args.model,
                                         "run_options": run_options,
                                         "rows": rows, "loops": loops, "capped": capped},
                                        indent=2) + "\n")
    return 0 if loops == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
