"""Gemma 4 prefill and decode throughput: mlxrunner's plugin against mlx-lm, side by side.

Both models get the same random weights (an E2B-shaped checkpoint in memory: our
parameters under mlx-lm's names), the same dtype and the same loop: prefill the
prompt minus its last token (evaluating only the caches, as mlx-lm's generate
does), then greedy-decode ``--new`` tokens one at a time with the next step
queued before the previous token is read (``mx.async_eval``). Rows: mlxrunner
(compiled one-token steps, the default), mlxrunner with eager steps, mlx-lm.
Runs unchanged on the CPU and on CUDA/Metal (``mx.default_device()``); mlx-lm is
compared when importable (``--no-mlx-lm`` to skip).

    /work/venv/bin/python bench/gemma4.py --quick --json /tmp/gemma4.json   # CPU-sized
    python bench/gemma4.py --json out.json     # GPU: E2B, bf16, prompt 512, 128 new
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten
from mlxrunner_gemma4 import Gemma4Model

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("MLXRUNNER_SHARED_DATA", REPO.parent / "shared" / "data"))
DEFAULT_CONFIG = SHARED / "configs" / "gemma-4-E2B-it.config.text-fields-from-ollama-tests.json"
DTYPES = {"bfloat16": mx.bfloat16, "float16": mx.float16, "float32": mx.float32}

# E2B's layout (4 sliding + 1 full, KV sharing, per-layer inputs, double-wide MLP)
# scaled down for a 2-core CPU.
QUICK_TEXT_CONFIG: dict[str, Any] = {
    "model_type": "gemma4_text", "hidden_size": 512, "num_hidden_layers": 10,
    "intermediate_size": 1024, "num_attention_heads": 8, "num_key_value_heads": 1,
    "head_dim": 64, "global_head_dim": 128, "vocab_size": 16384,
    "vocab_size_per_layer_input": 16384, "hidden_size_per_layer_input": 64,
    "num_kv_shared_layers": 4, "use_double_wide_mlp": True, "sliding_window": 64,
    "layer_types": (["sliding_attention"] * 4 + ["full_attention"]) * 2,
    "final_logit_softcapping": 30.0, "rms_norm_eps": 1e-6, "attention_k_eq_v": False,
    "tie_word_embeddings": True,
    "rope_parameters": {
        "full_attention": {"partial_rotary_factor": 0.25, "rope_theta": 1e6,
                           "rope_type": "proportional"},
        "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"}},
}


# gemma-4-E2B-it's text config (as in the shared data), for machines without that folder.
E2B_TEXT_CONFIG: dict[str, Any] = {
    **QUICK_TEXT_CONFIG,
    "hidden_size": 1536, "num_hidden_layers": 35, "intermediate_size": 6144,
    "num_attention_heads": 8, "num_key_value_heads": 1, "head_dim": 256,
    "global_head_dim": 512, "vocab_size": 262144, "vocab_size_per_layer_input": 262144,
    "hidden_size_per_layer_input": 256, "num_kv_shared_layers": 20, "sliding_window": 512,
    "layer_types": (["sliding_attention"] * 4 + ["full_attention"]) * 7,
}


def composite(config: dict[str, Any]) -> dict[str, Any]:
    """Hub layout: the text part under ``text_config``."""
    if "text_config" in config:
        return config
    return {"architectures": ["Gemma4ForConditionalGeneration"], "model_type": "gemma4",
            "tie_word_embeddings": True, "vocab_size": config["vocab_size"],
            "text_config": config}


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The text part, with top-level keys it lacks copied in (as the loader does)."""
    text = dict(config["text_config"])
    for key, value in config.items():
        if key != "text_config":
            text.setdefault(key, value)
    return text


def build_ours(config: dict[str, Any], dtype: mx.Dtype, seed: int) -> Gemma4Model:
    model = Gemma4Model(text_config(config))
    keys = mx.random.split(mx.random.key(seed), len(tree_flatten(model.parameters())))
    params = []
    for i, (name, value) in enumerate(tree_flatten(model.parameters())):
        if "norm" in name or name.endswith(("layer_scalar", ".scale", "per_expert_scale")):
            w = mx.ones(value.shape, dtype)
        else:  # trained-scale weights keep bf16 activations finite
            w = mx.random.normal(value.shape, dtype, key=keys[i]) * 0.02
        mx.eval(w)  # one tensor at a time: no float32 copy of the 2.3B-entry table
        params.append((name, w))
    model.load_weights(params)
    return model


def build_mlx_lm(config: dict[str, Any], ours: Gemma4Model) -> Any:
    from mlx_lm.models import gemma4 as mlx_lm_gemma4

    model = mlx_lm_gemma4.Model(mlx_lm_gemma4.ModelArgs.from_dict(config))
    # The same tensors (shared, not copied) under mlx-lm's names.
    weights = {"language_model." + name: value for name, value in
               tree_flatten(ours.parameters())}
    if any(".experts." in k for k in weights):
        weights = model.sanitize({"model.language_model." + k.removeprefix(
            "language_model.model."): v for k, v in weights.items()})
    model.load_weights(list(weights.items()))
    return model


def eval_cache(cache: list[Any]) -> None:
    mx.eval([c.state for c in cache if c is not None])


