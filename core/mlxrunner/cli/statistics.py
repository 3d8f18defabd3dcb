"""The statistics ``run --stats``/``--compare``/``--verbose`` and the chat's ``/set verbose``
print, in words: each figure with its unit, and with ``explain`` what it means.

They read the ``as_dict()`` of plain or speculative stats (what ``--json`` prints), so the
words and the JSON never disagree.
"""

from __future__ import annotations

from typing import Any

#: below this many tokens a round the draft was the trouble, not the cost of a round
LOW_TAU = 1.5

MEANINGS = {
    "tokens/s": "tokens/s: for the prompt, tokens read per second (all of them in one "
                "pass; those cached from an earlier turn are not read again); for the "
                "reply, tokens written per second after that",
    "round": "round: the draft guesses the next few tokens, then the model checks all "
             "of them in a single forward pass and keeps the ones it agrees with",
    "accepted": "accepted: the share of guessed tokens the model agreed with",
    "tau": "tau: tokens kept per round on average, the model's own next token included; "
           "plain decoding keeps 1 per forward pass, so tau bounds the speedup",
    "forwards": "model forwards: full passes of the model (plain decoding makes one per "
                "token)",
    "speedup": "speedup: speculative tokens/s over plain tokens/s on the same prompt",
}


def _tokens(count: Any) -> str:
    return f"{count} token" if count == 1 else f"{count} tokens"


def _rate(value: Any) -> str:
    return f"{float(value or 0.0):.1f} tokens/s"


def describe_run(stats: dict[str, Any], *, explain: bool = False) -> list[str]:
    """Lines on one generation: the prompt, the reply and, when drafted, its rounds."""
    speculative = stats.get("mode") == "speculative"
    how = f"speculative, draft {stats['draft']}" if speculative and stats.get("draft") else \
        ("speculative" if speculative else "plain decoding")
    cached = int(stats.get("cached_tokens") or 0)
    rate = _rate(stats.get("prefill_tokens_per_second"))
    prompt = f"prompt: {_tokens(stats['prompt_tokens'])} read at {rate}" if not cached else \
        (f"prompt: {_tokens(stats['prompt_tokens'])} ({cached} prompt tokens cached, "
         f"{stats['prompt_tokens'] - cached} read at {rate})")
    lines = [prompt,
             f"reply: {_tokens(stats['generated_tokens'])} at "
             f"{_rate(stats.get('tokens_per_second'))} ({how})"]
    if speculative:
        lines.append(f"draft: {stats['rounds']} rounds; {stats['accepted']} of "
                     f"{stats['drafted']} guessed tokens accepted "
                     f"({100 * stats['acceptance_rate']:.1f}%); tau {stats['tau']:.2f} "
                     f"tokens per round; {stats['target_forwards']} model forwards for "
                     f"{stats['generated_tokens']} tokens")
    if explain:
        keys = ["tokens/s"] + (["round", "accepted", "tau", "forwards"] if speculative else [])
        lines += ["  " + MEANINGS[key] for key in keys]
    return lines


def describe_comparison(run: dict[str, Any], plain: dict[str, Any], speedup: float | None,
                        identical: bool, *, explain: bool = False) -> list[str]:
    """Lines on the plain decoding ``--compare`` adds: its rate, the speedup and, below 1,
    why."""
    lines = [f"plain decoding: {_tokens(plain['generated_tokens'])} at "
             f"{_rate(plain.get('tokens_per_second'))}",
             f"speedup {speedup if speedup is not None else '-'}x; identical output: "
             f"{'yes' if identical else 'no'}"]
    if explain:
        lines.append("  " + MEANINGS["speedup"])
    if speedup is not None and speedup < 1:
        lines.append("slower than plain decoding: " + slowdown_reason(run, plain))
    return lines


def slowdown_reason(run: dict[str, Any], plain: dict[str, Any]) -> str:
    """Why a speculative run was slower than plain decoding, from its figures: a round costs
    about ``cost`` plain steps and keeps ``tau`` tokens, so it gains where tau > cost."""
    tau = float(run.get("tau") or 0.0)
    rounds = int(run.get("rounds") or 0)
    plain_rate = float(plain.get("tokens_per_second") or 0.0)
    if not rounds or not plain_rate:
        return "the reply was too short for the draft to help"
    round_seconds = float(run.get("decode_seconds") or 0.0) / max(rounds, 1)
    cost = round_seconds * plain_rate
    if tau < LOW_TAU:
        return (f"the draft's acceptance was low: a round kept {tau:.2f} tokens on average, "
                f"while costing {cost:.1f} plain steps")
    return (f"a round took {1e3 * round_seconds:.2f} ms, {cost:.1f} times a plain step "
            f"({1e3 / plain_rate:.2f} ms), and kept {tau:.2f} tokens: on this machine "
            "guessing and checking costs more than it saves")
