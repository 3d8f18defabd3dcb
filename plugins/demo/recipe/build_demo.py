#!/usr/bin/env python3
"""Build mlxrunner's demo pair: a small Qwen3.5-architecture model and its DFlash2 draft.

Everything is deterministic given ``--seed`` and the interpreter (its standard library is the
corpus), and runs offline:

1. Corpus: the ``*.py`` files of the running interpreter's standard library
   (``sysconfig.get_paths()["stdlib"]``), site-packages excluded, files over 256 KB skipped,
   sorted by path. A seeded hash of each path holds out ``--heldout-fraction`` of the files.
2. Tokenizer: byte-level BPE trained with ``tokenizers`` on the training files
   (``--vocab-size``; ``<|endoftext|>`` id 0 is EOS and the document separator, ``<|mask|>``
   id 1 is the draft's mask token, ``<|pad|>`` id 2).
3. Target: ``Qwen3_5ForCausalLM`` (the hybrid Gated DeltaNet / full-attention pattern, tied
   embeddings) built by the registered ``mlxrunner-qwen3-5`` plugin, trained with MLX:
   AdamW, linear warm-up then cosine decay, gradient clipping, next-token cross-entropy on
   random windows of the training stream. Saved in the Hugging Face layout (zero-centred
   norms, ``[C, 1, K]`` convolution), bf16.
4. Draft: ``mlxrunner train-draft`` (``python -m mlxrunner_dflash.train``) trains a DFlash2
   draft against the frozen target on the same files, with self-distilled sequences mixed in.
5. Measure: the pair is loaded the way ``mlxrunner run`` loads it; held-out prompts are decoded
   greedily with and without the draft (tau, tokens/s, speedup, identical output).

Each phase stops at its step count or its time budget. Loss and throughput go to
``WORK/build_log.jsonl`` (JSON lines) and stdout; the figures to ``WORK/build_summary.json``.

    python plugins/demo/recipe/build_demo.py --out DIR [--preset gpu|cpu|tiny]
        [--target-steps N] [--draft-steps N] [--time-budget-s S] [--seed 0]

The default ``--out`` is the shipped folder, ``plugins/demo/mlxrunner_demo/model``.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import sysconfig
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

import mlxrunner

HERE = Path(__file__).resolve().parent
DEFAULT_OUT = HERE.parent / "mlxrunner_demo" / "model"
SPECIAL_TOKENS = ["<|endoftext|>", "<|mask|>", "<|pad|>"]
EOS, MASK, PAD = 0, 1, 2
EXCLUDED_PARTS = {"site-packages", "dist-packages", "__pycache__"}
MAX_FILE_BYTES = 256_000
DEFAULT_PROMPT = "def fibonacci(n):"
# Of the draft's time budget, at most, for self-distillation. The pool matters: labels are the
# target's greedy tokens, valid along a block only while the corpus follows the greedy chain,
# so only self-distilled text trains the deep block rows (a pool of 256 sequences was
# memorised: held-out top-1 fell from 0.47 to 0.39).
DISTILL_SHARE = 0.25
DISTILL_MIX = 0.7  # share of the draft's training windows drawn from the pool
TARGET_SHARE = 0.3  # of --time-budget-s for the target; the draft gets the rest
# The jinja renderer with this template passes the prompt through unchanged: the demo is a
# plain code model, not a chat model (the Modelfile picks it over the architecture's default).
PASSTHROUGH_TEMPLATE = ("{%- for message in messages %}{{ message['content'] }}"
                        "{%- endfor %}")
# Qwen3.5 norms whose Hugging Face weights are zero-centred (the model multiplies by 1 + w).
ZERO_CENTRED = (".input_layernorm.weight", ".post_attention_layernorm.weight",
                ".q_norm.weight", ".k_norm.weight")


@dataclass(frozen=True)
class Preset:
    """Sizes and schedules; ``gpu`` builds the shipped pair."""

    vocab_size: int
    hidden: int
    layers: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    linear_heads: int
    linear_head_dim: int
    target_batch: int
    target_seq_len: int
    target_steps: int
    target_lr: float
    draft_layers: int
    draft_intermediate: int
    draft_batch: int
    draft_seq_len: int
    draft_anchors: int
    draft_steps: int
    draft_lr: float
    selector_rank: int
    self_distill: int
    max_files: int = 0  # 0: all
    draft_block: int = 8  # the draft's block: at most block - 1 drafted tokens a round


PRESETS = {
    # The shipped pair: ~8.6M-parameter target, ~2M-parameter draft, ~21 MB in bf16.
    "gpu": Preset(vocab_size=8192, hidden=256, layers=8, intermediate=640, heads=4, kv_heads=2,
                  head_dim=64, linear_heads=4, linear_head_dim=64, target_batch=32,
                  target_seq_len=512, target_steps=6000, target_lr=1.5e-3, draft_layers=2,
                  draft_intermediate=512, draft_batch=16, draft_seq_len=512, draft_anchors=48,
                  draft_steps=8000, draft_lr=1e-3, selector_rank=32, self_distill=4096),
    # A smaller pair that trains in minutes on a laptop CPU.
    "cpu": Preset(vocab_size=4096, hidden=128, layers=4, intermediate=384, heads=2, kv_heads=1,
                  head_dim=64, linear_heads=2, linear_head_dim=64, target_batch=8,
                  target_seq_len=128, target_steps=600, target_lr=3e-3, draft_layers=1,
                  draft_intermediate=256, draft_batch=8, draft_seq_len=128, draft_anchors=12,
                  draft_steps=300, draft_lr=2e-3, selector_rank=16, self_distill=64),
    # Seconds: checks the recipe end to end (tests).
    "tiny": Preset(vocab_size=512, hidden=32, layers=4, intermediate=64, heads=2, kv_heads=1,
                   head_dim=16, linear_heads=2, linear_head_dim=8, target_batch=4,
                   target_seq_len=64, target_steps=20, target_lr=3e-3, draft_layers=1,
                   draft_intermediate=64, draft_batch=4, draft_seq_len=64, draft_anchors=6,
                   draft_steps=10, draft_lr=3e-3, selector_rank=8, self_distill=8,
                   max_files=40),
}


# -- logging ----------------------------------------------------------------------------------


class Log:
    """JSON lines to a file and a short line to stdout."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)

    def event(self, **fields: Any) -> None:
        with self.path.open("a", encoding="utf-8") as fh:
            fh.write(json.dumps(fields) + "\n")

    def say(self, message: str) -> None:
        print(message, flush=True)