def run(model: Any, cache: list[Any], prompt: mx.array, new: int) -> dict[str, float]:
    """Prefill ``prompt[:-1]``, then ``new`` greedy steps starting from its last token."""
    mx.synchronize()
    start = time.perf_counter()
    model(prompt[None, :-1], cache=cache)
    eval_cache(cache)
    prefill_s = time.perf_counter() - start

    def step(y: mx.array) -> mx.array:
        logits = model(y, cache=cache)
        return mx.argmax(logits[:, -1, :], axis=-1, keepdims=True)

    y = step(prompt[None, -1:])  # the prompt's last token: the first decode step
    mx.async_eval(y)
    y.item()
    start = time.perf_counter()
    for _ in range(new):
        nxt = step(y)
        mx.async_eval(nxt)
        y.item()  # read the previous token while the next step runs
        y = nxt
    y.item()
    decode_s = time.perf_counter() - start
    return {"prefill_s": prefill_s, "prefill_tok_s": (prompt.size - 1) / prefill_s,
            "decode_s": decode_s, "decode_tok_s": new / decode_s}


def measure(rows: dict[str, Any], prompt: mx.array, new: int, repeats: int
            ) -> dict[str, dict[str, float]]:
    """Best of ``repeats`` timed runs per row, the rows taking turns (a busy machine
    slows them alike)."""
    for model in rows.values():
        run(model, model.make_cache(), prompt, min(new, 4))  # warm-up: trace, JIT, allocate
    best: dict[str, dict[str, float]] = {}
    for _ in range(repeats):
        for name, model in rows.items():
            result = run(model, model.make_cache(), prompt, new)
            gc.collect()
            kept = best.setdefault(name, result)
            for key in ("prefill", "decode"):
                if result[f"{key}_tok_s"] > kept[f"{key}_tok_s"]:
                    kept[f"{key}_s"], kept[f"{key}_tok_s"] = (result[f"{key}_s"],
                                                              result[f"{key}_tok_s"])
    for name, result in best.items():
        print(f"  {name:18s} prefill {result['prefill_tok_s']:10.1f} tok/s   "
              f"decode {result['decode_tok_s']:8.1f} tok/s", flush=True)
    return best


class _EagerSteps:
    """Our model with one-token steps built eagerly (no trace/replay), for comparison."""

    def __init__(self, model: Gemma4Model) -> None:
        self.model = model

    def make_cache(self) -> list[Any]:
        return self.model.make_cache()

    def __call__(self, ids: mx.array, cache: list[Any]) -> mx.array:
        self.model.compile_decode = False
        try:
            return self.model(ids, cache)
        finally:
            self.model.compile_decode = True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG,
                        help="a Gemma 4 config.json (default: E2B from the shared data, or "
                             "a built-in copy when that is absent)")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    parser.add_argument("--new", type=int, default=128, help="generated tokens")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per row (best kept)")
    parser.add_argument("--quick", action="store_true",
                        help="CPU-sized run: a scaled-down E2B layout, prompt 160, 16 new "
                             "tokens, best of 3")
    parser.add_argument("--no-eager", action="store_true",
                        help="skip the row with eager (uncompiled) decode steps")
    parser.add_argument("--no-mlx-lm", action="store_true", help="skip the mlx-lm comparison")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.quick:
        config, config_name = composite(QUICK_TEXT_CONFIG), "quick (E2B layout, scaled down)"
        args.prompt, args.new, args.repeats = 160, 16, 3
    elif args.config.is_file():
        config, config_name = composite(json.loads(args.config.read_text())), args.config.name
    elif args.config == DEFAULT_CONFIG:
        config, config_name = composite(E2B_TEXT_CONFIG), "E2B (built-in copy of the config)"
    else:
        print(f"gemma4 bench: config not found: {args.config}", file=sys.stderr)
        return 2
    dtype = DTYPES[args.dtype]
    device = str(mx.default_device())
    print(f"Gemma 4 bench: {config_name}, {args.dtype}, prompt {args.prompt}, "
          f"{args.new} new tokens, device {device}, mlx {mx.__version__}", flush=True)

    ours = build_ours(config, dtype, args.seed)
    prompt = mx.random.randint(0, ours.vocab_size, (args.prompt,), key=mx.random.key(args.seed))

    reference = reference_version = None
    if not args.no_mlx_lm:
        try:
            import mlx_lm

            reference = build_mlx_lm(config, ours)
            reference_version = mlx_lm.__version__
        except ImportError:
            print("  mlx-lm not importable: comparison skipped", flush=True)

    results: dict[str, Any] = {
        "config": config_name, "dtype": args.dtype, "prompt": args.prompt, "new": args.new,
        "device": device, "mlx": mx.__version__, "platform": platform.platform(),
        "mlx_lm": None,
    }
    if reference is not None:
        short = prompt[None, :16]
        diff = mx.abs(ours(short).astype(mx.float32) - reference(short).astype(mx.float32))
        results["parity_max_abs_logit_diff_16_tokens"] = diff.max().item()
        print(f"  parity: max |logit difference| over 16 tokens "
              f"{results['parity_max_abs_logit_diff_16_tokens']:.4g}", flush=True)

    rows: dict[str, Any] = {"mlxrunner": ours}
    if not args.no_eager:
        rows["mlxrunner (eager)"] = _EagerSteps(ours)
    if reference is not None:
        rows["mlx-lm"] = reference
    best = measure(rows, prompt, args.new, args.repeats)
    results["mlxrunner"] = best["mlxrunner"]
    if not args.no_eager:
        results["mlxrunner_eager_steps"] = best["mlxrunner (eager)"]
    if reference is not None:
        results["mlx_lm"] = best["mlx-lm"]
        results["mlx_lm"]["version"] = reference_version
        results["ratio"] = {
            key: results["mlxrunner"][f"{key}_tok_s"] / results["mlx_lm"][f"{key}_tok_s"]
            for key in ("prefill", "decode")}
        print(f"  ratio (mlxrunner / mlx-lm) prefill {results['ratio']['prefill']:6.2f}x   "
              f"decode {results['ratio']['decode']:6.2f}x", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2) + "\n")
        print(f"  wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
