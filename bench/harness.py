"""What the model benches (gemma4.py, qwen3_5.py) share: paths, the timed prefill and
greedy-decode loop, best-of-N measurement, the mlx-lm comparison and the JSON output.

The benches run as ``python bench/<name>.py``, so this module is imported as ``harness``.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import device_clock
import mlx.core as mx
from cuda_graph_dot import count_launches, kernels

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("MLXRUNNER_SHARED_DATA", REPO.parent / "shared" / "data"))
DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The text part, with top-level keys it lacks copied in (as the loader does)."""
    if "text_config" not in config:
        return dict(config)
    text = dict(config["text_config"])
    for key, value in config.items():
        if key != "text_config":
            text.setdefault(key, value)
    return text


def mlx_settings() -> dict[str, str | None]:
    """The MLX environment settings every row of a run shares (mlxrunner sets defaults for
    them at import: ``mlxrunner.MLX_DEFAULTS``)."""
    return {k: os.environ.get(k) for k in ("MLX_ENABLE_TF32", "MLX_MAX_OPS_PER_BUFFER")}


def eval_cache(cache: list[Any]) -> None:
    mx.eval([c.state for c in cache if c is not None])


#: prompts are prefilled in chunks of this many tokens (None: at once); set by the benches'
#: --prefill-chunk (long contexts: mlx-lm's generate prefills 2048 at a time)
PREFILL_CHUNK: int | None = None


def run(model: Any, cache: list[Any], prompt: mx.array, new: int) -> dict[str, float]:
    """Prefill ``prompt[:-1]``, then ``new`` greedy steps starting from its last token."""
    mx.synchronize()
    start = time.perf_counter()
    chunk = PREFILL_CHUNK or prompt.size
    prefill_build_s = 0.0
    for at in range(0, prompt.size - 1, chunk):
        built = time.perf_counter()
        device_clock.fill(model, prompt[None, at:min(at + chunk, prompt.size - 1)], cache)
        prefill_build_s += time.perf_counter() - built
        eval_cache(cache)
    prefill_s = time.perf_counter() - start

    def step(y: mx.array) -> mx.array:
        logits = model(y, cache=cache)
        return mx.argmax(logits[:, -1, :], axis=-1, keepdims=True)

    y = step(prompt[None, -1:])  # the prompt's last token: the first decode step
    mx.async_eval(y)
    y.item()
    build_s = submit_s = wait_s = 0.0
    start = time.perf_counter()
    for _ in range(new):
        t0 = time.perf_counter()
        nxt = step(y)
        t1 = time.perf_counter()
        mx.async_eval(nxt)
        t2 = time.perf_counter()
        y.item()  # read the previous token while the next step runs
        t3 = time.perf_counter()
        build_s, submit_s, wait_s = build_s + t1 - t0, submit_s + t2 - t1, wait_s + t3 - t2
        y = nxt
    y.item()
    decode_s = time.perf_counter() - start
    # where a step's time goes: Python building its graph, MLX submitting it (host work
    # per operation), and waiting for the previous step (the device behind the host)
    return {"prefill_s": prefill_s, "prefill_tok_s": (prompt.size - 1) / prefill_s,
            "prefill_build_ms": 1e3 * prefill_build_s,  # (Python; the rest: MLX's evaluation)
            "decode_s": decode_s, "decode_tok_s": new / decode_s,
            "decode_build_ms": 1e3 * build_s / new, "decode_submit_ms": 1e3 * submit_s / new,
            "decode_wait_ms": 1e3 * wait_s / new}


