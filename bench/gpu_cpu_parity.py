"""float32 logits on the GPU against the CPU, per architecture at its bench shape.

The same random float32 weights run a prompt (prefill) and then one-token steps through
the core's compiled step on the default device (the GPU), and the same tokens eagerly on
the CPU; the table gives each side's largest logit difference, so a drift shows where it
starts (prefill or the steps) and how large it is. mlxrunner runs float32 with TF32 off
(``MLX_ENABLE_TF32=0``), so both sides compute in float32.

    python bench/gpu_cpu_parity.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import harness
import mlx.core as mx
from mlx.utils import tree_flatten, tree_unflatten

from mlxrunner.decode import forward


def build(name: str, layers: int | None) -> tuple[Any, Any]:
    """(model class's builder, config) for one bench architecture."""
    if name == "qwen3_5":
        import qwen3_5 as bench

        config = bench.shrink(json.loads(bench.DEFAULT_CONFIG.read_text()), layers, None)
        return (lambda: bench.build_ours(config, mx.float32, 0)), config
    if name == "gemma4":
        import gemma4 as bench

        config = bench.composite(bench.E2B_TEXT_CONFIG)
        if bench.DEFAULT_CONFIG.is_file():
            config = bench.composite(json.loads(bench.DEFAULT_CONFIG.read_text()))
        return (lambda: bench.build_ours(config, mx.float32, 0)), config
    import llama as bench
    from mlxrunner_example_architecture.model import ExampleLlama

    config = dict(bench.LLAMA_3_2_1B)

    def make() -> Any:
        model = ExampleLlama(config)
        model.update(tree_unflatten(list(bench.random_weights(model, mx.float32, 0).items())))
        return model

    return make, config


def logits_rows(model: Any, ids: mx.array, prefill: int, compiled: bool) -> list[mx.array]:
    cache = model.make_cache()
    rows = [model(ids[:, :prefill], cache)[0, -1]]
    for t in range(prefill, ids.shape[1]):
        step = ids[:, t:t + 1]
        out = forward(model, step, cache) if compiled else model(step, cache)
        rows.append(out[0, -1])
        mx.eval(rows[-1], [c.state for c in cache if c is not None])
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--names", nargs="*", default=["qwen3_5", "gemma4", "llama"])
    parser.add_argument("--prefill", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    results: dict[str, Any] = {}
    for name in args.names:
        make, _ = build(name, None)
        model = make()
        weights = dict(tree_flatten(model.parameters()))
        ids = mx.random.randint(0, model.vocab_size, (1, args.prefill + args.steps),
                                key=mx.random.key(1))
        gpu = logits_rows(model, ids, args.prefill, compiled=True)
        mx.eval(gpu)
        with mx.stream(mx.cpu):
            cpu_model = make()
            cpu_model.update(tree_unflatten([(k, mx.array(v)) for k, v in weights.items()]))
            cpu = logits_rows(cpu_model, ids, args.prefill, compiled=False)
            mx.eval(cpu)
        diffs = [float(mx.abs(a - b).max()) for a, b in zip(gpu, cpu)]
        scale = max(float(mx.abs(r).max()) for r in cpu)
        results[name] = {"prefill_max_abs": diffs[0], "steps_max_abs": max(diffs[1:]),
                         "per_row": diffs, "max_abs_logit": scale}
        print(f"  {name:8s} float32 GPU vs CPU: prefill {diffs[0]:.3g}, steps "
              f"{max(diffs[1:]):.3g} (largest logit {scale:.3g})", flush=True)
        del model, cpu_model, gpu, cpu
    harness.write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
