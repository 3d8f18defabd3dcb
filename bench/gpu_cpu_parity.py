"""float32 logits on the GPU against the CPU, per architecture at its bench shape.

The same random float32 weights run a prompt (prefill) and then one-token steps, on the
default device (the GPU) and eagerly on the CPU. Rows per architecture, each the largest
logit difference against our CPU run:

- ``compiled``: our prefill and the core's compiled steps on the GPU;
- ``eager``: the same without the compiled step;
- ``no kernels``: eager with the core's fused CUDA kernels off (MLX's own operations);
- ``mlx-lm``: mlx-lm's model on the same weights, GPU against CPU (prefill), and its CPU
  prefill against ours, so a drift shows which side (ours, MLX's GPU operations) has it;
- ``conditioning``: how far the CPU's logits move when one weight matrix changes by float32
  rounding's size: a model whose logits move by 1e-2 there cannot agree across devices to
  1e-4 whatever either computes.

mlxrunner runs float32 with TF32 off (``MLX_ENABLE_TF32=0``), so both sides compute in
float32.

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
from mlx.utils import tree_flatten

from mlxrunner import settings
from mlxrunner.decode import forward


def build(name: str) -> tuple[Any, Any]:
    """(our model, a builder of mlx-lm's on the same weights) for one bench architecture."""
    if name == "qwen3_5":
        import qwen3_5 as bench

        config = json.loads(bench.DEFAULT_CONFIG.read_text())
        ours = bench.build_ours(config, mx.float32, 0)
        return ours, lambda: bench.build_mlx_lm(config, ours)
    if name == "gemma4":
        import gemma4 as bench

        config = bench.composite(bench.E2B_TEXT_CONFIG)
        if bench.DEFAULT_CONFIG.is_file():
            config = bench.composite(json.loads(bench.DEFAULT_CONFIG.read_text()))
        ours = bench.build_ours(config, mx.float32, 0)
        # Gemma 4 attends at scale 1 over RMS-normed q and k: with unit norm weights (the
        # speed bench's) its scores have a std of ~16 (head dim 256), the softmax is nearly
        # hard, and a relative 1e-7 change of one weight moves the logits by ~2e-2, so no
        # two devices can agree to 1e-4. Norm weights of head_dim ** -0.25 give scores of std
        # ~1, as a trained checkpoint's are (10 layers on the CPU: the change 3.3e-4 -> 4.9e-6).
        ours.load_weights([(k, mx.full(v.shape, v.shape[-1] ** -0.25))
                           for k, v in tree_flatten(ours.parameters())
                           if k.endswith(("q_norm.weight", "k_norm.weight"))], strict=False)
        return ours, lambda: bench.build_mlx_lm(config, ours)
    import llama as bench
    from mlx.utils import tree_unflatten
    from mlxrunner_example_architecture.model import ExampleLlama

    config = dict(bench.LLAMA_3_2_1B)
    ours = ExampleLlama(config)
    weights = bench.random_weights(ours, mx.float32, 0)
    ours.update(tree_unflatten(list(weights.items())))
    return ours, lambda: bench.build_mlx_lm(config, weights)


def logits_rows(model: Any, ids: mx.array, prefill: int, compiled: bool) -> list[mx.array]:
    cache = model.make_cache()
    rows = [model(ids[:, :prefill], cache)[0, -1]]
    mx.eval(rows[-1])
    for t in range(prefill, ids.shape[1]):
        step = ids[:, t:t + 1]
        out = forward(model, step, cache) if compiled else model(step, cache)
        rows.append(out[0, -1])
        mx.eval(rows[-1], [c.state for c in cache if c is not None])
    return rows


def largest(a: list[mx.array], b: list[mx.array]) -> tuple[float, float]:
    """(prefill, steps) largest absolute differences."""
    diffs = [float(mx.abs(x - y).max()) for x, y in zip(a, b)]
    return diffs[0], max(diffs[1:], default=0.0)


def sensitivity(model: Any, prompt: mx.array, base: mx.array) -> float:
    """How far the CPU's last-position logits move when the first attention layer's query
    weights change by a relative 1e-7 (float32 rounding's size): the drift any other order
    of the same float32 sums (another device's kernels) can show."""
    name, weight = next((k, v) for k, v in tree_flatten(model.parameters())
                        if k.endswith("q_proj.weight"))
    noise = 1 + 1e-7 * mx.random.normal(weight.shape, key=mx.random.key(5))
    with mx.stream(mx.cpu):
        model.load_weights([(name, weight * noise)], strict=False)
        moved = model(prompt)[0, -1]
        change = float(mx.abs(moved - base).max())
    model.load_weights([(name, weight)], strict=False)
    return change


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--names", nargs="*", default=["qwen3_5", "gemma4", "llama"])
    parser.add_argument("--prefill", type=int, default=64)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--no-mlx-lm", action="store_true")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    results: dict[str, Any] = {"device": str(mx.default_device()), "mlx": mx.__version__}
    for name in args.names:
        print(f"== {name}", flush=True)
        model, build_reference = build(name)
        ids = mx.random.randint(0, model.vocab_size, (1, args.prefill + args.steps),
                                key=mx.random.key(1))
        with mx.stream(mx.cpu):
            cpu = logits_rows(model, ids, args.prefill, compiled=False)
        scale = max(float(mx.abs(r).max()) for r in cpu)
        row: dict[str, Any] = {"max_abs_logit": scale}
        for label in ("compiled", "eager"):
            gpu = logits_rows(model, ids, args.prefill, compiled=label == "compiled")
            row[label] = largest(gpu, cpu)
            print(f"  {label:10s} GPU vs CPU: prefill {row[label][0]:.3g}, steps "
                  f"{row[label][1]:.3g} (largest logit {scale:.3g})", flush=True)
        with settings.overridden(kernels=frozenset()):
            row["no kernels"] = largest(logits_rows(model, ids, args.prefill, False), cpu)
        print(f"  no kernels GPU vs CPU: prefill {row['no kernels'][0]:.3g}, steps "
              f"{row['no kernels'][1]:.3g}", flush=True)
        row["cpu change at 1e-7"] = sensitivity(model, ids[:, :args.prefill], cpu[0])
        print(f"  conditioning: a relative 1e-7 change of one layer's query weights moves the "
              f"CPU's logits by {row['cpu change at 1e-7']:.3g}", flush=True)
        reference, _ = harness.load_reference(build_reference, args.no_mlx_lm)
        if reference is not None:
            prompt = ids[:, :args.prefill]
            gpu_ref = reference(prompt)[0, -1]
            with mx.stream(mx.cpu):
                cpu_ref = reference(prompt)[0, -1]
                mx.eval(cpu_ref)
            row["mlx-lm GPU vs CPU"] = float(mx.abs(gpu_ref - cpu_ref).max())
            row["mlx-lm CPU vs ours CPU"] = float(mx.abs(cpu_ref - cpu[0]).max())
            print(f"  mlx-lm     GPU vs CPU: prefill {row['mlx-lm GPU vs CPU']:.3g}; its CPU "
                  f"vs ours {row['mlx-lm CPU vs ours CPU']:.3g}", flush=True)
        results[name] = row
        del model, reference, build_reference, gpu, cpu
    harness.write_json(args.json, results)
    return 0


if __name__ == "__main__":
    sys.exit(main())