def measure(rows: dict[str, Any], prompt: mx.array, new: int, repeats: int,
            name_width: int) -> dict[str, dict[str, float]]:
    """Best prefill and decode rates of each row (a model with ``make_cache``), printed
    with names padded to ``name_width``. The rows take turns in every repeat, each repeat
    starting one row further on, so that a change of machine load or the allocator state
    a row inherits from the one before hits them alike."""
    if os.environ.get(KERNEL_COUNT_CHILD):
        print(KERNEL_COUNT_MARK + json.dumps(count_step_kernels(rows, prompt)), flush=True)
        sys.exit(0)
    kernels = step_kernels_on_cuda()
    # warm-up (trace, JIT, allocate) on the first prefill chunk (a long prompt's full
    # prefill would double a slow row's time for nothing) and the whole decode: MLX's buffer
    # cache then holds what a repeat allocates (on the GPU after the parity check emptied it,
    # the first repeats' prompts ran at half rate when the warm-up decoded 4 tokens)
    warm = prompt[:PREFILL_CHUNK + 1] if PREFILL_CHUNK else prompt
    for model in rows.values():
        run(model, model.make_cache(), warm, new)
    best: dict[str, dict[str, float]] = {}
    names = list(rows)
    for repeat in range(repeats):
        shift = repeat % len(names)
        for name in names[shift:] + names[:shift]:
            model = rows[name]
            result = run(model, model.make_cache(), prompt, new)
            gc.collect()
            kept = best.setdefault(name, dict(result, prefill_runs=[], decode_runs=[],
                                              prefill_build_runs_ms=[]))
            kept["prefill_runs"].append(result["prefill_tok_s"])
            kept["prefill_build_runs_ms"].append(result["prefill_build_ms"])
            kept["decode_runs"].append(result["decode_tok_s"])
            for key in ("prefill", "decode"):
                if result[f"{key}_tok_s"] > kept[f"{key}_tok_s"]:
                    kept[f"{key}_s"], kept[f"{key}_tok_s"] = (result[f"{key}_s"],
                                                              result[f"{key}_tok_s"])
                    if key == "decode":
                        for part in ("build", "submit", "wait"):
                            kept[f"decode_{part}_ms"] = result[f"decode_{part}_ms"]
    if device_clock.available():  # the device's own time, the host out of the way
        for name in names:
            try:
                best[name].update(device_clock.decode_and_prompt_ms(
                    rows[name], prompt, chunk=PREFILL_CHUNK))
            except Exception as exc:  # (a diagnostic: the rates above stand without it)
                print(f"  {name}: the device clock failed: {exc}", flush=True)
    for name in names:
        if kernels and name in kernels:
            best[name]["kernels_per_step"] = kernels[name]["kernels"]
            best[name]["kernels_by_name"] = kernels[name]["by_name"]
            best[name]["graphs_per_step"] = kernels[name]["graphs"]
            for key in ("prompt_kernels", "prompt_by_name"):
                best[name][key] = kernels[name].get(key)
            if not kernels[name]["graphs"]:
                print(f"  {name}: MLX wrote no graph in the counted step", flush=True)
            elif "sample" in kernels[name]:  # a dump this bench could not read: show it
                print(f"  {name}: {kernels[name]['graphs']} graphs, none read; the first "
                      f"begins {kernels[name]['sample']!r}", flush=True)
    for name in names:
        result = best[name]
        print(f"  {name:{name_width}s} prefill {result['prefill_tok_s']:10.1f} tok/s   "
              f"decode {result['decode_tok_s']:8.1f} tok/s   (a step: build "
              f"{result['decode_build_ms']:.2f}, submit {result['decode_submit_ms']:.2f}, "
              f"wait {result['decode_wait_ms']:.2f} ms"
              + _device_part(result) + ")"
              + (f"  kernels a step {result['kernels_per_step']}, the prompt "
                 f"{result['prompt_kernels']}" if "kernels_per_step" in result else ""),
              flush=True)
        print(f"  {'':{name_width}s} prefill by repeat, tok/s (Python's build, ms): "
              + ", ".join(f"{rate:.0f} ({built:.2f})" for rate, built in
                          zip(result["prefill_runs"], result["prefill_build_runs_ms"])),
              flush=True)
    return best


def _device_part(result: dict[str, Any]) -> str:
    if "decode_device_ms" not in result:
        return ""
    return "".join(f"; {what} {result[key]:.2f}" if result[key] is not None
                   else f"; {what} (host behind)" for what, key in
                   (("device", "decode_device_ms"), ("prompt on device", "prefill_device_ms")))


#: set in the child process that counts kernels (see :func:`step_kernels_on_cuda`)
KERNEL_COUNT_CHILD = "MLXRUNNER_BENCH_COUNT_KERNELS"
KERNEL_COUNT_MARK = "kernel counts: "


