"""Our decode step under MLX's process-wide settings, one process per setting (MLX reads
them once): how a step's time moves with the kernels per CUDA graph
(``MLX_MAX_OPS_PER_BUFFER``, which mlxrunner sets to 200), the input elements per graph
(``MLX_MAX_MB_PER_BUFFER``, 1000 on an H100: MLX counts the elements of every input of a
graph's kernels against it, in millions, not the bytes they read, so a Gemma 4 E2B step's
weights (2.3G entries) and the per-layer table its gather takes whole (2.3G more) split the
step into more graphs than its kernels do; 1000000 never splits) and graphs off
(``MLX_USE_CUDA_GRAPHS=0``: each kernel launched alone).

Runs a model bench (``gemma4``, ``qwen3_5``, ``llama``) once per variant, ours alone (no
mlx-lm row, no eager row), and prints each variant's decode rate (median of its repeats,
with their range), the step's build / submit / wait and the CUDA graphs and kernels a step.

    python bench/mlx_env_sweep.py [--bench gemma4] [--repeats 3] [--quick] [--json out.json]
        [VARIANT ...]    (a variant: NAME=VALUE[,NAME=VALUE...]; "" is the defaults)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import harness

HERE = Path(__file__).resolve().parent
BENCHES = ("gemma4", "qwen3_5", "llama")
DEFAULT_VARIANTS = ("", "MLX_MAX_OPS_PER_BUFFER=100", "MLX_MAX_OPS_PER_BUFFER=250",
                    "MLX_MAX_MB_PER_BUFFER=1000000",
                    "MLX_MAX_OPS_PER_BUFFER=250,MLX_MAX_MB_PER_BUFFER=1000000",
                    "MLX_USE_CUDA_GRAPHS=0")


def variant(text: str) -> dict[str, str]:
    """``NAME=VALUE[,NAME=VALUE...]`` as a dict (an MLX_* name each); "" is no change."""
    settings = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, sep, value = part.partition("=")
        if not sep or not name.startswith("MLX_") or not value:
            raise argparse.ArgumentTypeError(f"{part!r}: expected MLX_NAME=VALUE")
        settings[name] = value
    return settings


def run(bench: str, settings: dict[str, str], repeats: int, timeout: float,
        quick: bool = False) -> dict[str, Any]:
    """One process of ``bench`` under ``settings``: our row's results, or ``error``."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "result.json"
        command = [sys.executable, str(HERE / f"{bench}.py"), "--no-mlx-lm",
                   "--repeats", str(repeats), "--json", str(out)]
        if bench == "gemma4":
            command.append("--no-eager")
        if quick:
            command.append("--quick")
        try:
            done = subprocess.run(command, env={**os.environ, **settings}, cwd=HERE,
                                  capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"ran past {timeout:g} s"}
        if done.returncode or not out.is_file():
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["?"]
            return {"error": f"exit {done.returncode}: {tail[0]}"}
        row: dict[str, Any] = json.loads(out.read_text())["mlxrunner"]
        return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("variants", nargs="*", type=variant,
                        default=[variant(v) for v in DEFAULT_VARIANTS])
    parser.add_argument("--bench", choices=BENCHES, default="gemma4")
    parser.add_argument("--repeats", type=harness.at_least(1), default=3)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds a variant")
    parser.add_argument("--quick", action="store_true", help="the benches' CPU-sized layouts")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    print(f"MLX settings sweep: bench/{args.bench}.py, ours alone, {args.repeats} repeats "
          "a variant, one process each", flush=True)
    results = []
    for settings in args.variants:
        name = ",".join(f"{k}={v}" for k, v in settings.items()) or "(mlxrunner's defaults)"
        row = run(args.bench, settings, args.repeats, args.timeout, args.quick)
        results.append({"settings": settings, **row})
        if "error" in row:
            print(f"  {name:56s} {row['error']}", flush=True)
            continue
        runs = row.get("decode_runs") or [row["decode_tok_s"]]
        print(f"  {name:56s} decode {statistics.median(runs):7.1f} tok/s "
              f"({min(runs):.1f}-{max(runs):.1f})   best step: build "
              f"{row['decode_build_ms']:.2f}, submit {row['decode_submit_ms']:.2f}, wait "
              f"{row['decode_wait_ms']:.2f} ms   graphs {row.get('graphs_per_step', '?')}, "
              f"kernels {row.get('kernels_per_step', '?')} a step", flush=True)
    if args.json:
        args.json.write_text(json.dumps({"bench": args.bench, "repeats": args.repeats,
                                         "variants": results}, indent=1) + "\n")
        print(f"  wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