# -- 1. corpus --------------------------------------------------------------------------------


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def select_corpus(root: Path, seed: int, heldout_fraction: float, max_files: int = 0
                  ) -> tuple[list[Path], list[Path]]:
    """(training files, held-out files) of the standard library, deterministically."""
    files = []
    for f in sorted(root.rglob("*.py")):
        rel = f.relative_to(root)
        if EXCLUDED_PARTS & set(rel.parts) or not f.is_file():
            continue
        if f.stat().st_size > MAX_FILE_BYTES:
            continue
        try:
            f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        files.append(f)
    if max_files:
        rng = np.random.default_rng(seed)
        keep = sorted(rng.choice(len(files), size=min(max_files, len(files)), replace=False))
        files = [files[i] for i in keep]
    train, held = [], []
    for f in files:
        key = f.relative_to(root).as_posix()
        digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
        (held if int.from_bytes(digest[:8], "big") / 2.0 ** 64 < heldout_fraction
         else train).append(f)
    if not held:
        held.append(train.pop())
    return train, held


def corpus_digest(files: Sequence[Path], root: Path) -> str:
    h = hashlib.sha256()
    for f in files:
        h.update(f.relative_to(root).as_posix().encode())
        h.update(hashlib.sha256(f.read_bytes()).digest())
    return h.hexdigest()[:16]


# -- 2. tokenizer -----------------------------------------------------------------------------


def train_tokenizer(files: Sequence[Path], vocab_size: int, out: Path) -> Any:
    """Byte-level BPE; writes tokenizer.json and tokenizer_config.json into ``out``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=2,
                                  special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    texts = [f.read_text(encoding="utf-8") for f in files]
    tok.train_from_iterator(texts, trainer, length=len(texts))
    for i, name in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(name) == i, (name, tok.token_to_id(name))
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": "<|endoftext|>",
        "pad_token": "<|pad|>",
        "mask_token": "<|mask|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 4096,
        "chat_template": PASSTHROUGH_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n",
                                               encoding="utf-8")
    return tok


def encode_files(tok: Any, files: Sequence[Path]) -> np.ndarray:
    """Every file's ids followed by EOS (the document separator), one int32 stream."""
    texts = [f.read_text(encoding="utf-8") for f in files]
    parts = []
    for enc in tok.encode_batch(texts, add_special_tokens=False):
        parts.append(np.asarray(enc.ids, dtype=np.int32))
        parts.append(np.asarray([EOS], dtype=np.int32))
    return np.concatenate(parts)