def step_kernels_on_cuda() -> dict[str, Any] | None:
    """On MLX's CUDA backend: the kernels each row launches in one decode step, counted in a
    child process running this bench again with MLX's ``MLX_SAVE_CUDA_GRAPHS_DOT_FILE`` set
    (MLX then writes every CUDA graph it launches as a DOT file: a kernel is a node; the
    variable is read once per process and slows every launch, hence the child). None off
    CUDA (MLX's CPU device has no such count), or when the child fails."""
    cuda = getattr(mx, "cuda", None)
    if os.environ.get("BENCH_NO_KERNEL_COUNT") or cuda is None or not cuda.is_available() \
            or mx.default_device() != mx.gpu:
        return None
    import subprocess
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        env = dict(os.environ, **{KERNEL_COUNT_CHILD: "1",
                                  "MLX_SAVE_CUDA_GRAPHS_DOT_FILE": f"{folder}/graph"})
        try:
            done = subprocess.run([sys.executable, *sys.argv], env=env, capture_output=True,
                                  text=True, timeout=600)
        except subprocess.TimeoutExpired:
            print("  kernel count: the child ran over 600 s", flush=True)
            return None
        for line in done.stdout.splitlines():
            if line.startswith(KERNEL_COUNT_MARK):
                counts: dict[str, Any] = json.loads(line[len(KERNEL_COUNT_MARK):])
                return counts
        print(f"  kernel count failed (exit {done.returncode}): "
              f"{(done.stderr or done.stdout).strip()[-400:]}", flush=True)
    return None


def count_step_kernels(rows: dict[str, Any], prompt: mx.array) -> dict[str, Any]:
    """(In the child of :func:`step_kernels_on_cuda`.) Each row's kernels in its fourth
    decode step after an 8-token prefill: ``kernels`` and ``by_name`` (the most frequent);
    and in the timed prompt's prefill, its first chunk (``prompt_kernels``, and every
    kernel's count in ``prompt_by_name``)."""
    prefix = Path(os.environ["MLX_SAVE_CUDA_GRAPHS_DOT_FILE"])
    counts: dict[str, Any] = {}
    for name, model in rows.items():
        first = prompt[None, :min(prompt.size - 1, PREFILL_CHUNK or prompt.size)]
        for _ in range(2):  # (the first prompt's one-off setup is not counted)
            mx.synchronize()
            before = set(prefix.parent.glob(f"{prefix.name}*"))
            cache = model.make_cache()
            device_clock.fill(model, first, cache)
            eval_cache(cache)
            mx.synchronize()
        prompt_names = count_launches(sorted(set(prefix.parent.glob(f"{prefix.name}*"))
                                             - before))
        cache = model.make_cache()
        model(prompt[None, :8], cache=cache)
        eval_cache(cache)
        y = prompt[None, 8:9]
        for _ in range(4):
            mx.synchronize()
            before = set(prefix.parent.glob(f"{prefix.name}*"))
            y = mx.argmax(model(y, cache=cache)[:, -1, :], axis=-1, keepdims=True)
            mx.eval(y)
            eval_cache(cache)
            mx.synchronize()
        new = sorted(set(prefix.parent.glob(f"{prefix.name}*")) - before)
        names = count_launches(new)
        total = kernels(names)
        counts[name] = {"kernels": total, "graphs": len(new),
                        "by_name": dict(names.most_common(12)),
                        "prompt_kernels": kernels(prompt_names),
                        # (every name: a prompt change's count shows kernel by kernel)
                        "prompt_by_name": dict(prompt_names.most_common())}
        if not total and new:  # a DOT layout this parser does not know: show its start
            counts[name]["sample"] = new[0].read_text(errors="replace")[:600]
    return counts


#: operations that only view their input (no kernel); every node still costs a traced
#: step host time on each replay
VIEWS = frozenset({"Broadcast", "Reshape", "Slice", "Transpose", "Squeeze", "ExpandDims",
                   "AsStrided", "Flatten", "Unflatten", "StopGradient", "Depends"})


def graph_labels(*outputs: mx.array) -> list[str]:
    """The operation names of the (unevaluated) graph behind ``outputs``, from MLX's DOT
    export, one per node."""
    import re
    import tempfile

    with tempfile.NamedTemporaryFile("r", suffix=".dot") as dot:
        mx.export_to_dot(dot.name, *outputs)
        return re.findall(r'label ="([^"]+)"', dot.read())


