"""Qwen3.5 MTP head: round cost per depth and the speedup it predicts.

On the Qwen3.5-0.8B shape (the shared config, random weights, its MTP head random too) or a
real folder that carries ``mtp.*`` (``--model``), after a prefill of ``--context`` tokens:

- plain decoding: milliseconds per token (one-token forward, sample, sync);
- per depth d = 1..3: the head's proposal (d chained steps), the verify forward over d + 1
  tokens (the core's compiled step, as the loop runs it; snapshots scheduled, rollback
  after), and the real loop's round (after a few warm-up rounds)
  (``generate`` with the head at a fixed depth, greedy; a random head is rejected, so each round
  commits one token);
- the speedup predicted at per-position acceptance a = 0.6 and 0.8: expected tokens per
  round ``(1 - a^(d+1)) / (1 - a)`` over the round's cost relative to a plain step.

Runs on whatever ``mx.default_device()`` is; ``--quick`` shrinks the target (4 layers,
hidden 256, vocabulary 4096) and the context for a CPU smoke run. ``--json PATH`` also
writes the results.

    python bench/mtp.py --quick
    python bench/mtp.py --context 1024 --json bench/results/mtp-gpu.json
    python bench/mtp.py --model ~/models/Qwen3.5-0.8B
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import mlx.core as mx
import numpy as np

REPO = Path(__file__).resolve().parent.parent
ACCEPTANCE = (0.6, 0.8)
TARGET = "qwen3.5-0.8b"


def speculative_bench() -> ModuleType:
    """bench/speculative.py (its target builders and loop timings), loaded by path."""
    spec = importlib.util.spec_from_file_location("bench_speculative",
                                                  REPO / "bench" / "speculative.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def random_head(target: Any, config: dict[str, Any], dtype: mx.Dtype) -> Any:
    from mlxrunner import host as plugins
    from mlxrunner.model import build_draft

    cls = plugins.lookup("drafts", "Qwen3_5MTP").obj
    head = build_draft(cls, {**config, "mtp_num_hidden_layers": 1}, target)
    head.set_dtype(dtype)
    mx.eval(head.parameters())
    head.eval()
    return head


def moe_target_and_head(quick: bool, dtype: mx.Dtype) -> tuple[Any, dict[str, Any], Any]:
    """The 35B-A3B shape from bench/qwen3_5_moe.py (random 4-bit weights, routers 8-bit) and
    a random MTP head of the same layer kind, quantized alike."""
    import mlx.nn as nn

    spec = importlib.util.spec_from_file_location("bench_qwen3_5_moe",
                                                  REPO / "bench" / "qwen3_5_moe.py")
    assert spec is not None and spec.loader is not None
    moe = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(REPO / "bench"))  # its own imports (harness, qwen3_5)
    spec.loader.exec_module(moe)
    text = dict(moe.A3B_TEXT, **(moe.TINY_CHANGES if quick else {}))
    config = moe.composite(text)
    model = moe.build_ours(config, 4, 64, dtype, 0)
    model.eval()
    text_config = moe.text_config(config)
    head = random_head(model, text_config, dtype)
    nn.quantize(head, 64, 4, class_predicate=moe.quant_predicate(64, 4))
    for i, (_, module) in enumerate(head.named_modules()):
        if hasattr(module, "scales"):
            moe.fill_quantized(module, 0.02, mx.random.key(7_000_003 + i))
    mx.eval(head.parameters())
    return model, text_config, head


def expected_tokens(acceptance: float, depth: int) -> float:
    return (1 - acceptance ** (depth + 1)) / (1 - acceptance)


def component_costs(model: Any, head: Any, prompt: list[int], depth: int, repeats: int
                    ) -> tuple[float, float]:
    """(proposal seconds, verify forward seconds) of one round at ``depth`` (medians)."""
    from mlxrunner import SamplerOptions
    from mlxrunner.decode import forward, prefill
    from mlxrunner.plugin import Sampler

    sampler = Sampler(SamplerOptions(temperature=0), model.vocab_size)
    caches = model.make_cache()
    live = [c for c in caches if c is not None]
    session = head.new_session(sampler)
    session.extend_tokens(prompt)
    _, tapped = prefill(model, prompt, caches, taps=list(head.taps))
    session.prefill(tapped)
    pos, current = len(prompt), int(prompt[-1])
    session.extend_tokens([current])
    propose_t, verify_t = [], []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        proposal = session.propose(current, pos, depth)
        mx.eval(proposal.tokens, proposal.probs, *session.state)
        t1 = time.perf_counter()
        ids = mx.concatenate([mx.array([current], dtype=mx.int32), proposal.tokens])[None]
        for c in live:
            c.schedule_snapshots(range(pos + 1, pos + depth + 1))
        logits, tapped = forward(model, ids, caches, taps=list(head.taps))
        mx.eval(logits, tapped, *[s for c in live for s in c.state])
        t2 = time.perf_counter()
        for c in live:
            c.restore(pos + 1)
            c.discard_snapshots()
        current = int(mx.argmax(logits[0, 0]))  # the round's fix token
        session.extend_tokens([current])
        session.commit(tapped[:, :1])
        pos += 1
        if i:  # the first repeat warms up
            propose_t.append(t1 - t0)
            verify_t.append(t2 - t1)
    return float(np.median(propose_t)), float(np.median(verify_t))


def bench(name: str, model: Any, head: Any, args: argparse.Namespace,
          dtype: Any) -> dict[str, Any]:
    helpers = speculative_bench()
    prompt = np.random.default_rng(0).integers(0, model.vocab_size, args.context).tolist()
    t_plain = helpers.plain_seconds_per_token(model, prompt, args.plain_tokens)
    rows = []
    for depth in range(1, head.max_depth + 1):
        t_propose, t_verify = component_costs(model, head, prompt, depth, args.repeats)
        t_round = helpers.round_seconds(model, head, prompt, depth, args.rounds)
        relative = t_round / t_plain
        rows.append({
            "depth": depth, "round_ms": round(1e3 * t_round, 3),
            "propose_ms": round(1e3 * t_propose, 3), "verify_ms": round(1e3 * t_verify, 3),
            "round_over_plain": round(relative, 3),
            "predicted_speedup": {f"{a}": round(expected_tokens(a, depth) / relative, 3)
                                  for a in ACCEPTANCE},
        })
    best = {f"{a}": max(rows, key=lambda r: r["predicted_speedup"][f"{a}"])["depth"]
            for a in ACCEPTANCE}
    return {"target": name, "architecture": type(model).__name__, "layers": model.num_layers,
            "hidden": model.hidden_size, "vocab": model.vocab_size, "context": args.context,
            "dtype": str(dtype).split(".")[-1], "plain_ms_per_token": round(1e3 * t_plain, 3),
            "depths": rows, "best_depth_by_acceptance": best}


def print_table(result: dict[str, Any]) -> None:
    print(f"\n{result['target']} ({result['architecture']}, {result['layers']} layers, hidden "
          f"{result['hidden']}, vocab {result['vocab']}, {result['dtype']}), MTP head, context "
          f"{result['context']}: plain {result['plain_ms_per_token']} ms/token")
    head = ["depth", "round ms", "propose ms", "verify ms", "round/plain"]
    head += [f"x@{a}" for a in ACCEPTANCE]
    print("  " + " ".join(f"{h:>12}" for h in head))
    for r in result["depths"]:
        cells = [r["depth"], r["round_ms"], r["propose_ms"], r["verify_ms"],
                 r["round_over_plain"]]
        cells += [r["predicted_speedup"][f"{a}"] for a in ACCEPTANCE]
        print("  " + " ".join(f"{c:>12}" for c in cells))
    print("  best depth by acceptance: " + ", ".join(
        f"{a}: {d}" for a, d in result["best_depth_by_acceptance"].items()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", help="a folder whose weights carry the MTP head (mtp.*)")
    p.add_argument("--context", type=int, default=None, help="prompt tokens before the rounds")
    p.add_argument("--repeats", type=int, default=None, help="component timings per depth")
    p.add_argument("--rounds", type=int, default=None, help="loop rounds per depth")
    p.add_argument("--plain-tokens", type=int, default=None)
    p.add_argument("--dtype", default=None, help="float32 / bfloat16 / float16")
    p.add_argument("--quick", action="store_true", help="small shapes for a CPU smoke run")
    p.add_argument("--moe", action="store_true",
                   help="the Qwen3.5-35B-A3B shape (bench/qwen3_5_moe.py's config, 4-bit "
                        "target and head; with --quick its tiny form)")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args(argv)
    defaults = {"context": 32 if args.quick else 1024, "repeats": 2 if args.quick else 20,
                "rounds": 3 if args.quick else 32, "plain_tokens": 6 if args.quick else 64}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    device = mx.default_device()
    if args.model:
        import mlxrunner

        try:
            bundle = mlxrunner.load(args.model, dtype=args.dtype)
        except mlxrunner.MLXRunnerError as exc:
            raise SystemExit(f"mtp bench: {exc}") from None
        if type(bundle.draft).__name__ != "Qwen3_5MTP":
            raise SystemExit(f"mtp bench: {args.model} carries no MTP head (mtp.* tensors)")
        result = bench(args.model, bundle.model, bundle.draft, args, bundle.model.dtype)
    else:
        dtype_name = args.dtype or ("float32" if device == mx.cpu else "bfloat16")
        dtype = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}[
            dtype_name]
        if args.moe:
            model, config, head = moe_target_and_head(args.quick, dtype)
            name = "qwen3.5-35b-a3b 4-bit"
        else:
            model, config = speculative_bench().build_target(TARGET, args.quick, dtype)
            head = random_head(model, config, dtype)
            name = TARGET
        result = bench(name + (" (quick)" if args.quick else ""), model, head, args, dtype)
    print_table(result)
    if args.json:
        out = {"device": str(device), "platform": platform.platform(), "mlx": mx.__version__,
               "quick": args.quick, "acceptance": list(ACCEPTANCE), "result": result}
        args.json.parent.mkdir(parents=True, exist_ok=True)
        temporary = args.json.with_name(f".{args.json.name}.{os.getpid()}.tmp")
        temporary.write_text(json.dumps(out, indent=2))
        temporary.replace(args.json)
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