# -- 3. target --------------------------------------------------------------------------------


def target_config(p: Preset) -> dict[str, Any]:
    """config.json of the target, as transformers writes a text-only Qwen3.5 model."""
    layer_types = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
                   for i in range(p.layers)]
    rotary_pairs = int(p.head_dim * 0.25) // 2
    third = rotary_pairs // 3
    return {
        "architectures": ["Qwen3_5ForCausalLM"],
        "model_type": "qwen3_5_text",
        "vocab_size": p.vocab_size,
        "hidden_size": p.hidden,
        "intermediate_size": p.intermediate,
        "num_hidden_layers": p.layers,
        "num_attention_heads": p.heads,
        "num_key_value_heads": p.kv_heads,
        "head_dim": p.head_dim,
        "hidden_act": "silu",
        "layer_types": layer_types,
        "full_attention_interval": 4,
        "linear_conv_kernel_dim": 4,
        "linear_num_key_heads": p.linear_heads,
        "linear_num_value_heads": p.linear_heads,
        "linear_key_head_dim": p.linear_head_dim,
        "linear_value_head_dim": p.linear_head_dim,
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                            "partial_rotary_factor": 0.25,
                            "mrope_section": [third, third, rotary_pairs - 2 * third]},
        "tie_word_embeddings": True,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "initializer_range": 0.02,
        "use_cache": True,
        "bos_token_id": None,
        "eos_token_id": EOS,
        "pad_token_id": PAD,
        # Weights are stored in bf16 (half the size); the declared dtype is what the model
        # computes in: float32, so that a verify block and a decode step round alike and
        # greedy speculative output equals plain decoding on every backend.
        "dtype": "float32",
    }


def build_target(config: dict[str, Any], seed: int, embed_std: float = 0.02
                 ) -> mlxrunner.Model:
    """A fresh model of the registered Qwen3.5 architecture (random weights: N(0, 0.02)
    matrices, residual outputs scaled down by sqrt(2 * layers), the embedding N(0, embed_std))."""
    mx.random.seed(seed)
    model = mlxrunner.build_model(config)
    rng = np.random.default_rng(seed)
    n_layers = config["num_hidden_layers"]
    new = []
    for name, value in tree_flatten(model.parameters()):
        shape = tuple(value.shape)
        if name.endswith(("A_log", "dt_bias", "conv1d.weight")) or name.endswith("norm.weight"):
            new.append((name, value))  # the architecture's own initialisation
            continue
        std = embed_std if name.endswith("embed_tokens.weight") else 0.02
        if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight")):
            std = 0.02 / math.sqrt(2 * n_layers)  # residual branches start small
        new.append((name, mx.array((std * rng.standard_normal(shape)).astype(np.float32))))
    model.update(tree_unflatten(new))
    mx.eval(model.parameters())
    return model


def preflight(config: dict[str, Any], seed: int) -> None:
    """One tiny training step and one tapped forward on this device, before the long work:
    a backend that cannot differentiate some op fails here, in seconds, with its message."""
    model = build_target({**config, "vocab_size": 512}, seed)
    x = mx.array(np.random.default_rng(seed).integers(0, 512, size=(2, 70)), dtype=mx.int32)

    def loss_fn(m: nn.Module, ids: mx.array) -> mx.array:
        return nn.losses.cross_entropy(m(ids[:, :-1]).astype(mx.float32), ids[:, 1:]).mean()

    loss, grads = nn.value_and_grad(model, loss_fn)(model, x)
    _, tapped = model(x, taps=[0, model.num_layers - 1])
    mx.eval(loss, grads, tapped)
    bad = [k for k, v in tree_flatten(grads) if not bool(mx.all(mx.isfinite(v)).item())]
    if bad or not math.isfinite(loss.item()):
        raise SystemExit(f"preflight: non-finite loss or gradients ({bad[:3]}) on "
                         f"{mx.default_device()}")


def lr_at(step: int, total: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t)))


def windows(rng: np.random.Generator, stream: np.ndarray, batch: int, length: int) -> np.ndarray:
    starts = rng.integers(0, stream.shape[0] - length - 1, size=batch)
    return np.stack([stream[s:s + length + 1] for s in starts])