def decode_graph_nodes(model: Any, prompt: mx.array) -> dict[str, Any]:
    """Operations in the graph of one decode step (after a short prefill), from MLX's DOT
    export: ``all``, ``kernels`` (without the views: reshapes, slices, transposes...) and
    ``by_kernel`` (their count per operation name).
    Decoding a small model is bound by this count; on the CPU MLX spells fused GPU
    operations (RMSNorm, RoPE, attention) as several, so compare counts per device."""
    cache = model.make_cache()
    model(prompt[None, :8], cache=cache)
    eval_cache(cache)
    mx.eval(model(prompt[None, 8:9], cache=cache))  # one-off setup
    eval_cache(cache)
    logits = model(prompt[None, 9:10], cache=cache)
    outputs = [mx.argmax(logits[:, -1], axis=-1)]
    outputs += [s for c in cache if c is not None for s in c.state if isinstance(s, mx.array)]
    labels = graph_labels(*outputs)
    mx.eval(outputs)
    kernels = Counter(label for label in labels if label not in VIEWS)
    return {"all": len(labels), "kernels": sum(kernels.values()),
            "by_kernel": dict(kernels.most_common())}


class Ours:
    """Our model as the core decodes it: each forward through ``mlxrunner.decode.forward``
    (the compiled step where it applies), under settings ``changes`` (``--switched``), so
    a second instance shows what a switch costs or saves in the same run."""

    def __init__(self, model: Any, **changes: Any) -> None:
        self.model, self.changes = model, changes

    def make_cache(self) -> list[Any]:
        return self.model.make_cache()

    def __getattr__(self, name: str) -> Any:  # the model's facts (vocab_size, dtype, ...)
        return getattr(self.model, name)

    def __call__(self, ids: mx.array, cache: Any = None, **kwargs: Any) -> Any:
        from mlxrunner import settings

        if not self.changes:  # (the plain row pays for no settings swap a step)
            return self._call(ids, cache, **kwargs)
        with settings.overridden(**self.changes):
            return self._call(ids, cache, **kwargs)

    def fill_caches(self, ids: mx.array, cache: list[Any]) -> None:
        """A prompt chunk into ``cache``, its logits unread: as the core's prefill runs every
        chunk but a prompt's last (``mlxrunner.nn.caches_only``: an architecture skips what
        writes no cache, Gemma 4 its KV-sharing layers)."""
        from mlxrunner import nn as mnn

        with mnn.caches_only():
            self(ids, cache=cache)

    def _call(self, ids: mx.array, cache: Any = None, **kwargs: Any) -> Any:
        from mlxrunner.decode import forward

        if cache is None:
            return self.model(ids, **kwargs)
        return forward(self.model, ids, cache, kwargs.get("taps"))


def queued_us(fns: Callable[[mx.array], Any] | Sequence[Callable[[mx.array], Any]],
              xs: Sequence[mx.array]) -> tuple[float, float]:
    """Microseconds a call of ``len(xs)`` calls queued in one evaluation, cycling through
    ``fns`` (one callable or several): building their graph (Python), then evaluating it
    (the submission and the device), after one call evaluated alone (a trace, a build) and
    the device idle."""
    cycle = [fns] if callable(fns) else list(fns)
    mx.eval(cycle[0](xs[0]))
    mx.synchronize()
    start = time.perf_counter()
    outs = [cycle[n % len(cycle)](x) for n, x in enumerate(xs)]
    built = time.perf_counter()
    mx.eval(outs)
    done = time.perf_counter()
    return 1e6 * (built - start) / len(xs), 1e6 * (done - built) / len(xs)


def at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an int of at least ``low`` (else one line from argparse)."""
    def integer(text: str) -> int:  # (argparse names a refused text by this name)
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value
    return integer


def add_switched_argument(parser: argparse.ArgumentParser, example: str) -> None:
    parser.add_argument("--switched", metavar="NAME=VALUE", action="append", default=[],
                        type=_switch,
                        help="also time a second instance of our model with setting NAME "
                             f"(mlxrunner.settings) at VALUE, e.g. {example}, compile=0, "
                             "attention=folded or mlx, kernels=0 or attention,deltanet, "
                             "row_products=0, prompt_submit_layers=0; repeatable, one row each")


#: the settings a bench row may switch (``--switched NAME=VALUE``), each read from
#: ``MLXRUNNER_<NAME>`` as the environment gives it
SWITCHABLE = ("attention", "compile", "host_products", "kernels", "packed_kernels",
              "prompt_submit_layers", "row_products")


def _switch(text: str) -> str:
    """``--switched``'s argument, refused as it is parsed (before any model is built)."""
    try:
        _setting(text)
    except SystemExit as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--switched").lstrip(": ")) from None
    return text


