"""Where a batched decode step's time goes: one step of N rows on the Qwen3.5 shape (random
weights), ours and mlx-lm's, split into parts and under switches.

For each N (``--streams``): N random prompts of ``--prompt`` tokens are prefilled, then each
figure is the median over ``--steps`` steps, each synchronised:

- ``scheduler``: one :meth:`Scheduler.step` (forward, sampling, hand-out; pipelined);
- ``forward``: the batched forward alone through the scheduler's caches (per-row offsets and
  masks), ``build`` the host time of its call (graph or trace replay) before evaluation;
- ``uniform``: the same forward with plain caches, all rows one length (one prefill of N
  prompts together), as mlx-lm's own model runs a batch: what per-row masks cost;
- ``mlx-lm``: mlx-lm's model on its caches, all rows one length (its BatchGenerator's
  forward without its bookkeeping);
- ``sample``: the greedy pick over the batch's logits (``topk_indices`` on [N, V]);
- one forward per ``--switched`` setting (``row_products=0``, ``kernels=``, ...).

    python bench/batch_step.py --tiny
    python bench/batch_step.py --json out.json       # GPU: the 0.8B shape, bfloat16
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import harness
import mlx.core as mx
from harness import DTYPES
from qwen3_5 import DEFAULT_CONFIG, build_mlx_lm, build_ours, shrink

from mlxrunner import SamplerOptions, settings
from mlxrunner.batch import BatchRequest, Scheduler
from mlxrunner.decode import forward, topk_indices

GREEDY = SamplerOptions(temperature=0)


def timed(fn: Any, steps: int) -> float:
    """Median milliseconds of ``fn()`` (which evaluates what it makes), after one warm-up."""
    fn()
    mx.synchronize()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        mx.synchronize()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def running_scheduler(model: Any, prompts: list[list[int]], budget: int) -> Scheduler:
    scheduler = Scheduler(model, max_sequences=len(prompts))
    for prompt in prompts:
        scheduler.submit(BatchRequest(prompt, GREEDY, budget))
    while scheduler.waiting or scheduler.prefilling:
        scheduler.step()
    return scheduler


def batched_forward(model: Any, scheduler: Scheduler) -> tuple[Any, dict[str, float]]:
    rows = scheduler.batch.rows
    ids = mx.zeros((rows, 1), dtype=mx.int32)
    build: list[float] = []

    def step() -> None:
        t0 = time.perf_counter()
        logits = forward(model, ids, scheduler.batch.caches)
        build.append(time.perf_counter() - t0)
        mx.eval(logits, *scheduler.batch.state)

    return step, {"build": build}  # type: ignore[dict-item]


def uniform_forward(model: Any, prompts: list[list[int]], reference: bool) -> Any:
    if reference:
        from mlx_lm.models.cache import make_prompt_cache
        caches = make_prompt_cache(model)
    else:
        caches = model.make_cache()
    x = mx.array(prompts, dtype=mx.int32)
    logits = model(x, caches) if reference else forward(model, x, caches)
    mx.eval(logits)
    ids = mx.zeros((len(prompts), 1), dtype=mx.int32)

    def step() -> None:
        out = model(ids, caches) if reference else forward(model, ids, caches)
        mx.eval(out, *[s for c in caches if c is not None for s in _state(c)])

    return step


def _state(cache: Any) -> list[mx.array]:
    state = cache.state
    if isinstance(state, mx.array):
        return [state]
    return [s for s in state if isinstance(s, mx.array)] if isinstance(state, (list, tuple)) \
        else []


def measure(model: Any, reference: Any, n: int, args: argparse.Namespace,
            vocab: int) -> dict[str, Any]:
    key = mx.random.key(args.seed + n)
    prompts = mx.random.randint(0, vocab, (n, args.prompt), key=key).tolist()
    budget = 4 * args.steps * (len(args.switched) + 4) + 16
    scheduler = running_scheduler(model, prompts, budget)
    row: dict[str, Any] = {"streams": n}
    row["scheduler_ms"] = timed(scheduler.step, args.steps)
    step, extra = batched_forward(model, scheduler)
    row["forward_ms"] = timed(step, args.steps)
    row["forward_build_ms"] = 1e3 * statistics.median(extra["build"][1:])  # type: ignore
    logits = mx.random.normal((n, vocab)).astype(model.dtype)
    mx.eval(logits)
    row["sample_ms"] = timed(lambda: mx.eval(topk_indices(logits, 1)), args.steps)
    row["uniform_ms"] = timed(uniform_forward(model, prompts, False), args.steps)
    if reference is not None:
        row["mlx_lm_uniform_ms"] = timed(uniform_forward(reference, prompts, True), args.steps)
    for text in args.switched:
        name, value = harness._setting(text)
        with settings.overridden(**{name: value}):
            step, _ = batched_forward(model, scheduler)
            row[f"forward_ms[{text}]"] = timed(step, args.steps)
            row[f"uniform_ms[{text}]"] = timed(uniform_forward(model, prompts, False),
                                                args.steps)
    return row


def layer_kinds(args: argparse.Namespace) -> int:
    """Milliseconds of a uniform batched forward by layer kind and stream count."""
    base = json.loads(args.config.read_text())
    dtype = args.dtype or "bfloat16"
    streams = args.streams or [1, 8, 32]
    rows = []
    print(f"Batch forward by layer kind: {args.config.name}, {dtype}, prompt {args.prompt}, "
          f"device {mx.default_device()}, ms per step (median of {args.steps})", flush=True)
    for kind, layers in (("linear_attention", 24), ("full_attention", 24),
                         ("linear_attention", 1)):
        config = shrink(base, layers, None)
        text = config.get("text_config", config)
        text["layer_types"] = [kind] * layers
        model = build_ours(config, DTYPES[dtype], args.seed)
        vocab = text["vocab_size"]
        cells = {}
        for n in streams:
            prompts = mx.random.randint(0, vocab, (n, args.prompt),
                                        key=mx.random.key(n)).tolist()
            cells[n] = round(timed(uniform_forward(model, prompts, False), args.steps), 3)
        label = f"{layers} x {kind}"
        rows.append({"layers": label, "ms": cells})
        print(f"  {label:22}: " + "  ".join(f"{n} rows {v:7.3f}" for n, v in cells.items()),
              flush=True)
        del model
    harness.write_json(args.json, {"bench": "batch_step_kinds", "dtype": dtype, "rows": rows})
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--dtype", choices=sorted(DTYPES))
    parser.add_argument("--streams", type=int, nargs="+")
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--no-mlx-lm", action="store_true")
    parser.add_argument("--switched", action="append", default=None,
                        help="a setting for one more forward each (name=value)")
    parser.add_argument("--kinds", action="store_true",
                        help="instead: the uniform forward of models whose layers are all "
                             "of one kind (Gated DeltaNet, attention), and of one layer (the "
                             "embedding and head), per stream count")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    if args.kinds:
        return layer_kinds(args)
    if args.switched is None:
        args.switched = ["row_products=0", "kernels=0", "attention=mlx", "compile=0"]
    tiny = args.tiny
    streams = args.streams or ([1, 4] if tiny else [1, 4, 16, 32])
    if tiny:
        args.prompt, args.steps = min(args.prompt, 16), min(args.steps, 3)
    dtype = args.dtype or ("float32" if tiny else "bfloat16")
    config = shrink(json.loads(args.config.read_text()), 4 if tiny else None,
                    4096 if tiny else None)
    vocab = config.get("text_config", config)["vocab_size"]
    ours = build_ours(config, DTYPES[dtype], args.seed)
    reference = None if args.no_mlx_lm else build_mlx_lm(config, ours)
    print(f"Batch step costs: {args.config.name}, {dtype}, prompt {args.prompt}, "
          f"device {mx.default_device()}, ms per step (median of {args.steps})", flush=True)
    rows = []
    for n in streams:
        row = measure(ours, reference, n, args, vocab)
        rows.append(row)
        print("  " + "  ".join(f"{k} {v:.3f}" if isinstance(v, float) else f"{k} {v}"
                               for k, v in row.items()), flush=True)
    harness.write_json(args.json, {"bench": "batch_step", "dtype": dtype, "prompt": args.prompt,
                                   "device": str(mx.default_device()), "mlx": mx.__version__,
                                   "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