def heldout_loss(model: mlxrunner.Model, stream: np.ndarray, seq_len: int, batches: int = 4,
                 batch: int = 8) -> float:
    rng = np.random.default_rng(4321)
    losses = []
    for _ in range(batches):
        x = mx.array(windows(rng, stream, batch, seq_len))
        logits = model(x[:, :-1])
        losses.append(nn.losses.cross_entropy(logits.astype(mx.float32), x[:, 1:]).mean().item())
    return float(np.mean(losses))


def train_target(model: mlxrunner.Model, train: np.ndarray, held: np.ndarray, p: Preset,
                 steps: int, budget_s: float, seed: int, log: Log,
                 compile_step: bool = False) -> dict[str, Any]:
    """Next-token training; stops at ``steps`` or ``budget_s`` (the cosine re-planned to fit)."""
    rng = np.random.default_rng(seed)
    optimizer = optim.AdamW(learning_rate=p.target_lr, betas=[0.9, 0.95], weight_decay=0.1)

    def loss_fn(m: nn.Module, x: mx.array) -> mx.array:
        logits = m(x[:, :-1])
        return nn.losses.cross_entropy(logits.astype(mx.float32), x[:, 1:]).mean()

    value_and_grad = nn.value_and_grad(model, loss_fn)

    def step_fn(x: mx.array) -> mx.array:
        loss, grads = value_and_grad(model, x)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        optimizer.update(model, grads)
        return loss

    state = [model.state, optimizer.state]
    compiled = mx.compile(step_fn, inputs=state, outputs=state)
    total = steps
    warmup = max(10, min(200, total // 20))
    tokens = p.target_batch * p.target_seq_len
    t_begin = time.perf_counter()
    first_loss = None
    recent: list[float] = []
    step = 0
    # mx.compile fuses the step's element-wise work, but tracing the chunked DeltaNet graph
    # took a minute on the CPU here (and the steps were no faster): opt-in.
    use_compiled = compile_step
    log.say(f"target: {sum(v.size for _, v in tree_flatten(model.parameters())) / 1e6:.2f}M "
            f"parameters, {train.size} training tokens, batch {p.target_batch} x "
            f"{p.target_seq_len}, up to {steps} steps"
            + (f" or {budget_s:.0f}s" if budget_s else ""))
    while step < total:
        elapsed = time.perf_counter() - t_begin
        if budget_s and elapsed > budget_s:
            break
        x = mx.array(windows(rng, train, p.target_batch, p.target_seq_len))
        optimizer.learning_rate = lr_at(step, total, p.target_lr, warmup)
        t0 = time.perf_counter()
        if use_compiled:
            try:
                loss = compiled(x)
                mx.eval(loss, state)
            except Exception as exc:  # a backend without compile support for some op
                log.say(f"target: compiled step failed ({type(exc).__name__}: {exc}); "
                        "continuing uncompiled")
                use_compiled = False
                loss = step_fn(x)
                mx.eval(loss, state)
        else:
            loss = step_fn(x)
            mx.eval(loss, state)
        dt = time.perf_counter() - t0
        step += 1
        value = float(loss.item())
        if first_loss is None:
            first_loss = value
        recent = (recent + [value])[-20:]
        if budget_s and step == 30:
            per_step = (time.perf_counter() - t_begin) / step
            total = min(steps, step + max(1, int((budget_s - (time.perf_counter() - t_begin))
                                                 / per_step)))
        if step % 25 == 0 or step == 1 or step == total:
            log.event(phase="target", step=step, loss=value, lr=float(optimizer.learning_rate),
                      tokens_per_second=tokens / dt, elapsed_s=time.perf_counter() - t_begin)
            log.say(f"target step {step}/{total} loss {value:.4f} "
                    f"({tokens / dt / 1000:.1f}k tok/s)")
    seconds = time.perf_counter() - t_begin
    final = float(np.mean(recent)) if recent else float("nan")
    held_loss = heldout_loss(model, held, p.target_seq_len)
    result = {"steps": step, "tokens": step * tokens, "seconds": round(seconds, 1),
              "first_loss": first_loss, "final_train_loss": final,
              "heldout_loss": held_loss, "heldout_perplexity": math.exp(held_loss),
              "tokens_per_second": step * tokens / seconds if seconds else 0.0}
    log.event(phase="target", event="done", **result)
    log.say(f"target: {step} steps in {seconds:.0f}s, train loss {final:.4f}, held-out "
            f"{held_loss:.4f} (perplexity {math.exp(held_loss):.2f})")
    return result


def to_hf_weights(model: mlxrunner.Model, dtype: mx.Dtype) -> dict[str, mx.array]:
    """The model's tensors in the Hugging Face layout (what ``sanitize`` maps back)."""
    out = {}
    for name, value in tree_flatten(model.parameters()):
        value = value.astype(mx.float32)
        if name.endswith("conv1d.weight") and value.ndim == 3:
            value = value.swapaxes(1, 2)  # MLX [C, K, 1] -> Hugging Face [C, 1, K]
        out[name] = value.astype(dtype)
    return out


def save_target(model: mlxrunner.Model, config: dict[str, Any], out: Path, p: Preset) -> None:
    out.mkdir(parents=True, exist_ok=True)
    mx.save_safetensors(str(out / "model.safetensors"), to_hf_weights(model, mx.bfloat16),
                        metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    generation = {"bos_token_id": None, "eos_token_id": EOS, "pad_token_id": PAD,
                  "do_sample": False, "max_new_tokens": 128}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n",
                                                encoding="utf-8")
    (out / "Modelfile").write_text(
        "# The demo is a plain code model: the prompt goes in as is (see tokenizer_config's\n"
        "# pass-through chat template), decoded greedily with its DFlash2 draft (draft/).\n"
        "FROM .\nRENDERER jinja\nPARAMETER temperature 0\nPARAMETER num_predict 128\n",
        encoding="utf-8")


def check_reload(model: mlxrunner.Model, out: Path, stream: np.ndarray) -> float:
    """Max |logit difference| between the trained model (cast to bf16) and the saved folder."""
    loaded = mlxrunner.load_model(out)
    x = mx.array(stream[None, :64])
    mine = model(x).astype(mx.float32)
    theirs = loaded(x).astype(mx.float32)
    return float(mx.abs(mine - theirs).max().item())


# -- 4. draft ---------------------------------------------------------------------------------


def train_draft(out: Path, work: Path, train_list: Path, held_list: Path, p: Preset,
                steps: int, budget_s: float, seed: int, log: Log,
                keep_checkpoint: bool = False, distill_s: float | None = None
                ) -> dict[str, Any]:
    """Runs ``train-draft`` as its own process (as a user would); copies the draft into place."""
    draft_work = work / "draft"
    command = [sys.executable, "-m", "mlxrunner_dflash.train", str(out),
               "--corpus-list", str(train_list), "--heldout-list", str(held_list),
               "--out", str(draft_work), "--kind", "dflash2", "--steps", str(steps),
               "--batch", str(p.draft_batch), "--seq-len", str(p.draft_seq_len),
               "--anchors", str(p.draft_anchors), "--lr", str(p.draft_lr),
               "--layers", str(p.draft_layers), "--intermediate-size",
               str(p.draft_intermediate), "--selector-rank", str(p.selector_rank),
               "--self-distill", str(p.self_distill), "--distill-mix", str(DISTILL_MIX),
               "--block-size", str(p.draft_block),
               "--save-dtype", "bfloat16", "--seed", str(seed), "--log", str(log.path),
               "--eval-prompts", "0", "--save-every", "0"]
    if budget_s:
        distill_s = DISTILL_SHARE * budget_s if distill_s is None else distill_s
        command += ["--time-budget-s", str(budget_s), "--distill-time-s", str(round(distill_s, 1))]
    log.say("draft: " + " ".join(command))
    env = dict(os.environ)
    completed = subprocess.run(command, env=env)
    if completed.returncode != 0:
        raise SystemExit(f"train-draft failed with exit status {completed.returncode}")
    report = json.loads((draft_work / "report.json").read_text(encoding="utf-8"))
    if not keep_checkpoint:  # float32 weights + optimizer moments: 6x the draft's size
        shutil.rmtree(draft_work / "checkpoint", ignore_errors=True)
    (out / "draft").mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copyfile(draft_work / name, out / "draft" / name)
    return report


# -- 5. measure -------------------------------------------------------------------------------


def measure(out: Path, prompts: list[str], max_tokens: int, log: Log) -> dict[str, Any]:
    """Greedy decoding with and without the draft, as ``mlxrunner run`` does it."""
    bundle = mlxrunner.load(str(out))
    options = mlxrunner.SamplerOptions(temperature=0.0)
    tok = bundle.tokenizer
    eos = tok.eos_ids
    model, draft = bundle.model, bundle.draft
    rows = []
    for text in prompts:
        ids = tok.encode(text)
        # an untimed run of each mode first: every traced shape the timed runs meet is built
        mlxrunner.generate(model, ids, options=options, max_tokens=max_tokens, draft=draft,
                           eos_ids=eos)
        mlxrunner.generate(model, ids, options=options, max_tokens=max_tokens, eos_ids=eos)
        spec = mlxrunner.generate(model, ids, options=options, max_tokens=max_tokens,
                                  draft=draft, eos_ids=eos)
        plain = mlxrunner.generate(model, ids, options=options, max_tokens=max_tokens,
                                   eos_ids=eos)
        s, q = spec.stats, plain.stats
        rows.append({"prompt": text[:40], "tokens": s.generated_tokens,
                     "plain_tokens": q.generated_tokens, "rounds": s.rounds,
                     "committed": s.committed_in_rounds, "tau": round(s.tau, 3),
                     "speculative_tps": round(s.tokens_per_second, 1),
                     "plain_tps": round(q.tokens_per_second, 1),
                     "spec_seconds": s.decode_seconds, "plain_seconds": q.decode_seconds,
                     "identical": spec.tokens == plain.tokens,
                     "text": tok.decode(plain.tokens)[:200]})
        log.event(phase="measure", **{k: v for k, v in rows[-1].items() if k != "text"})
    rounds = sum(r["rounds"] for r in rows)
    committed = sum(r["committed"] for r in rows)
    spec_tokens = sum(r["tokens"] for r in rows)
    plain_tokens = sum(r["plain_tokens"] for r in rows)
    spec_s = sum(r["spec_seconds"] for r in rows)
    plain_s = sum(r["plain_seconds"] for r in rows)
    result = {"device": str(mx.default_device()), "prompts": len(rows),
              "max_tokens": max_tokens, "tau": committed / rounds if rounds else 0.0,
              "speculative_tokens_per_second": spec_tokens / spec_s if spec_s else 0.0,
              "plain_tokens_per_second": plain_tokens / plain_s if plain_s else 0.0,
              "speedup": (spec_tokens / spec_s) / (plain_tokens / plain_s)
              if spec_s and plain_s and plain_tokens else 0.0,
              "identical_to_plain": all(r["identical"] for r in rows), "per_prompt": rows}
    log.say(f"measured on {result['device']}: tau {result['tau']:.2f}, "
            f"{result['speculative_tokens_per_second']:.1f} vs "
            f"{result['plain_tokens_per_second']:.1f} tok/s (speedup {result['speedup']:.2f}x), "
            f"identical output: {result['identical_to_plain']}")
    return result


def measurement_prompts(held: Sequence[Path], count: int, seed: int) -> list[str]:
    """The CLI's default prompt plus the first lines of a few held-out files."""
    rng = np.random.default_rng(seed + 5)
    prompts = [DEFAULT_PROMPT]
    picked = rng.choice(len(held), size=min(count, len(held)), replace=False)
    for i in sorted(picked):
        text = held[i].read_text(encoding="utf-8")
        lines = [ln for ln in text.splitlines() if ln.strip()][:6]
        if lines:
            prompts.append("\n".join(lines) + "\n")
    return prompts[:count + 1]


def folder_size(out: Path) -> dict[str, int]:
    sizes = {str(f.relative_to(out)): f.stat().st_size for f in sorted(out.rglob("*"))
             if f.is_file()}
    sizes["total"] = sum(sizes.values())
    return sizes


def card_figures(summary: dict[str, Any]) -> str:
    """The model card's figures as a Markdown table (pasted into MODEL_CARD.md)."""
    c, m, d = summary["corpus"], summary["measure"], summary["draft"]
    t = summary.get("target", {})
    rows = [
        ("corpus", f"Python {c['python']} stdlib: {c['train_files']} training files "
                   f"({c['train_bytes'] / 1e6:.1f} MB, {c.get('train_tokens', '?')} tokens), "
                   f"{c['heldout_files']} held out ({c.get('heldout_tokens', '?')} tokens); "
                   f"digest {c['digest']}"),
        ("target", f"{t.get('parameters', '?')} parameters; {t.get('steps', '?')} steps, "
                   f"{t.get('tokens', '?')} tokens, {t.get('seconds', '?')} s "
                   f"({t.get('tokens_per_second', 0):.0f} tok/s)"),
        ("target loss", f"train {t.get('first_loss', float('nan')):.3f} -> "
                        f"{t.get('final_train_loss', float('nan')):.3f}; held-out "
                        f"{t.get('heldout_loss', float('nan')):.3f} (perplexity "
                        f"{t.get('heldout_perplexity', float('nan')):.1f})"),
        ("draft", f"DFlash2, {d['draft_parameters']} parameters, taps {d['taps']}; "
                  f"{d['steps']} steps, {d['tokens_seen']} tokens, {d['train_seconds']} s"),
        ("draft loss", f"train CE {d['first_loss_ce']:.3f} -> {d['final_loss_ce']:.3f}; "
                       f"held-out {d['heldout_loss']:.3f}, top-1 {d['heldout_accuracy']:.3f}"),
        ("tau estimate", f"{d['tau_estimate']:.2f} over {d['blocks']} held-out blocks"),
        (f"decoding ({m['device']})", f"tau {m['tau']:.2f}; "
                                      f"{m['speculative_tokens_per_second']:.1f} vs "
                                      f"{m['plain_tokens_per_second']:.1f} tok/s plain, "
                                      f"speedup {m['speedup']:.2f}x; identical output: "
                                      f"{m['identical_to_plain']} ({m['prompts']} prompts x "
                                      f"{m['max_tokens']} tokens)"),
        ("size", f"{summary['sizes']['total'] / 1e6:.2f} MB"),
    ]
    lines = ["| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in rows]
    per = ["", "| prompt | tau | speculative tok/s | plain tok/s |", "|---|---|---|---|"]
    for r in m["per_prompt"]:
        prompt = r["prompt"].replace("\n", "\\n").replace("|", "\\|")
        per.append(f"| `{prompt}` | {r['tau']} | {r['speculative_tps']} | {r['plain_tps']} |")
    return "\n".join(lines + per) + "\n"


# -- main -------------------------------------------------------------------------------------


def _block_size(text: str) -> int:
    """A draft block size: 2 (one drafted token a round) to 16 (the longest block the
    architectures trace)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if not 2 <= value <= 16:
        raise argparse.ArgumentTypeError(f"{text!r}: a block size from 2 to 16")
    return value


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="model folder to write")
    ap.add_argument("--work", type=Path, default=None,
                    help="logs, corpus lists, draft checkpoints (default: OUT.build, or "
                         "recipe/build for the shipped folder)")
    ap.add_argument("--preset", choices=sorted(PRESETS), default="gpu")
    ap.add_argument("--target-steps", type=int, default=None)
    ap.add_argument("--draft-steps", type=int, default=None)
    ap.add_argument("--time-budget-s", type=float, default=0.0,
                    help="total training time: 62%% target, 38%% draft (0: steps only)")
    ap.add_argument("--target-budget-s", type=float, default=None)
    ap.add_argument("--draft-budget-s", type=float, default=None)
    ap.add_argument("--heldout-fraction", type=float, default=0.03)
    ap.add_argument("--self-distill", type=int, default=None,
                    help="greedy target sequences mixed into the draft's training")
    ap.add_argument("--draft-layers", type=int, default=None, help="override the preset's")
    ap.add_argument("--draft-block", type=_block_size, default=None,
                    help="the draft's block size, 2-16 (default: the preset's, 8)")
    ap.add_argument("--distill-time-s", type=float, default=None,
                    help=f"self-distillation's time (default: {round(100 * DISTILL_SHARE)}%% of "
                    "the draft's budget)")
    ap.add_argument("--skip-target", action="store_true",
                    help="keep the target (and tokenizer) already in OUT; train the draft only")
    ap.add_argument("--keep-checkpoint", action="store_true",
                    help="keep the draft's training checkpoint (WORK/draft/checkpoint)")
    ap.add_argument("--compile", action="store_true",
                    help="mx.compile the target's training step (slow to trace)")
    ap.add_argument("--measure-only", action="store_true",
                    help="only measure the pair already in OUT (tau, speedup) on this device")
    ap.add_argument("--measure-prompts", type=int, default=4)
    ap.add_argument("--measure-tokens", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    preset = PRESETS[args.preset]
    if args.self_distill is not None:
        preset = replace(preset, self_distill=args.self_distill)
    if args.draft_layers is not None:
        preset = replace(preset, draft_layers=args.draft_layers)
    if args.draft_block is not None:
        preset = replace(preset, draft_block=args.draft_block)
    out: Path = args.out.resolve()
    if args.work is not None:
        work = args.work.resolve()
    elif out == DEFAULT_OUT.resolve():
        work = HERE / "build"  # beside the recipe, ignored by git (build/)
    else:
        work = out.with_name(out.name + ".build")
    work.mkdir(parents=True, exist_ok=True)
    log = Log(work / "build_log.jsonl")
    t_all = time.perf_counter()
    budget = args.time_budget_s
    target_budget = (args.target_budget_s if args.target_budget_s is not None
                     else TARGET_SHARE * budget)
    draft_budget = (args.draft_budget_s if args.draft_budget_s is not None
                    else (1 - TARGET_SHARE) * budget)
    target_steps = args.target_steps or preset.target_steps
    draft_steps = args.draft_steps or preset.draft_steps
    log.event(phase="start", preset=args.preset, settings=asdict(preset),
              target_steps=target_steps, draft_steps=draft_steps,
              target_budget_s=target_budget, draft_budget_s=draft_budget, seed=args.seed,
              python=platform.python_version(), mlx=mx.__version__,
              device=str(mx.default_device()))

    root = stdlib_root()
    train_files, held_files = select_corpus(root, args.seed, args.heldout_fraction,
                                            preset.max_files)
    if args.measure_only:
        result = measure(out, measurement_prompts(held_files, args.measure_prompts, args.seed),
                         args.measure_tokens, log)
        name = f"measure_{mx.default_device().type.name}.json"
        (work / name).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        log.say(f"written {work / name}")
        return 0
    if not args.skip_target:
        preflight(target_config(preset), args.seed)
    train_list, held_list = work / "corpus_train.txt", work / "corpus_heldout.txt"
    train_list.write_text("".join(f"{f}\n" for f in train_files), encoding="utf-8")
    held_list.write_text("".join(f"{f}\n" for f in held_files), encoding="utf-8")
    corpus = {"root": str(root), "python": platform.python_version(),
              "train_files": len(train_files), "heldout_files": len(held_files),
              "train_bytes": sum(f.stat().st_size for f in train_files),
              "heldout_bytes": sum(f.stat().st_size for f in held_files),
              "digest": corpus_digest(train_files + held_files, root)}
    log.say(f"corpus: {corpus['train_files']} training files ({corpus['train_bytes'] / 1e6:.1f} "
            f"MB), {corpus['heldout_files']} held out, from {root}")

    summary: dict[str, Any] = {"preset": args.preset, "seed": args.seed, "corpus": corpus,
                               "settings": asdict(preset)}
    if args.skip_target:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    else:
        t0 = time.perf_counter()
        tok = train_tokenizer(train_files, preset.vocab_size, out)
        summary["tokenizer"] = {"vocab_size": tok.get_vocab_size(),
                                "seconds": round(time.perf_counter() - t0, 1)}
    train_stream = encode_files(tok, train_files)
    held_stream = encode_files(tok, held_files)
    corpus.update(train_tokens=int(train_stream.size), heldout_tokens=int(held_stream.size),
                  bytes_per_token=round(corpus["train_bytes"] / train_stream.size, 3))
    log.event(phase="corpus", **corpus)

    if not args.skip_target:
        config = target_config(preset)
        model = build_target(config, args.seed)
        summary["target"] = train_target(model, train_stream, held_stream, preset, target_steps,
                                         target_budget, args.seed, log, args.compile)
        summary["target"]["parameters"] = int(sum(v.size for _, v in
                                                  tree_flatten(model.parameters())))
        save_target(model, config, out, preset)
        summary["target"]["reload_max_abs_logit_diff"] = check_reload(model, out, held_stream)
        del model
    summary["draft"] = train_draft(out, work, train_list, held_list, preset, draft_steps,
                                   draft_budget, args.seed, log, args.keep_checkpoint,
                                   args.distill_time_s)
    summary["measure"] = measure(out, measurement_prompts(held_files, args.measure_prompts,
                                                          args.seed),
                                 args.measure_tokens, log)
    summary["sizes"] = folder_size(out)
    summary["total_seconds"] = round(time.perf_counter() - t_all, 1)
    (work / "build_summary.json").write_text(json.dumps(summary, indent=2) + "\n",
                                             encoding="utf-8")
    (work / "model_card_figures.md").write_text(card_figures(summary), encoding="utf-8")
    log.event(phase="done", total_seconds=summary["total_seconds"],
              bytes=summary["sizes"]["total"])
    log.say(f"done in {summary['total_seconds']:.0f}s: {out} "
            f"({summary['sizes']['total'] / 1e6:.2f} MB); summary in "
            f"{work / 'build_summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