def _setting(text: str) -> tuple[str, Any]:
    """``NAME=VALUE`` as the setting's value, parsed (and refused) as the environment's
    ``MLXRUNNER_<NAME>`` would be."""
    from mlxrunner import settings

    name, _, value = text.partition("=")
    if name not in SWITCHABLE or not value:
        raise SystemExit(f"--switched {text!r}: use NAME=VALUE with NAME one of "
                         f"{', '.join(SWITCHABLE)}")
    try:
        parsed = settings.Settings.from_environment({f"MLXRUNNER_{name.upper()}": value})
    except settings.SettingsError as exc:
        raise SystemExit(f"--switched: {exc}") from None
    return name, getattr(parsed, name)


def switched_rows(values: list[str], build: Callable[[], Any], **base: Any
                  ) -> dict[str, Ours]:
    """One row per ``--switched NAME=VALUE``: a new instance (``build()``) run under it
    (and under ``base``, the settings every row of ours has)."""
    rows = {}
    for value in values:
        name, setting = _setting(value)
        rows[f"mlxrunner ({value})"] = Ours(build(), **{**base, name: setting})
    return rows


def print_nodes(nodes: dict[str, dict[str, Any]], top: int = 10) -> None:
    print("  decode step graph: " + "   ".join(
        f"{name} {n['all']} ops ({n['kernels']} non-view)" for name, n in nodes.items()),
        flush=True)
    for name, n in nodes.items():
        if name.startswith("mlxrunner"):
            print(f"    {name}: " + ", ".join(f"{k} {v}" for k, v in
                                           list(n["by_kernel"].items())[:top]), flush=True)


def add_shape_arguments(parser: argparse.ArgumentParser, repeats: int) -> None:
    """A decoder bench's run: dtype, prompt and generated tokens, repeats, ``--quick``
    (:func:`quick_shape`)."""
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    parser.add_argument("--new", type=int, default=128, help="generated tokens")
    parser.add_argument("--repeats", type=int, default=repeats, help="timed runs per row")
    parser.add_argument("--quick", action="store_true",
                        help="CPU-sized run: 4 layers, vocabulary 16384, prompt 128, 16 new")


def quick_shape(args: argparse.Namespace, config: dict[str, Any]) -> dict[str, Any]:
    """``config`` (a copy), cut to the ``--quick`` shape where asked."""
    config = dict(config)
    if args.quick:
        config.update(num_hidden_layers=4, vocab_size=16384)
        args.prompt, args.new = 128, 16
    return config


def results_header(shape: str, config: dict[str, Any], args: argparse.Namespace,
                   device: str) -> dict[str, Any]:
    """What a decoder bench's JSON starts with: the shape, the run and the machine."""
    return {"config": shape, "layers": config["num_hidden_layers"],
            "vocab": config["vocab_size"], "dtype": args.dtype, "prompt": args.prompt,
            "new": args.new, "device": device, "mlx": mx.__version__,
            "platform": platform.platform(), "mlx_settings": mlx_settings(),
            "repeats": args.repeats, "mlx_lm": None}


def add_call_arguments(parser: argparse.ArgumentParser, quick: str) -> None:
    """A per-call bench's run (bench/product_bandwidth.py, bench/attention_device.py): calls
    queued at once, repeats, ``--quick`` (``quick``: what it shrinks), JSON path."""
    parser.add_argument("--count", type=at_least(1), default=64, help="calls queued at once")
    parser.add_argument("--repeats", type=at_least(1), default=5)
    parser.add_argument("--quick", action="store_true", help=quick)
    parser.add_argument("--json", type=Path)


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """Options every model bench takes, after its own: mlx-lm skip, JSON path, seed."""
    parser.add_argument("--no-mlx-lm", action="store_true", help="skip the mlx-lm comparison")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--prefill-chunk", type=int,
                        help="prefill prompts in chunks of this many tokens (long contexts)")


