"""Speculative decoding cost per depth on real target shapes, and the speedup it predicts.

For each target (Qwen3.5-0.8B and Gemma 4 E2B shapes from the shared configs, random
weights) and a random 5-layer DFlash2 draft (block 8), after a prefill of ``--context``
tokens this measures:

- plain decoding: seconds per token (one-token forward, sample, sync);
- per depth d = 1..7: the draft's proposal time, the verify forward over d + 1 tokens
  (snapshots scheduled, rollback after), and the real loop's round time (``generate``
  with the draft at a fixed depth, greedy; the random draft is rejected, so each round
  commits one token);
- the speedup predicted at per-position acceptance a = 0.5, 0.7, 0.9:
  ``E(d) / T(d) * T_plain`` with ``E(d) = sum_{k=0..d} a^k`` committed tokens per round.

Prints a table per target and writes JSON (``--json``, default
``bench/results/speculative-<device>.json``). Runs on whatever ``mx.default_device()`` is
(CPU here, CUDA or Metal unchanged). ``--quick`` shrinks the targets (same
architectures: 4 or 10 layers, hidden 256, vocabulary 4096) and the context for a CPU
smoke run.

    python bench/speculative.py --quick
    python bench/speculative.py --targets qwen3.5-0.8b gemma4-e2b --context 1024
    python bench/speculative.py --model default   # a shipped pair (here the demo's)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
import numpy as np

REPO = Path(__file__).resolve().parent.parent
ACCEPTANCE = (0.5, 0.7, 0.9)
TARGETS = {
    "qwen3.5-0.8b": "Qwen3.5-0.8B-Base.config.json",
    "gemma4-e2b": "gemma-4-E2B-it.text_config.transformers-5.24-serialized.json",
}


def shared_configs() -> Path:
    root = Path(os.environ.get("MLXRUNNER_SHARED_DATA", REPO.parent / "shared" / "data"))
    return root / "configs"


def quick_config(config: dict[str, Any]) -> dict[str, Any]:
    """A small model of the same architecture for a CPU smoke run: the first cycle(s) of the
    layer-type pattern, hidden 256, vocabulary 4096."""
    c = dict(config)
    types = list(c.get("layer_types") or [])
    c.update(hidden_size=256, intermediate_size=512, vocab_size=4096)
    if str(c.get("model_type", "")).startswith("gemma4"):
        keep = 10  # two (4 sliding + 1 full) cycles; the last 4 layers share K/V as in E2B
        c.update(num_kv_shared_layers=4, vocab_size_per_layer_input=4096,
                 hidden_size_per_layer_input=64, num_attention_heads=2, head_dim=64,
                 per_layer_config={f"{i:02d}": {"head_dim": 128}
                                   for i, t in enumerate(types[:keep]) if t == "full_attention"})
    else:
        keep = 4  # 3 Gated DeltaNet + 1 full attention
        c.update(num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                 linear_value_head_dim=32)
    c["num_hidden_layers"] = keep
    if types:
        c["layer_types"] = types[:keep]
    return c


def build_target(name: str, quick: bool, dtype: mx.Dtype):
    from mlxrunner import host as plugins
    from mlxrunner.model import text_config

    path = shared_configs() / TARGETS[name]
    if not path.exists():
        raise SystemExit(f"missing config {path} (set MLXRUNNER_SHARED_DATA)")
    config = text_config(json.loads(path.read_text()))
    if quick:
        config = quick_config(config)
    model = plugins.architecture_for(config)(config)
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    model.eval()
    return model, config


def draft_config(target, arch: str, layers: int = 5, block_size: int = 8) -> dict[str, Any]:
    n = target.num_layers
    taps = sorted({min(n - 1, round(1 + i * (n - 2) / 4)) for i in range(5)})
    hidden = target.hidden_size
    heads = max(1, hidden // 128)
    section: dict[str, Any] = {"block_size": block_size, "mask_token_id": target.vocab_size - 1,
                               "target_layer_ids": taps}
    if arch == "DFlash2DraftModel":
        section.update(conv_kernel_size=2, conv_group_size=16, selector_rank=256,
                       selector_top_k=16)
    return {
        "architectures": [arch], "hidden_size": hidden, "num_hidden_layers": layers,
        "num_attention_heads": heads, "num_key_value_heads": max(1, heads // 4),
        "head_dim": 128, "intermediate_size": 3 * hidden, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "vocab_size": target.vocab_size, "is_causal": False,
        "layer_types": ["sliding_attention"] * layers, "sliding_window": 2048,
        "dflash_config": section,
    }


def build_draft(target, arch: str, dtype: mx.Dtype):
    from mlxrunner import host as plugins
    from mlxrunner.model import build_draft as construct

    cls = plugins.lookup("drafts", arch).obj
    draft = construct(cls, draft_config(target, arch), target)
    draft.set_dtype(dtype)
    mx.eval(draft.parameters())
    draft.eval()
    return draft


def _sync(*arrays: Any) -> None:
    mx.eval(*arrays)


def plain_seconds_per_token(model, prompt: list[int], tokens: int) -> float:
    from mlxrunner import SamplerOptions, generate

    generate(model, prompt, options=SamplerOptions(temperature=0), max_tokens=4)  # warm up
    result = generate(model, prompt, options=SamplerOptions(temperature=0),
                      max_tokens=tokens + 1)
    s = result.stats
    return s.decode_seconds / max(s.generated_tokens - 1, 1)


def component_costs(model, draft, prompt: list[int], depth: int, repeats: int
                    ) -> tuple[float, float]:
    """(draft proposal seconds, verify forward seconds) for one round at ``depth``."""
    from mlxrunner import SamplerOptions
    from mlxrunner.decode import prefill
    from mlxrunner.plugin import Sampler

    sampler = Sampler(SamplerOptions(temperature=0), model.vocab_size)
    caches = model.make_cache()
    live = [c for c in caches if c is not None]
    session = draft.new_session(sampler)
    session.extend_tokens(prompt)  # drafts that pair states with the next token (MTP) see ids
    _, tapped = prefill(model, prompt, caches, taps=list(draft.taps))
    session.prefill(tapped)
    pos, current = len(prompt), int(prompt[-1])
    draft_t, verify_t = [], []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        proposal = session.propose(current, pos, depth)
        _sync(proposal.tokens, proposal.probs)
        t1 = time.perf_counter()
        ids = mx.concatenate([mx.array([current], dtype=mx.int32), proposal.tokens])[None]
        for c in live:
            c.schedule_snapshots(range(pos + 1, pos + depth + 1))
        logits, tapped = model(ids, caches, taps=list(draft.taps))
        _sync(logits, tapped, *[s for c in live for s in c.state])
        t2 = time.perf_counter()
        for c in live:
            c.restore(pos + 1)
            c.discard_snapshots()
        session.extend_tokens([current])
        session.commit(tapped[:, :1])
        pos += 1
        if i:  # the first repeat warms up
            draft_t.append(t1 - t0)
            verify_t.append(t2 - t1)
    return float(np.median(draft_t)), float(np.median(verify_t))


def round_seconds(model, draft, prompt: list[int], depth: int, rounds: int) -> float:
    """Mean round time of the real loop at a fixed depth (greedy), after a few rounds of
    another generation over the same prompt (the first rounds at a depth trace its verify
    forward, which a generation does once; counted in, they dominate a short run)."""
    from mlxrunner import SamplerOptions, generate

    def run(count: int) -> float:
        # the random draft is rejected: each round commits one token, so about count rounds
        # at this depth (the first token is the prompt's; the last rounds draft what is left)
        stats = generate(model, prompt, options=SamplerOptions(temperature=0),
                         max_tokens=count + depth + 1, draft=draft,
                         draft_options={"depth": depth}).stats
        n = stats.depths.get(depth, 0)
        return stats.seconds_by_depth.get(depth, 0.0) / max(n, 1)

    run(min(rounds, 4))
    return run(rounds)


def expected_tokens(acceptance: float, depth: int) -> float:
    return sum(acceptance ** k for k in range(depth + 1))


def bench_target(name: str, args: argparse.Namespace, dtype: mx.Dtype) -> dict[str, Any]:
    model, _ = build_target(name, args.quick, dtype)
    return bench_pair(name, model, build_draft(model, args.draft, dtype), args.draft, args,
                      dtype)


def bench_model(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """A model as users run it (a registered name such as ``default`` or a folder), with the
    draft it ships, in the dtype its config declares (``--dtype`` overrides)."""
    import mlxrunner

    try:
        bundle = mlxrunner.load(name, dtype=args.dtype)
    except mlxrunner.MLXRunnerError as exc:  # a bad folder or name: one line, exit 1
        raise SystemExit(f"speculative bench: {exc}") from None
    if bundle.draft is None:
        raise SystemExit(f"{name}: no draft ships with this model (--model needs a pair)")
    return bench_pair(name, bundle.model, bundle.draft, type(bundle.draft).__name__, args,
                      getattr(bundle.model, "dtype", None))


def bench_pair(name: str, model: Any, draft: Any, draft_name: str, args: argparse.Namespace,
               dtype: mx.Dtype | None) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    prompt = rng.integers(0, model.vocab_size, args.context).tolist()
    t_plain = plain_seconds_per_token(model, prompt, args.plain_tokens)
    rows = []
    for depth in range(1, draft.max_depth + 1):
        t_draft, t_verify = component_costs(model, draft, prompt, depth, args.repeats)
        t_round = round_seconds(model, draft, prompt, depth, args.rounds)
        speedups = {f"{a}": round(expected_tokens(a, depth) * t_plain / t_round, 3)
                    for a in ACCEPTANCE}
        rows.append({"depth": depth, "round_ms": round(1e3 * t_round, 3),
                     "rounds_per_second": round(1.0 / t_round, 2),
                     "draft_ms": round(1e3 * t_draft, 3), "verify_ms": round(1e3 * t_verify, 3),
                     "verify_over_plain": round(t_verify / t_plain, 3),
                     "predicted_speedup": speedups})
    best = {f"{a}": max(rows, key=lambda r: r["predicted_speedup"][f"{a}"])["depth"]
            for a in ACCEPTANCE}
    return {
        "target": name, "architecture": type(model).__name__, "layers": model.num_layers,
        "hidden": model.hidden_size, "vocab": model.vocab_size,
        "draft": draft_name, "draft_layers": len(draft.layers), "block_size": draft.block_size,
        "taps": list(draft.taps), "context": args.context, "dtype": str(dtype).split(".")[-1],
        "plain_ms_per_token": round(1e3 * t_plain, 3),
        "plain_tokens_per_second": round(1.0 / t_plain, 2),
        "depths": rows, "best_depth_by_acceptance": best,
    }


def print_table(result: dict[str, Any]) -> None:
    print(f"\n{result['target']} ({result['architecture']}, {result['layers']} layers, "
          f"hidden {result['hidden']}, vocab {result['vocab']}, {result['dtype']}), "
          f"{result['draft']} x{result['draft_layers']} block {result['block_size']}, "
          f"context {result['context']}: plain {result['plain_ms_per_token']} ms/token "
          f"({result['plain_tokens_per_second']} tok/s)")
    head = ["depth", "round ms", "rounds/s", "draft ms", "verify ms", "verify/plain"]
    head += [f"x@{a}" for a in ACCEPTANCE]
    print("  " + " ".join(f"{h:>12}" for h in head))
    for r in result["depths"]:
        cells = [r["depth"], r["round_ms"], r["rounds_per_second"], r["draft_ms"],
                 r["verify_ms"], r["verify_over_plain"]]
        cells += [r["predicted_speedup"][f"{a}"] for a in ACCEPTANCE]
        print("  " + " ".join(f"{c:>12}" for c in cells))
    print("  best depth by acceptance: " + ", ".join(
        f"{a}: {d}" for a, d in result["best_depth_by_acceptance"].items()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--targets", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    p.add_argument("--model", help="instead of the targets: a model as users run it, with "
                                   "the draft it ships (e.g. default, the demo pair)")
    p.add_argument("--draft", default="DFlash2DraftModel",
                   choices=["DFlash2DraftModel", "DFlashDraftModel"])
    p.add_argument("--context", type=int, default=None, help="prompt tokens before the rounds")
    p.add_argument("--repeats", type=int, default=None, help="component timings per depth")
    p.add_argument("--rounds", type=int, default=None, help="loop rounds per depth")
    p.add_argument("--plain-tokens", type=int, default=None)
    p.add_argument("--dtype", default=None, help="float32 / bfloat16 / float16")
    p.add_argument("--quick", action="store_true", help="small shapes for a CPU smoke run")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    defaults = {"context": 32 if args.quick else 1024, "repeats": 2 if args.quick else 20,
                "rounds": 3 if args.quick else 32, "plain_tokens": 6 if args.quick else 64}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    device = mx.default_device()
    on_cpu = device == mx.cpu
    dtype_name = args.dtype or ("float32" if on_cpu else "bfloat16")
    dtype = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}[dtype_name]
    results = []
    if args.model:
        result = bench_model(args.model, args)
        print_table(result)
        results.append(result)
    for name in [] if args.model else args.targets:
        try:
            result = bench_target(name, args, dtype)
        except Exception as exc:  # a missing plugin skips that target, the others still run
            print(f"{name}: skipped ({type(exc).__name__}: {exc})", file=sys.stderr)
            continue
        print_table(result)
        results.append(result)
    out = {"device": str(device), "platform": platform.platform(), "mlx": mx.__version__,
           "quick": args.quick, "acceptance": list(ACCEPTANCE), "results": results}
    path = args.json or REPO / "bench" / "results" / (
        f"speculative-{'cpu' if on_cpu else 'gpu'}{'-quick' if args.quick else ''}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=2))
    print(f"\nwrote {path}")
    return 0 if results else 1


if __name__ == "__main__":
    sys.exit(main())
