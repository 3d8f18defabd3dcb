"""Start-up: how long ``mlxrunner run`` takes to its first token in a fresh process.

Writes a Qwen3.5-0.8B-shape model folder (random bf16 weights in the Hugging Face layout,
the demo's tokenizer and chat template), then times ``mlxrunner run FOLDER PROMPT
--max-tokens 1`` in new processes: the first with an empty MLX kernel cache
(``MLX_PTX_CACHE_DIR``: what a fresh machine pays, MLX compiling every CUDA kernel it
launches), then ``--runs`` more with that cache warm. Reported per run: the process's wall
time (start to exit, an upper bound of the time to the first token) and the prefill time
the run itself measured.

    python bench/startup.py --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("MLXRUNNER_SHARED_DATA", REPO.parent / "shared" / "data"))
CONFIG = SHARED / "configs" / "Qwen3.5-0.8B-Base.config.json"
DEMO = REPO / "plugins" / "demo" / "mlxrunner_demo" / "model"


def write_folder(folder: Path, config_path: Path, seed: int) -> None:
    """A Qwen3.5 folder of ``config_path``'s shape with random bf16 weights."""
    import mlx.core as mx
    from mlx.utils import tree_flatten

    import mlxrunner

    config = json.loads(config_path.read_text())
    text = dict(config.get("text_config", config))
    text.update(architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text",
                dtype="bfloat16")
    model = mlxrunner.build_model(text)
    mx.random.seed(seed)
    weights = {}
    for name, value in tree_flatten(model.parameters()):
        if name.endswith(("A_log", "dt_bias")) or "norm" in name:
            weights[name] = value.astype(mx.bfloat16)
        else:
            weights[name] = (mx.random.normal(value.shape) * 0.02).astype(mx.bfloat16)
        if name.endswith("conv1d.weight"):
            weights[name] = weights[name].swapaxes(1, 2)  # Hugging Face [C, 1, K]
    folder.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    (folder / "config.json").write_text(json.dumps(text, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (DEMO / name).exists():
            shutil.copy(DEMO / name, folder / name)


def one_run(folder: Path, prompt: str, env: dict[str, str],
            profile: Path | None = None) -> dict[str, Any]:
    start = time.perf_counter()
    python = [sys.executable] + (["-m", "cProfile", "-o", str(profile)] if profile else [])
    done = subprocess.run([*python, "-m", "mlxrunner.cli", "run", str(folder), prompt,
                           "--max-tokens", "1", "--temperature", "0", "--json"],
                          capture_output=True, text=True, env=env, timeout=600)
    wall = time.perf_counter() - start
    result: dict[str, Any] = {"wall_s": round(wall, 3), "exit": done.returncode}
    try:
        out = json.loads(done.stdout.strip().splitlines()[-1])
        run = out["statistics"]["run"]
        result["prefill_s"] = round(run["prompt_tokens"] / run["prefill_tokens_per_second"], 3)
    except (ValueError, IndexError, KeyError, TypeError, ZeroDivisionError):
        result["stdout"] = done.stdout[-500:]
    if done.returncode:
        result["stderr"] = done.stderr[-2000:]
    elif done.stderr.strip():
        result["warnings"] = done.stderr.strip().splitlines()[-5:]
    return result


def compile_times(cache: Path, started: float) -> dict[str, Any]:
    """The kernels a run wrote to MLX's kernel cache, in order, each with the time since
    the one before (the first: since the run started): an upper bound of its compile
    time."""
    # MLX splits a long kernel name into folders: the name is the path's parts joined
    files = sorted((f.stat().st_mtime, "".join(f.relative_to(cache).with_suffix("").parts))
                   for f in cache.rglob("*.ptx"))
    gaps, before = [], started
    for written, name in files:
        gaps.append((name, round(written - before, 3)))
        before = written
    return {"count": len(files), "core_kernels": len(list(cache.rglob("*.cubin"))),
            "longest": sorted(gaps, key=lambda g: -g[1])[:30],
            "last_written_s": round(before - started, 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, default=CONFIG)
    parser.add_argument("--folder", type=Path, help="the model folder: written there if "
                        "missing and kept (else written to a temporary folder)")
    parser.add_argument("--prompt", default="Write a haiku about rain.")
    parser.add_argument("--runs", type=int, default=3, help="runs with the kernel cache warm")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="one more warm run under cProfile; print its N largest "
                        "cumulative times")
    parser.add_argument("--variant", action="append", default=[], metavar="NAME=VALUE",
                        help="--runs more warm runs with this environment variable set "
                        "(repeatable: one set of runs each), against the same kernel cache")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="mlxrunner-startup-"))
    folder = args.folder or work / "qwen3.5-0.8b-shape"
    if not (folder / "config.json").exists():
        write_folder(folder, args.config, 0)
    cache = work / "ptx-cache"
    cache.mkdir()
    # the CUDA driver's cache of kernels built from PTX too: a fresh machine has neither
    env = dict(os.environ, MLX_PTX_CACHE_DIR=str(cache), CUDA_CACHE_PATH=str(work / "nv"))
    started = time.time()
    runs = [dict(one_run(folder, args.prompt, env), kernel_cache="empty")]
    compiled = compile_times(cache, started)
    runs += [dict(one_run(folder, args.prompt, env), kernel_cache="warm")
             for _ in range(args.runs)]
    variants: dict[str, list[float]] = {}
    for variant in args.variant:
        name, _, value = variant.partition("=")
        times = [dict(one_run(folder, args.prompt, dict(env, **{name: value})),
                      kernel_cache="warm", variant=variant) for _ in range(args.runs)]
        runs += times
        variants[variant] = sorted(r["wall_s"] for r in times)
    for r in runs:
        print(f"  {r['kernel_cache']:5s} kernel cache{' ' + r['variant'] if 'variant' in r else ''}"
              f": {r['wall_s']:7.2f} s to exit after the "
              f"first token (prefill {r.get('prefill_s')}); exit {r['exit']}"
              + (f"; {r['warnings']}" if r.get("warnings") else "")
              + (f"\n{r['stderr']}" if r.get("stderr") else ""), flush=True)
    warm = sorted(r["wall_s"] for r in runs[1:1 + args.runs]) or [float("nan")]
    profiled = {}
    if args.profile:
        # one more warm run under cProfile: where a warm start's time goes
        import pstats

        one_run(folder, args.prompt, env, profile=work / "run.prof")
        stats = pstats.Stats(str(work / "run.prof"))
        rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][3])  # type: ignore[attr-defined]
        for (file, line, function), (_, _, _, cumulative, _) in rows[:args.profile]:
            profiled[f"{Path(file).name}:{line}({function})"] = round(cumulative, 3)
            print(f"  {cumulative:7.3f} s  {Path(file).name}:{line}({function})")
    failed = [r for r in runs if r["exit"]]
    results = {"folder": str(folder), "runs": runs, "failed_runs": len(failed),
               "fresh_s": runs[0]["wall_s"],
               "warm_median_s": warm[len(warm) // 2],
               "variant_warm_median_s": {k: v[len(v) // 2] for k, v in variants.items() if v},
               "profile_cumulative_s": profiled,
               "kernels_compiled": compiled}
    print(f"  the fresh run compiled {compiled['count']} of MLX's kernels and "
          f"{compiled['core_kernels']} of the core's; the longest gaps before "
          "one was written (its compile time, or other work):")
    for name, gap in compiled["longest"][:12]:
        print(f"    {gap:6.2f} s  {name if len(name) <= 150 else name[:120] + '...' + name[-27:]}")
    print(f"  first token: fresh {results['fresh_s']:.2f} s, warm (median of "
          f"{len(warm)}) {results['warm_median_s']:.2f} s", flush=True)
    for variant, median in results["variant_warm_median_s"].items():
        print(f"  warm with {variant}: median {median:.2f} s")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    shutil.rmtree(work, ignore_errors=True)
    if failed:
        # a run that exits early times nothing: its figures must not read as a start-up
        print(f"startup: {len(failed)} of {len(runs)} runs exited non-zero; their times are "
              "not start-up times", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