def apply_common_arguments(args: argparse.Namespace) -> None:
    global PREFILL_CHUNK
    PREFILL_CHUNK = args.prefill_chunk


def load_reference(build: Callable[[], Any], skip: bool) -> tuple[Any, str | None]:
    """mlx-lm's model from ``build()`` and mlx-lm's version, or ``(None, None)`` when
    skipped or mlx-lm is not importable."""
    if skip:
        return None, None
    try:
        import mlx_lm

        return build(), mlx_lm.__version__
    except ImportError:
        print("  mlx-lm not importable: comparison skipped", flush=True)
        return None, None


#: the largest |logit difference| between the two models in float32 (the bench's weights
#: cast up) under which a bench reports their speed ratio: above it they are not shown to
#: compute the same function
PARITY_TOLERANCE = 1e-3


def float32_logits(row: Any, ids: mx.array, stream: Any = None) -> mx.array:
    """``row``'s logits for ``ids`` with its floating parameters cast to float32 for the
    call (the bench's own arrays are put back after, so sharing between rows holds), run on
    ``stream`` (None: the default one). The casts are made and evaluated on the default
    device first: on MLX's CUDA backend an array the CPU reads moves to host memory for good
    (``Buffer::raw_ptr``), so a CPU pass over the bench's own weights would leave both
    models reading them from host memory for the rest of the run (and see
    :func:`_parity_split` for the buffers such a pass frees)."""
    from contextlib import nullcontext

    from mlx.utils import tree_flatten, tree_unflatten

    module = row.model if isinstance(row, Ours) else row
    saved = tree_flatten(module.parameters())
    def cast(value: mx.array) -> mx.array:
        if mx.issubdtype(value.dtype, mx.floating) and value.dtype != mx.float32:
            return value.astype(mx.float32)
        # (astype to its own dtype is the array itself: a copy for the CPU to read)
        return value if stream is None else value * 1

    casts = [(key, cast(value)) for key, value in saved]
    ids = cast(ids)
    mx.eval([value for _, value in casts], ids)
    module.update(tree_unflatten(casts))
    try:
        with nullcontext() if stream is None else mx.stream(stream):
            logits = row(ids).astype(mx.float32)
            mx.eval(logits)
    finally:
        module.update(tree_unflatten(saved))
    return logits


def record_parity(ours: Any, reference: Any, prompt: mx.array, results: dict[str, Any]) -> None:
    """Largest logit difference between the two models over the prompt's first 16 tokens,
    in the bench's dtype and in float32 (``parity_float32``: what
    :func:`record_reference` holds against ``PARITY_TOLERANCE``)."""
    short = prompt[None, :16]
    diff = mx.abs(ours(short).astype(mx.float32) - reference(short).astype(mx.float32))
    results["parity_max_abs_logit_diff_16_tokens"] = diff.max().item()
    ours_f32, reference_f32 = float32_logits(ours, short), float32_logits(reference, short)
    results["parity_float32"] = mx.abs(ours_f32 - reference_f32).max().item()
    print(f"  parity: max |logit difference| over 16 tokens "
          f"{results['parity_max_abs_logit_diff_16_tokens']:.4g} "
          f"(float32: {results['parity_float32']:.3g}, tolerance {PARITY_TOLERANCE:g})",
          flush=True)
    if results["parity_float32"] > PARITY_TOLERANCE and mx.default_device() != mx.cpu:
        results["parity_float32_where"] = _parity_split(ours, reference, short, ours_f32,
                                                        reference_f32)
        print("  float32 parity, split: " + ", ".join(
            f"{k} {v:.3g}" for k, v in results["parity_float32_where"].items()), flush=True)


def _parity_split(ours: Any, reference: Any, short: mx.array, ours_gpu: mx.array,
                  ref_gpu: mx.array) -> dict[str, float]:
    """Where a float32 disagreement on the GPU (``ours_gpu`` against ``ref_gpu``) comes
    from: ours without the core's kernels against the reference, and each model on the GPU
    against itself on the CPU."""
    from mlxrunner import settings

    def gap(a: mx.array, b: mx.array) -> float:
        return mx.abs(a - b).max().item()

    with settings.overridden(kernels=frozenset(), attention="mlx", row_products=False):
        plain = float32_logits(ours, short)
    on_cpu = []
    for row in (ours, reference):
        on_cpu.append(float32_logits(row, short, mx.cpu))
        mx.clear_cache()  # (the CPU pass's freed buffers are host memory: not for the GPU)
    ours_cpu, ref_cpu = on_cpu
    return {"ours without kernels vs reference": gap(plain, ref_gpu),
            "ours GPU vs CPU": gap(ours_gpu, ours_cpu),
            "reference GPU vs CPU": gap(ref_gpu, ref_cpu),
            "ours vs reference on the CPU": gap(ours_cpu, ref_cpu)}


