"""What a speculative verify forward costs against a decode step, and which of its parts
make it dearer: block length, the draft's taps, snapshots scheduled for rollback, under
switches (compiled step off, fused kernels off).

On the Qwen3.5-0.8B shape (random weights; the taps an MTP head asks for), after a prefill
of ``--context`` tokens; each figure is the median milliseconds of ``--repeats`` forwards,
each evaluated with the caches' state and rolled back to one token after it (as a round
that accepts nothing), so the context stays put.

    python bench/verify_paths.py --quick
    python bench/verify_paths.py --json out.json     # GPU
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import harness
import mlx.core as mx
import numpy as np

from mlxrunner import settings
from mlxrunner.decode import forward, prefill

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mtp  # noqa: E402  (bench/mtp.py: the target and head builders)

VARIANTS = ("plain", "taps", "snapshots", "taps+snapshots")


def time_forward(model: Any, caches: list[Any], taps: list[int], length: int, variant: str,
                 repeats: int) -> float:
    live = [c for c in caches if c is not None]
    ids = mx.array([list(range(1, length + 1))], dtype=mx.int32)
    times = []
    for i in range(repeats + 2):  # two warm-ups: the trace, its checked replay
        pos = live[0].offset
        snapshots = "snapshots" in variant
        for c in live:
            c.schedule_snapshots(range(pos + 1, pos + length + 1) if snapshots else
                                 [pos + 1])
        t0 = time.perf_counter()
        out = forward(model, ids, caches, taps=taps if "taps" in variant else None)
        mx.eval(out, *[s for c in live for s in c.state])
        elapsed = time.perf_counter() - t0
        for c in live:
            c.restore(pos + 1)
            c.discard_snapshots()
        mx.eval(*[s for c in live for s in c.state])
        if i >= 2:
            times.append(elapsed)
    return 1e3 * statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--context", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--lengths", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--switched", action="append", default=None,
                   help="also under a setting, name=value (default compile=0, kernels=0)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="log mlxrunner's decisions (kernels declined, traces dropped)")
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    if args.verbose:
        logging.basicConfig(level=logging.INFO, format="  [%(name)s] %(message)s")
    context = args.context or (32 if args.quick else 1024)
    repeats = args.repeats or (3 if args.quick else 20)
    switched = args.switched if args.switched is not None else ["compile=0", "kernels=0"]
    dtype = mx.float32 if mx.default_device() == mx.cpu else mx.bfloat16
    model, config = mtp.speculative_bench().build_target(mtp.TARGET, args.quick, dtype)
    head = mtp.random_head(model, config, dtype)
    taps = list(head.taps)
    prompt = np.random.default_rng(0).integers(0, model.vocab_size, context).tolist()
    caches = model.make_cache()
    prefill(model, prompt, caches)
    rows = []
    print(f"Verify forward costs (ms, median of {repeats}), {model.num_layers} layers, context "
          f"{context}, {str(dtype).split('.')[-1]}, device {mx.default_device()}", flush=True)
    for setting in [None, *switched]:
        with (settings.overridden(**dict([harness._setting(setting)])) if setting else
              _nothing()):
            for variant in VARIANTS:
                cells = {n: round(time_forward(model, caches, taps, n, variant, repeats), 3)
                         for n in args.lengths}
                rows.append({"setting": setting or "defaults", "variant": variant, "ms": cells})
                print(f"  {setting or 'defaults':>12} {variant:>15}: " + "  ".join(
                    f"L={n} {v:7.3f}" for n, v in cells.items()), flush=True)
    harness.write_json(args.json, {"bench": "verify_paths", "context": context,
                                   "device": str(mx.default_device()), "mlx": mx.__version__,
                                   "rows": rows})
    return 0


class _nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


if __name__ == "__main__":
    raise SystemExit(main())