def record_reference(results: dict[str, Any], best: dict[str, Any], version: str | None,
                     rows: tuple[str, ...] = ("mlxrunner",)) -> dict[str, float] | None:
    """mlx-lm's rates (with its version) into ``results``; for each row in ``rows`` its
    per-repeat rate ratios to mlx-lm (the rows took turns, so repeat i of each ran under
    the same load), printed as median and range, ``mlxrunner``'s in ``ratio`` (medians)
    and ``ratio_spread``, the others' in ``ratios[row]``. Returns ``ratio``, or None, with
    no ratio recorded, when :func:`parity_withheld` says why."""
    results["mlx_lm"] = dict(best["mlx-lm"], version=version)
    withheld = parity_withheld(results)
    if withheld is not None:
        results["ratio_withheld"] = withheld
        print(f"  ratios withheld: {withheld}", flush=True)
        return None
    spreads: dict[str, dict[str, dict[str, float]]] = {}
    for row in rows:
        spreads[row] = {key: ratio_spread(best[row][f"{key}_runs"],
                                          best["mlx-lm"][f"{key}_runs"])
                        for key in ("prefill", "decode")}
        for key, s in spreads[row].items():
            print(f"  {key:7s} {row} / mlx-lm: median {s['median']:.2f}x "
                  f"(range {s['min']:.2f}-{s['max']:.2f}, {s['n']} repeats)", flush=True)
    ours = spreads[rows[0]]
    results["ratio"] = {key: s["median"] for key, s in ours.items()}
    results["ratio_spread"] = ours
    results["ratios"] = {row: {key: s["median"] for key, s in spread.items()}
                         for row, spread in spreads.items() if row != rows[0]}
    return results["ratio"]


def parity_withheld(results: dict[str, Any]) -> str | None:
    """Why no ratio may be reported, or None: the two models' float32 logits agree within
    ``PARITY_TOLERANCE``; or, on a GPU, ours without the core's kernels agrees within it (the
    same function) and the kernels move the logits no further from the reference than the
    reference's own GPU result lies from its CPU one (float32 arithmetic in another order,
    as the device's own products do; ``parity_rule`` says which held)."""
    parity = results.get("parity_float32")
    if parity is None:
        return "parity not measured"
    if parity <= PARITY_TOLERANCE:
        results["parity_rule"] = f"float32 logits within {PARITY_TOLERANCE:g}"
        return None
    split = results.get("parity_float32_where") or {}
    mapping = split.get("ours without kernels vs reference")
    spread = split.get("reference GPU vs CPU")
    if mapping is not None and spread is not None and mapping <= PARITY_TOLERANCE \
            and parity <= spread:
        results["parity_rule"] = (
            f"without the core's kernels within {PARITY_TOLERANCE:g} ({mapping:.3g}); with "
            f"them {parity:.3g}, inside the reference's own GPU-CPU spread {spread:.3g}")
        print(f"  parity: {results['parity_rule']}", flush=True)
        return None
    return f"float32 logits differ by {parity:.3g} > {PARITY_TOLERANCE:g}" + (
        f" (without the core's kernels {mapping:.3g}, the reference's GPU-CPU spread "
        f"{spread:.3g})" if mapping is not None and spread is not None else "")


def ratio_spread(ours: list[float], theirs: list[float]) -> dict[str, float]:
    """The per-repeat ratios of two rows' rates (the rows took turns): median and range."""
    ratios = [a / b for a, b in zip(ours, theirs)]
    return {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
            "n": len(ratios)}


def write_json(path: Path | None, results: dict[str, Any]) -> None:
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".partial")  # (no half-written results file)
        partial.write_text(json.dumps(results, indent=2) + "\n")
        partial.replace(path)
        print(f"  wrote {path}")
