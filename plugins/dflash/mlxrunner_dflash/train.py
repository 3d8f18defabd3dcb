"""``mlxrunner train-draft``: train a DFlash or DFlash2 draft for any target with layer taps.

The target stays frozen. Every step takes ``batch`` windows of ``seq_len`` tokens from the
corpus, runs the target once over them with taps (the draft's context rows, computed on the
fly, no cache of hidden states on disk), picks ``anchors`` random positions per window and
trains every anchor's block at once::

    queries:  block_0 | block_1 | ...            (each [anchor token, mask x (block_size - 1)])
    keys:     context rows 0..L-1 | block_0 | block_1 | ...

Block ``a`` (anchored at position ``a``) sees the context rows before ``a`` and, in both
directions, its own rows; never another block. That is the attention a round at inference
sees, so one forward trains ``batch * anchors`` rounds. Row ``k`` of a block predicts the
token at ``a + k``; its cross-entropy is weighted ``exp(-(k - 1) / gamma)`` (early rows
decide how many drafts a round keeps).

Labels are the target's own greedy tokens (``--labels target``, the default): row ``k``'s
label is the target's argmax after ``a + k - 1``, teacher-forced on the corpus, and counts
only while the corpus agrees with the target's greedy chain before it (afterwards the chain
at inference would differ from the corpus, so the label would be wrong). ``--self-distill N``
first generates N greedy continuations with the target and mixes them into the batches, which
puts the draft on the target's own distribution. ``--labels corpus`` uses corpus tokens.

DFlash2 adds a candidate-selector loss: for each row the head's top-K candidates are scored
with the pairwise term given the previous label (teacher forcing; the anchor for row 1), and
the correct candidate's slot is trained with cross-entropy.

``--anchor-on target`` anchors blocks only on tokens the target wrote itself (the corpus
token is its greedy pick after the one before), where a round's anchor always is: in a corpus
of its own replies, the replies, not the prompts around them.

The draft is built by this plugin's classes and its context, projections, norms and
convolutions are called as they are at inference; only the attention runs in this
block-masked form. ``tests/test_dflash_train.py`` checks one block against the plugin's own
speculative session.

The trainer checkpoints (draft, optimizer and data-stream state) every ``--save-every``
steps and at the end, each checkpoint written to a temporary folder and swapped in whole;
``--resume`` continues a run from ``OUT/checkpoint``. The finished
draft is ``OUT/config.json`` + ``OUT/model.safetensors``, which ``--draft OUT`` loads. The
final report measures the mean accepted length (tau) on held-out text: the greedy-agreement
estimate over held-out blocks, and the real speculative loop (``mlxrunner.generate``) on a
few held-out prompts with its speedup over plain decoding. The estimate's blocks are anchored
as rounds are, on the target's own tokens, and its loss is weighted as training's is, so on
the training text it gives the training batches' figures. Its text (``--eval-text``): the
target's continuations of held-out windows, each up to its first EOS (decoding stops there),
or the held-out documents as they are, one per row (a corpus of the target's replies).
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, cast

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

import mlxrunner.plugin as mp
from mlxrunner.plugin import DraftConfigError, ModelFolderError

from .dflash import DFlashDraftModel
from .dflash2 import DFlash2DraftModel
from .train_options import HELP, KIND_NAMES, TrainSettings, add_arguments

__all__ = ["HELP", "KIND_NAMES", "TrainSettings", "add_arguments", "run", "train_draft"]

KINDS = {"dflash": DFlashDraftModel, "dflash2": DFlash2DraftModel}
ARCHITECTURES = {"dflash": "DFlashDraftModel", "dflash2": "DFlash2DraftModel"}
MASK_TOKEN_NAMES = ("<|mask|>", "<mask>", "<|MASK|>", "[MASK]", "<|mask_token|>")
CHECKPOINT_DIR = "checkpoint"


class TrainDraftError(mp.MLXRunnerError):
    """A train-draft input problem (one line, no traceback)."""


# -- corpus -----------------------------------------------------------------------------------


def expand_corpus(paths: Sequence[str], glob: str = "*") -> list[Path]:
    """Files named directly, plus every file under named folders matching ``glob``; sorted."""
    files: list[Path] = []
    for raw in paths:
        p = Path(raw).expanduser()
        if p.is_dir():
            found = [f for f in p.rglob("*") if f.is_file() and fnmatch.fnmatch(f.name, glob)]
            files.extend(sorted(found))
        elif p.is_file():
            files.append(p)
        else:
            raise TrainDraftError(f"{p}: corpus file or folder not found")
    return files


def read_list_file(path: str) -> list[str]:
    """A file naming corpus files, one per line (blank lines and # comments skipped)."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise TrainDraftError(f"{path}: cannot read list file ({exc.strerror})") from None
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def read_documents(files: Sequence[Path]) -> list[str]:
    """The UTF-8 text of each file; files that are not UTF-8 text are skipped."""
    docs = []
    for f in files:
        try:
            text = f.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if text.strip() and "\x00" not in text:
            docs.append(text)
    return docs


def is_heldout(key: str, seed: int, fraction: float) -> bool:
    """A deterministic, seeded choice of held-out documents by name."""
    digest = hashlib.sha256(f"{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2.0 ** 64 < fraction


def encode_documents(tokenizer: Any, docs: Sequence[str]) -> list[np.ndarray]:
    """Each document's ids (int32), no special tokens added."""
    backend = getattr(tokenizer, "backend", None)
    if backend is not None and hasattr(backend, "encode_batch"):
        encoded = [e.ids for e in backend.encode_batch(list(docs), add_special_tokens=False)]
    else:
        encoded = [tokenizer.encode(d) for d in docs]
    return [np.asarray(ids, dtype=np.int32) for ids in encoded]


def token_stream(tokenizer: Any, docs: Sequence[str], eos_id: int) -> np.ndarray:
    """Every document's ids followed by EOS, concatenated (int32)."""
    parts = []
    for ids in encode_documents(tokenizer, docs):
        parts.append(ids)
        parts.append(np.asarray([eos_id], dtype=np.int32))
    return np.concatenate(parts) if parts else np.zeros((0,), dtype=np.int32)


def sample_windows(rng: np.random.Generator, stream: np.ndarray, batch: int,
                   length: int) -> np.ndarray:
    """``batch`` random windows of ``length`` tokens: [batch, length] int32."""
    if stream.shape[0] <= length:
        raise TrainDraftError(f"the corpus has {stream.shape[0]} tokens, fewer than one window "
                              f"of {length}: give more text or a smaller --seq-len")
    starts = rng.integers(0, stream.shape[0] - length, size=batch)
    return np.stack([stream[s:s + length] for s in starts]).astype(np.int32)


# -- anchors, masks, labels -------------------------------------------------------------------


def sample_anchors(rng: np.random.Generator, batch: int, seq_len: int, block_size: int,
                   count: int, low: int = 1) -> np.ndarray:
    """``count`` distinct anchor positions per window, sorted: [batch, count].

    An anchor ``a`` needs at least one context row (``a >= low >= 1``) and its block's labels
    inside the window (``a + block_size - 1 <= seq_len - 1``).
    """
    low, high = max(1, low), seq_len - block_size  # inclusive
    choices = high - low + 1
    if choices < 1:
        raise TrainDraftError(f"--seq-len {seq_len} is too short for blocks of {block_size}")
    count = min(count, choices)
    out = np.empty((batch, count), dtype=np.int32)
    for b in range(batch):
        out[b] = np.sort(rng.choice(choices, size=count, replace=False)) + low
    return out


def sample_anchors_where(rng: np.random.Generator, allowed: np.ndarray, block_size: int,
                         count: int) -> tuple[np.ndarray, np.ndarray]:
    """``count`` distinct anchors per window among the positions ``allowed`` [B, L] marks
    (those leaving room for a block, ``1 <= a <= L - block_size``), sorted, and which of them
    are real: ([B, count] int32, [B, count] bool). A window with fewer allowed positions
    takes them all and fills its other slots with its first one, marked not real (the batch
    keeps its shape; those blocks carry no weight)."""
    B, L = allowed.shape
    if L - block_size < 1:
        raise TrainDraftError(f"--seq-len {L} is too short for blocks of {block_size}")
    room = allowed.copy()
    room[:, 0] = False
    room[:, L - block_size + 1:] = False
    anchors = np.ones((B, count), dtype=np.int32)
    real = np.zeros((B, count), dtype=bool)
    for b in range(B):
        positions = np.flatnonzero(room[b])
        if positions.size == 0:
            continue
        take = min(count, positions.size)
        picked = np.sort(rng.choice(positions, size=take, replace=False))
        anchors[b, :take] = picked
        anchors[b, take:] = picked[0]
        real[b, :take] = True
    return anchors, real


def in_target_text(ids: np.ndarray, greedy: np.ndarray) -> np.ndarray:
    """Positions whose token is the target's own greedy token after the one before: [B, L]
    bool. A round's anchor is always such a token (the target's last pick), so these are
    where inference puts blocks."""
    out = np.zeros(ids.shape, dtype=bool)
    out[:, 1:] = ids[:, 1:] == greedy[:, :-1]
    return out


def block_positions(anchors: np.ndarray, block_size: int) -> np.ndarray:
    """Absolute positions of every block row: [batch, anchors * block_size]."""
    B, N = anchors.shape
    return (anchors[:, :, None] + np.arange(block_size)[None, None]).reshape(B, N * block_size)


def block_attention_mask(anchors: np.ndarray, seq_len: int, block_size: int, *,
                         causal: bool = False, window: int | None = None) -> np.ndarray:
    """Which keys each block row may attend: [batch, 1, N * bs, seq_len + N * bs] bool.

    Keys are the ``seq_len`` context rows, then every block's rows. A row of block ``n``
    (anchor ``a``) sees context rows ``j < a`` (and, with a sliding ``window``, only those
    with ``position - j < window``) and its own block's rows (all of them, or the earlier
    ones when ``causal``), nothing else.
    """
    B, N = anchors.shape
    bs = block_size
    Q = N * bs
    q_block = np.repeat(np.arange(N), bs)  # [Q]
    q_anchor = anchors[:, q_block]  # [B, Q]
    q_pos = q_anchor + np.tile(np.arange(bs), N)[None]
    ctx = np.arange(seq_len)[None, None, :] < q_anchor[:, :, None]  # [B, Q, L]
    if window is not None:
        ctx &= (q_pos[:, :, None] - np.arange(seq_len)[None, None, :]) < window
    k_block = np.repeat(np.arange(N), bs)
    own = q_block[:, None] == k_block[None, :]  # [Q, Q]
    if causal:
        own &= np.tile(np.arange(bs), N)[None, :] <= np.tile(np.arange(bs), N)[:, None]
    blocks = np.broadcast_to(own[None], (B, Q, Q))
    return np.concatenate([ctx, blocks], axis=-1)[:, None]


def position_weights(block_size: int, gamma: float) -> np.ndarray:
    """Loss weight of each block row: 0 for the anchor row, ``exp(-(k-1)/gamma)`` for row k."""
    k = np.arange(block_size, dtype=np.float64)
    w = np.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w.astype(np.float32)


def block_labels(ids: np.ndarray, greedy: np.ndarray | None, anchors: np.ndarray,
                 block_size: int, mode: str) -> tuple[np.ndarray, np.ndarray]:
    """Labels and validity of every block row: ([B, N, bs] int32, [B, N, bs] bool).

    Row 0 holds the anchor token (never trained). ``mode == "corpus"``: row k's label is the
    corpus token at ``a + k``. ``mode == "target"``: the target's greedy token after
    ``a + k - 1`` (``greedy[:, t]`` is the argmax of the target's logits at ``t``), valid
    while every corpus token ``a + 1 .. a + k - 1`` equals the target's greedy token before
    it (then the corpus prefix is the chain the target itself would have produced).
    """
    offsets = np.arange(block_size)
    rows = anchors[:, :, None] + offsets[None, None]  # [B, N, bs]
    batch_index = np.arange(ids.shape[0])[:, None, None]
    corpus = ids[batch_index, rows]
    if mode == "corpus" or greedy is None:
        labels = corpus.copy()
        valid = np.ones(labels.shape, dtype=bool)
    else:
        labels = greedy[batch_index, rows - 1]
        labels[:, :, 0] = corpus[:, :, 0]
        agree = corpus == labels  # the corpus follows the greedy chain at row k
        agree[:, :, 0] = True
        # row k is valid when rows 1 .. k-1 agree
        valid = np.ones(labels.shape, dtype=bool)
        valid[:, :, 1:] = np.cumprod(agree[:, :, :-1], axis=-1).astype(bool)
    valid[:, :, 0] = False
    return labels.astype(np.int32), valid


# -- the training forward of a draft ----------------------------------------------------------


def rope_at(x: mx.array, positions: mx.array, base: float) -> mx.array:
    """``nn.RoPE(d, traditional=False, base=base)`` at arbitrary per-row positions.

    x [B, H, Q, D]; positions [B, Q] (the fast kernel takes one offset per call).
    """
    d = x.shape[-1]
    half = d // 2
    inv = base ** (-mx.arange(0, half, dtype=mx.float32) * 2.0 / d)
    angles = positions.astype(mx.float32)[:, None, :, None] * inv  # [B, 1, Q, half]
    cos, sin = mx.cos(angles), mx.sin(angles)
    a, b = x[..., :half].astype(mx.float32), x[..., half:d].astype(mx.float32)
    out = mx.concatenate([a * cos - b * sin, a * sin + b * cos], axis=-1)
    return out.astype(x.dtype)


def attention_train(attn: nn.Module, x: mx.array, context: mx.array, q_pos: mx.array,
                    mask: mx.array) -> mx.array:
    """One draft attention over [context rows | all blocks' rows] with the block mask."""
    B, Q, _ = x.shape
    L = context.shape[1]
    d, nh, nkv = attn.head_dim, attn.n_heads, attn.n_kv_heads
    base = attn.rope.base
    q = attn.q_norm(attn.q_proj(x).reshape(B, Q, nh, d)).transpose(0, 2, 1, 3)
    q = rope_at(q, q_pos, base)
    k_blk = attn.k_norm(attn.k_proj(x).reshape(B, Q, nkv, d)).transpose(0, 2, 1, 3)
    k_blk = rope_at(k_blk, q_pos, base)
    v_blk = attn.v_proj(x).reshape(B, Q, nkv, d).transpose(0, 2, 1, 3)
    k_ctx = attn.k_norm(attn.k_proj(context).reshape(B, L, nkv, d)).transpose(0, 2, 1, 3)
    ctx_pos = mx.broadcast_to(mx.arange(L)[None], (B, L))
    k_ctx = rope_at(k_ctx, ctx_pos, base)
    v_ctx = attn.v_proj(context).reshape(B, L, nkv, d).transpose(0, 2, 1, 3)
    keys = mx.concatenate([k_ctx, k_blk], axis=2)
    values = mx.concatenate([v_ctx, v_blk], axis=2)
    out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=attn.scale, mask=mask)
    return attn.o_proj(out.transpose(0, 2, 1, 3).reshape(B, Q, -1))


def layer_train(layer: nn.Module, h: mx.array, context: mx.array, q_pos: mx.array,
                mask: mx.array, block_size: int) -> mx.array:
    """A DFlash / DFlash2 layer over all blocks; convolutions stay inside each block."""
    B, Q, H = h.shape
    blocks = Q // block_size
    conv = getattr(layer, "attention_conv", None)

    def per_block(y: mx.array) -> mx.array:
        return y.reshape(B * blocks, block_size, H)

    def joined(y: mx.array) -> mx.array:
        return y.reshape(B, Q, H)

    x = layer.input_layernorm(h)
    if conv is None:
        h = h + attention_train(layer.self_attn, x, context, q_pos, mask)
        return h + layer.mlp(layer.post_attention_layernorm(h))
    xb = per_block(x)
    dyn = conv.kernels(xb)
    out = attention_train(layer.self_attn, joined(conv(xb, 0, dyn)), context, q_pos, mask)
    h = h + joined(conv(per_block(out), 1, dyn))
    xb = per_block(layer.post_attention_layernorm(h))
    dyn = layer.mlp_conv.kernels(xb)
    out = layer.mlp(layer.mlp_conv(xb, 0, dyn))
    return h + joined(layer.mlp_conv(out, 1, dyn))


def draft_hidden_train(draft: DFlashDraftModel, tapped: mx.array, block_ids: mx.array,
                       q_pos: mx.array, mask: mx.array) -> mx.array:
    """Final-normed hidden states of every block row: [B, N * bs, hidden].

    tapped [B, L, taps * hidden] (the target's tapped states of the whole window);
    block_ids [B, N * bs]; q_pos their absolute positions; mask from
    :func:`block_attention_mask`.
    """
    context = draft.context(tapped)
    h = draft.embed_tokens(block_ids)
    if draft.args.input_embedding_scale != 1.0:
        h = h * draft.args.input_embedding_scale
    h = h.astype(draft.compute_dtype)
    for layer in draft.layers:
        h = layer_train(layer, h, context, q_pos, mask, draft.block_size)
    return draft.norm(h)


def selector_scores(draft: DFlash2DraftModel, hidden: mx.array, logits: mx.array,
                    previous: mx.array) -> tuple[mx.array, mx.array]:
    """Candidate ids [..., K] (the head's top K) and their scores [..., K] given each row's
    predecessor token ``previous`` [...] (as the selector scores them at inference)."""
    selector = draft.candidate_selector
    k = selector.top_k
    ids = mx.stop_gradient(mx.argpartition(-logits, k - 1, axis=-1)[..., :k]).astype(mx.int32)
    unary = draft.scale_logits(mx.take_along_axis(logits, ids, axis=-1)).astype(mx.float32)
    proj = selector.hidden_projection(hidden).astype(mx.float32)  # [..., R]
    pred = selector.predecessor_codebook(previous).astype(mx.float32)  # [..., R]
    succ = selector.successor_codebook(ids).astype(mx.float32)  # [..., K, R]
    pair = (succ * (pred * proj)[..., None, :]).sum(-1)
    return ids, pair + unary


@dataclass
class Batch:
    """One step's arrays (MLX), built on the host from a batch of windows."""

    ids: mx.array | None  # [B, L]; None in the train step, which never reads it
    block_ids: mx.array  # [B, N * bs]
    q_pos: mx.array  # [B, N * bs]
    mask: mx.array  # [B, 1, N * bs, L + N * bs]
    labels: mx.array  # [B, N, bs]
    weights: mx.array  # [B, N, bs] (position weight * validity)
    previous: mx.array  # [B, N, bs] the previous label (row 1: the anchor)
    tokens: int


def draft_loss(draft: DFlashDraftModel, tapped: mx.array, batch: Batch,
               selector_weight: float) -> tuple[mx.array, tuple[mx.array, mx.array, mx.array]]:
    """Position-weighted cross-entropy (+ the DFlash2 selector's); also top-1 accuracy."""
    hidden = draft_hidden_train(draft, tapped, batch.block_ids, batch.q_pos, batch.mask)
    B, N, bs = batch.labels.shape
    hidden = hidden.reshape(B, N, bs, -1)
    # One head projection serves both losses (the vocabulary matmul is the step's largest).
    raw = draft.raw_logits(hidden).astype(mx.float32)
    logits = draft.scale_logits(raw)  # as proposal_logits: scaled / softcapped as at inference
    w = batch.weights
    total_w = mx.maximum(w.sum(), 1e-6)
    ce = nn.losses.cross_entropy(logits, batch.labels, reduction="none")
    loss_ce = (ce * w).sum() / total_w
    correct = (mx.argmax(logits, axis=-1) == batch.labels).astype(mx.float32)
    valid = (w > 0).astype(mx.float32)
    accuracy = (correct * valid).sum() / mx.maximum(valid.sum(), 1.0)
    loss = loss_ce
    loss_sel = mx.array(0.0)
    if isinstance(draft, DFlash2DraftModel) and selector_weight > 0:
        ids, scores = selector_scores(draft, hidden, raw, batch.previous)
        hit = ids == batch.labels[..., None]
        found = hit.any(-1)
        slot = mx.argmax(hit.astype(mx.int32), axis=-1)
        sel_ce = nn.losses.cross_entropy(scores, slot, reduction="none")
        sel_w = w * found.astype(w.dtype)
        loss_sel = (sel_ce * sel_w).sum() / mx.maximum(sel_w.sum(), 1e-6)
        loss = loss + selector_weight * loss_sel
    return loss, (loss_ce, loss_sel, accuracy)


BATCH_ARRAYS = ("block_ids", "q_pos", "mask", "labels", "weights", "previous")


def use_compile(setting: str) -> bool:
    """``auto``: compile except on the CPU (there tracing the step costs more than it saves)."""
    if setting not in ("auto", "on", "off"):
        raise TrainDraftError(f"--compile {setting!r}: choose auto, on or off")
    if setting == "auto":
        return mx.default_device() != mx.cpu
    return setting == "on"


def make_train_step(draft: DFlashDraftModel, optimizer: optim.Optimizer,
                    settings: TrainSettings, compiled: bool = False) -> Any:
    """``step(tapped, batch) -> (loss, (loss_ce, loss_selector, accuracy))``: loss, gradients,
    clipping and the AdamW update. ``compiled``: one ``mx.compile`` graph (draft and
    optimizer state as its implicit inputs and outputs) so a step is a few fused kernels
    replayed, not thousands of small ones rebuilt every step."""

    def loss_fn(model: DFlashDraftModel, tapped: mx.array, batch: Batch):
        return draft_loss(model, tapped, batch, settings.selector_weight)

    value_and_grad = nn.value_and_grad(draft, loss_fn)

    def update(tapped: mx.array, *arrays: mx.array) -> tuple[mx.array, ...]:
        batch = Batch(None, **dict(zip(BATCH_ARRAYS, arrays)), tokens=0)
        (loss, (loss_ce, loss_sel, acc)), grads = value_and_grad(draft, tapped, batch)
        if settings.grad_clip > 0:
            grads, _ = optim.clip_grad_norm(grads, settings.grad_clip)
        optimizer.update(draft, grads)
        return loss, loss_ce, loss_sel, acc

    if compiled:
        optimizer.init(draft.trainable_parameters())  # keeps moments already there (resume)
        state = [draft.state, optimizer.state]
        update = mx.compile(update, inputs=state, outputs=state)

    def step(tapped: mx.array, batch: Batch) -> tuple[mx.array, tuple]:
        loss, loss_ce, loss_sel, acc = update(tapped, *(getattr(batch, k) for k in BATCH_ARRAYS))
        return loss, (loss_ce, loss_sel, acc)

    return step


def greedy_proposals(draft: DFlashDraftModel, hidden: mx.array, anchor_tokens: mx.array,
                     ) -> mx.array:
    """What a greedy round proposes from each block's rows 1..bs-1: [B, N, bs - 1].

    hidden [B, N, bs, H]. DFlash: the head's argmax per row. DFlash2: the selector's path,
    row 1 scored after the anchor, row p after the candidate chosen at p - 1.
    """
    rows = hidden[:, :, 1:]
    raw = draft.raw_logits(rows).astype(mx.float32)
    if not isinstance(draft, DFlash2DraftModel):
        return mx.argmax(draft.scale_logits(raw), axis=-1).astype(mx.int32)
    previous = anchor_tokens
    chosen = []
    for p in range(rows.shape[2]):
        ids, scores = selector_scores(draft, rows[:, :, p], raw[:, :, p], previous)
        slot = mx.argmax(scores, axis=-1)
        previous = mx.take_along_axis(ids, slot[..., None], axis=-1)[..., 0]
        chosen.append(previous)
    return mx.stack(chosen, axis=-1).astype(mx.int32)


def accepted_lengths(proposals: np.ndarray, labels: np.ndarray, valid: np.ndarray,
                     ) -> np.ndarray:
    """Accepted drafts per block under greedy verification: leading matches with valid labels.

    proposals [B, N, bs-1], labels / valid [B, N, bs] (row 0 is the anchor).
    """
    match = (proposals == labels[:, :, 1:]) & valid[:, :, 1:]
    return np.cumprod(match, axis=-1).sum(-1)


# -- the target side --------------------------------------------------------------------------


def choose_taps(num_layers: int, spec: str) -> list[int]:
    """``auto``: 2 to 5 layers spread from layer 1 to the last (the last one's state is
    nearly the target's next-token prediction); else ``i,j,...``."""
    if spec != "auto":
        try:
            taps = sorted({int(t) for t in spec.split(",") if t.strip()})
        except ValueError:
            raise TrainDraftError(f"--taps {spec!r}: expected 'auto' or layer ids like 1,4,7") \
                from None
        bad = [t for t in taps if not 0 <= t < num_layers]
        if not taps or bad:
            raise TrainDraftError(f"--taps {spec!r}: layers must lie in 0..{num_layers - 1}")
        return taps
    if num_layers <= 2:
        return list(range(num_layers))
    count = min(5, max(2, round(num_layers / 3)))
    return sorted({int(round(x)) for x in np.linspace(1, num_layers - 1, count)})


def find_mask_token(tokenizer: Any, explicit: int | None, vocab: int) -> int:
    if explicit is not None:
        if not 0 <= explicit < vocab:
            raise TrainDraftError(f"--mask-token-id {explicit} is outside the vocabulary "
                                  f"of {vocab}")
        return explicit
    for name in MASK_TOKEN_NAMES:
        token_id = tokenizer.token_to_id(name)
        if token_id is not None and token_id < vocab:
            return int(token_id)
    raise TrainDraftError("the target's tokenizer has no mask token (<|mask|>, <mask>, ...): "
                          "pass --mask-token-id with an id the target never needs to generate")


def make_draft_config(settings: TrainSettings, target: mp.Model, taps: list[int],
                      mask_token_id: int, dtype_name: str) -> dict[str, Any]:
    """config.json of the draft (speculative.md's names; DFlash2 settings in dflash_config)."""
    hidden = target.hidden_size
    head_dim = settings.head_dim or (64 if hidden >= 256 else max(8, hidden // 4))
    heads = settings.heads or max(1, hidden // head_dim)
    kv_heads = settings.kv_heads or max(1, heads // 2)
    section: dict[str, Any] = {
        "block_size": settings.block_size,
        "mask_token_id": mask_token_id,
        "target_layer_ids": taps,
        "num_target_layers": target.num_layers,
    }
    if settings.kind == "dflash2":
        group = settings.conv_group_size
        while hidden % group:
            group //= 2
        section.update(conv_kernel_size=settings.conv_kernel_size, conv_group_size=group,
                       selector_rank=settings.selector_rank,
                       selector_top_k=min(settings.selector_top_k, target.vocab_size))
    return {
        "architectures": [ARCHITECTURES[settings.kind]],
        "model_type": settings.kind,
        "hidden_size": hidden,
        "num_hidden_layers": settings.layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": settings.intermediate_size or 3 * hidden,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "layer_types": ["full_attention"] * settings.layers,
        "is_causal": False,
        "vocab_size": target.vocab_size,
        "dtype": dtype_name,
        "dflash_config": section,
    }


def build_draft(settings: TrainSettings, config: dict[str, Any],
                target: mp.Model) -> DFlashDraftModel:
    cls = KINDS[settings.kind]
    try:
        draft = cls(cls.config_for_checkpoint(config, ()), target)
    except (KeyError, TypeError, ValueError) as exc:
        raise DraftConfigError(f"{cls.__name__}: bad draft config ({exc})") from None
    draft.validate(target)
    initialise(draft, settings.seed)
    return draft


def flat_parameters(module: nn.Module) -> list[tuple[str, mx.array]]:
    """``tree_flatten(module.parameters())``: its annotation allows the dict it returns only
    when given one to fill."""
    return cast("list[tuple[str, mx.array]]", tree_flatten(module.parameters()))


def initialise(draft: nn.Module, seed: int) -> None:
    """Fresh weights: matrices ~ N(0, 0.02), codebooks N(0, 0.02), norms 1; the dynamic
    convolutions start as the identity (base tap 0 = 1, projection 0)."""
    rng = np.random.default_rng(seed)
    new = []
    for name, value in flat_parameters(draft):
        shape = tuple(value.shape)
        if name.endswith("norm.weight") or "aux_hidden_norms." in name:
            arr = np.ones(shape)
        elif name.endswith("base_kernel"):
            arr = np.zeros(shape)
            arr[:, 0] = 1.0
        elif "kernel_projection" in name:
            arr = np.zeros(shape)
        else:
            arr = 0.02 * rng.standard_normal(shape)
        new.append((name, mx.array(arr.astype(np.float32))))
    draft.update(tree_unflatten(new))
    mx.eval(draft.parameters())


def target_forward(target: mp.Model, ids: mx.array, taps: list[int]
                   ) -> tuple[mx.array, mx.array]:
    """Tapped states and greedy tokens of the frozen target over ``ids`` [B, L]."""
    logits, tapped = cast("tuple[mx.array, mx.array]", target(ids, taps=taps))
    greedy = mx.argmax(logits, axis=-1).astype(mx.int32)
    return mx.stop_gradient(tapped), greedy


def generate_greedy(target: mp.Model, prompts: np.ndarray, length: int,
                    eos_id: int | None = None, deadline: float | None = None
                    ) -> np.ndarray | None:
    """Greedy continuations of ``prompts`` [B, P] to ``length`` tokens in total: [B, length].

    Batched with the target's own caches (one forward per new token for the whole batch).
    After an EOS a row keeps going: the text after it is still the target's greedy output.
    With a ``deadline`` (``time.perf_counter()`` seconds) passed before the end: None.
    """
    cache = target.make_cache()
    ids = mx.array(prompts, dtype=mx.int32)
    logits = cast(mx.array, target(ids, cache))  # no taps: the logits alone
    token = mx.argmax(logits[:, -1], axis=-1).astype(mx.int32)
    out = [token]
    for _ in range(length - prompts.shape[1] - 1):
        logits = cast(mx.array, target(token[:, None], cache))
        token = mx.argmax(logits[:, -1], axis=-1).astype(mx.int32)
        out.append(token)
        mx.eval(token)
        if deadline is not None and time.perf_counter() > deadline:
            return None
    generated = np.array(mx.stack(out, axis=1))
    return np.concatenate([prompts, generated], axis=1).astype(np.int32)


# -- checkpoints ------------------------------------------------------------------------------


def dtype_by_name(name: str) -> mx.Dtype:
    table = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
    if name not in table:
        raise TrainDraftError(f"--save-dtype {name!r}: choose float32, bfloat16 or float16")
    return table[name]


def save_draft(draft: nn.Module, config: dict[str, Any], out: Path, dtype: mx.Dtype) -> None:
    """``out/config.json`` + ``out/model.safetensors`` (plain names), loadable by ``--draft``.

    Both are written to a temporary folder inside ``out`` first; the old ``config.json`` goes
    before the new files are moved in, so a kill leaves the previous draft, or one without a
    config (which does not load), never new weights under an old config.
    """
    tmp = out / f".draft.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    weights = {name: value.astype(dtype) for name, value in flat_parameters(draft)}
    mx.save_safetensors(str(tmp / "model.safetensors"), weights, metadata={"format": "mlx"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    (out / "config.json").unlink(missing_ok=True)
    os.replace(tmp / "model.safetensors", out / "model.safetensors")
    os.replace(tmp / "config.json", out / "config.json")
    for leftover in out.glob(".draft.tmp-*"):  # this one and any from killed runs
        shutil.rmtree(leftover, ignore_errors=True)


def previous_checkpoint(folder: Path) -> Path:
    """Where ``save_checkpoint`` keeps the checkpoint it replaces while it swaps folders."""
    return folder.with_name(folder.name + ".old")


def save_checkpoint(folder: Path, draft: nn.Module, optimizer: optim.Optimizer,
                    state: dict[str, Any]) -> None:
    """Write the checkpoint whole to a temporary folder, then swap it in for ``folder``.

    Killed while writing, the previous checkpoint is untouched; killed between the two
    renames, it is ``folder.old``, which ``recover_checkpoint`` takes back. Both weight files
    carry the step, so a checkpoint whose files disagree is refused on resume.
    """
    tmp = folder.with_name(f"{folder.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    stamp = {"step": str(state["step"])}
    mx.save_safetensors(str(tmp / "draft.safetensors"), dict(tree_flatten(draft.parameters())),
                        metadata=stamp)
    mx.save_safetensors(str(tmp / "optimizer.safetensors"),
                        dict(tree_flatten(optimizer.state)), metadata=stamp)
    (tmp / "state.json").write_text(json.dumps(state, indent=1) + "\n", encoding="utf-8")
    old = previous_checkpoint(folder)
    if folder.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(folder, old)
    os.replace(tmp, folder)
    shutil.rmtree(old, ignore_errors=True)
    for leftover in folder.parent.glob(f"{folder.name}.tmp-*"):  # from killed runs
        shutil.rmtree(leftover, ignore_errors=True)


def recover_checkpoint(folder: Path) -> None:
    """Put back the previous checkpoint when a run was killed between ``save_checkpoint``'s
    renames; temporary folders (``folder.tmp-PID``) are never read."""
    old = previous_checkpoint(folder)
    if not folder.exists() and (old / "state.json").exists():
        os.replace(old, folder)


def load_with_metadata(path: Path) -> tuple[dict[str, mx.array], dict[str, Any]]:
    """A safetensors file's arrays and metadata (what ``mx.load`` gives with
    ``return_metadata``; its annotation covers every format and mode)."""
    return cast("tuple[dict[str, mx.array], dict[str, Any]]",
                mx.load(str(path), return_metadata=True))


def load_checkpoint(folder: Path, draft: nn.Module, optimizer: optim.Optimizer
                    ) -> dict[str, Any]:
    try:
        state = json.loads((folder / "state.json").read_text(encoding="utf-8"))
        weights, weights_meta = load_with_metadata(folder / "draft.safetensors")
        opt_state, opt_meta = load_with_metadata(folder / "optimizer.safetensors")
    except (OSError, ValueError) as exc:
        raise TrainDraftError(f"{folder}: cannot resume ({exc})") from None
    steps = {"state.json": str(state.get("step")), "draft.safetensors": weights_meta.get("step"),
             "optimizer.safetensors": opt_meta.get("step")}
    if len(set(steps.values())) != 1:
        found = ", ".join(f"{name} at step {step}" for name, step in steps.items())
        raise TrainDraftError(f"{folder}: cannot resume, the files are from different steps "
                              f"({found})")
    draft.load_weights(list(weights.items()), strict=True)
    optimizer.state = tree_unflatten(list(opt_state.items()))
    mx.eval(draft.parameters(), optimizer.state)
    return state


def rng_state(rng: np.random.Generator) -> Mapping[str, Any]:
    return rng.bit_generator.state


def set_rng_state(rng: np.random.Generator, state: dict[str, Any]) -> None:
    rng.bit_generator.state = state


# -- progress ---------------------------------------------------------------------------------


class Progress:
    """One stderr line, rewritten in place on a terminal (every 10th step otherwise)."""

    def __init__(self, total: int, quiet: bool = False, log: str | None = None) -> None:
        self.total = total
        self.quiet = quiet
        self.tty = sys.stderr.isatty()
        self.log_path = Path(log) if log else None
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)

    def step(self, step: int, loss: float, acc: float, tps: float, eta: float) -> None:
        if self.quiet:
            return
        width = 24
        done = int(width * step / max(self.total, 1))
        bar = "#" * done + "." * (width - done)
        line = (f"step {step}/{self.total} [{bar}] loss {loss:.4f} acc {acc:.3f} "
                f"{tps / 1000:.1f}k tok/s eta {int(eta) // 60}:{int(eta) % 60:02d}")
        if self.tty:
            sys.stderr.write("\r" + line + "\x1b[K")
            sys.stderr.flush()
        elif step % 10 == 0 or step == self.total:
            print(line, file=sys.stderr, flush=True)

    def record(self, event: dict[str, Any]) -> None:
        if self.log_path is not None:
            with self.log_path.open("a", encoding="utf-8") as fh:
                fh.write(json.dumps(event) + "\n")

    def note(self, message: str) -> None:
        if self.quiet:
            return
        if self.tty:
            sys.stderr.write("\r\x1b[K")
        print(message, file=sys.stderr, flush=True)


# -- the run ----------------------------------------------------------------------------------


def learning_rate(step: int, total: int, settings: TrainSettings) -> float:
    """Linear warm-up, then cosine decay to ``min_lr_ratio * lr`` at ``total``."""
    warmup = settings.warmup or max(1, total // 20)
    peak = settings.lr
    if step < warmup:
        return peak * (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    low = peak * settings.min_lr_ratio
    return low + 0.5 * (peak - low) * (1 + math.cos(math.pi * t))


@dataclass
class Data:
    """Token streams (train / held-out) and the optional self-distilled pool."""

    train: np.ndarray
    heldout: np.ndarray
    pool: np.ndarray | None = None
    heldout_docs: list[np.ndarray] = field(default_factory=list)  # each held-out document
    evaluation: EvaluationSet | None = None
    documents: int = 0
    heldout_documents: int = 0
    pool_seconds: float = 0.0


def load_data(settings: TrainSettings, tokenizer: Any, eos_id: int) -> Data:
    files = expand_corpus(settings.corpus, settings.glob)
    if not files:
        raise TrainDraftError("the corpus names no files")
    if settings.heldout:
        held_files = expand_corpus(settings.heldout, settings.glob)
        train_files = files
    else:
        keys = [str(f) for f in files]
        held_files = [f for f, k in zip(files, keys)
                      if is_heldout(k, settings.seed, settings.heldout_fraction)]
        if not held_files:
            held_files = files[-1:]
        held = set(held_files)
        train_files = [f for f in files if f not in held] or files
    train_docs = read_documents(train_files)
    held_docs = read_documents(held_files)
    if not train_docs:
        raise TrainDraftError("no UTF-8 text in the corpus files")
    train = token_stream(tokenizer, train_docs, eos_id)
    held_ids = encode_documents(tokenizer, held_docs)
    heldout = token_stream(tokenizer, held_docs, eos_id) if held_docs else train[-4096:]
    return Data(train, heldout, heldout_docs=held_ids, documents=len(train_docs),
                heldout_documents=len(held_docs))


def make_batch(ids: np.ndarray, greedy: np.ndarray | None, rng: np.random.Generator,
               settings: TrainSettings, mask_token_id: int, weights_by_row: np.ndarray,
               causal: bool, window: int | None, allowed: np.ndarray | None = None,
               live: np.ndarray | None = None
               ) -> tuple[Batch, np.ndarray, np.ndarray, np.ndarray]:
    """One step's batch from windows ``ids`` [B, L]. ``allowed`` [B, L]: where anchors may
    sit (default anywhere); ``live`` [B, L]: which positions' labels count (default all; a
    continuation ends at its stop token, a padded document at its last token)."""
    B, L = ids.shape
    bs = settings.block_size
    if allowed is None:
        anchors = sample_anchors(rng, B, L, bs, settings.anchors)
        real = np.ones(anchors.shape, dtype=bool)
    else:
        anchors, real = sample_anchors_where(rng, allowed, bs, settings.anchors)
    labels, valid = block_labels(ids, greedy, anchors, bs, settings.labels)
    valid &= real[:, :, None]
    if live is not None:
        rows = anchors[:, :, None] + np.arange(bs)[None, None]
        valid &= live[np.arange(B)[:, None, None], rows]
    block_ids = np.full(labels.shape, mask_token_id, dtype=np.int32)
    block_ids[:, :, 0] = labels[:, :, 0]
    previous = np.concatenate([labels[:, :, :1], labels[:, :, :-1]], axis=-1)
    weights = weights_by_row[None, None] * valid
    mask = block_attention_mask(anchors, L, bs, causal=causal, window=window)
    batch = Batch(ids=mx.array(ids), block_ids=mx.array(block_ids.reshape(B, -1)),
                  q_pos=mx.array(block_positions(anchors, bs)), mask=mx.array(mask),
                  labels=mx.array(labels), weights=mx.array(weights.astype(np.float32)),
                  previous=mx.array(previous.astype(np.int32)), tokens=B * L)
    return batch, anchors, labels, valid


def training_anchors(ids: np.ndarray, greedy: np.ndarray | None, settings: TrainSettings
                     ) -> np.ndarray | None:
    """Where a training step may anchor blocks: anywhere (``--anchor-on all``) or only in
    text the target wrote itself (``target``: the answers of a corpus of its own replies,
    not the prompts around them)."""
    if settings.anchor_on == "all" or greedy is None:
        return None
    return in_target_text(ids, greedy)


@dataclass
class EvaluationSet:
    """Held-out sequences [n, L] to anchor blocks in, and each one's live span: anchors at
    ``start <= a``, labels up to position ``end`` (inclusive)."""

    sequences: np.ndarray
    start: np.ndarray  # [n]
    end: np.ndarray  # [n]

    def spans(self, rows: slice) -> tuple[np.ndarray, np.ndarray]:
        """(allowed-from, live) masks [b, L] of the rows ``rows``."""
        positions = np.arange(self.sequences.shape[1])[None]
        return (positions >= self.start[rows, None]), (positions <= self.end[rows, None])


def heldout_continuations(target: mp.Model, stream: np.ndarray,
                          settings: TrainSettings, eos_id: int | None, seed: int = 1234
                          ) -> EvaluationSet:
    """Held-out prompts and the target's greedy continuations, each live up to its first
    EOS (decoding stops there: what the target writes after it is never drafted against).

    This is the text a greedy speculative run verifies drafts against, so blocks anchored in
    the continuations measure acceptance the way decoding sees it.
    """
    rng = np.random.default_rng(seed)
    bs = settings.block_size
    prompt_len = settings.prompt_len or max(1, settings.seq_len // 4)
    prompt_len = min(prompt_len, max(1, stream.shape[0] - 2))
    count = max(1, math.ceil(settings.eval_blocks / max(1, settings.anchors)))
    seq_len = max(settings.seq_len, prompt_len + bs + 1)
    prompts = sample_windows(rng, stream, count, prompt_len)
    sequences = generate_greedy(target, prompts, seq_len, eos_id)
    assert sequences is not None  # no deadline
    end = np.full(count, seq_len - 1)
    if eos_id is not None:
        for i, row in enumerate(sequences):
            stops = np.flatnonzero(row[prompt_len:] == eos_id)
            if stops.size:
                end[i] = prompt_len + stops[0]
    return EvaluationSet(sequences, np.full(count, prompt_len), end)


def heldout_documents(docs: Sequence[np.ndarray], settings: TrainSettings, eos_id: int,
                      seed: int = 1234) -> EvaluationSet:
    """Held-out documents as they are, one per row from its start (cut at ``seq_len``, padded
    with EOS past its end): for a corpus that is the target's own output (``--eval-text
    corpus``), where the blocks land in its replies, each in its own conversation."""
    usable = [d for d in docs if d.size > settings.block_size]
    if not usable:
        raise TrainDraftError("--eval-text corpus: no held-out document is longer than a "
                              "block")
    rng = np.random.default_rng(seed)
    count = min(len(usable), max(1, math.ceil(settings.eval_blocks / max(1, settings.anchors))))
    picked = sorted(rng.choice(len(usable), size=count, replace=False).tolist())
    L = settings.seq_len
    sequences = np.full((count, L), eos_id, dtype=np.int32)
    end = np.zeros(count, dtype=np.int64)
    for row, i in enumerate(picked):
        doc = usable[i][:L]
        sequences[row, :doc.size] = doc
        end[row] = doc.size - 1
    return EvaluationSet(sequences, np.ones(count, dtype=np.int64), end)


def estimate_acceptance(draft: DFlashDraftModel, target: mp.Model, taps: list[int],
                        evaluation: EvaluationSet, settings: TrainSettings,
                        mask_token_id: int, seed: int = 1234) -> dict[str, float]:
    """Held-out cross-entropy (weighted as training weighs it; the DFlash2 selector's apart),
    top-1 accuracy and the greedy-agreement tau estimate.

    Blocks are anchored as a round anchors them: on a token the target wrote itself, inside
    each sequence's live span. Each block's accepted length is the number of leading
    proposals (DFlash2: the selector's path) equal to the target's greedy chain; tau = 1 + its
    mean, what a greedy run with full-depth rounds sees (``bench/default_model.py``'s
    committed tokens per round).
    """
    rng = np.random.default_rng(seed)
    bs = settings.block_size
    weights_by_row = position_weights(bs, settings.decay_gamma or bs / 2)
    attn0 = draft.layers[0].self_attn
    eval_settings = TrainSettings(**{**asdict(settings), "labels": "target"})
    lengths, ces, sels, accs, sizes = [], [], [], [], []
    per_batch = max(1, settings.batch)
    sequences = evaluation.sequences
    for start in range(0, sequences.shape[0], per_batch):
        rows = slice(start, start + per_batch)
        ids = sequences[rows]
        tapped, greedy = target_forward(target, mx.array(ids), taps)
        greedy_np = np.array(greedy)
        after_start, live = evaluation.spans(rows)
        allowed = in_target_text(ids, greedy_np) & after_start & live
        batch, anchors, labels, valid = make_batch(
            ids, greedy_np, rng, eval_settings, mask_token_id, weights_by_row,
            attn0.causal, attn0.window, allowed=allowed, live=live)
        _, (ce, sel, acc) = draft_loss(draft, tapped, batch, settings.selector_weight)
        hidden = draft_hidden_train(draft, tapped, batch.block_ids, batch.q_pos, batch.mask)
        B, N = anchors.shape
        proposals = greedy_proposals(draft, hidden.reshape(B, N, bs, -1),
                                     mx.array(labels[:, :, 0]))
        real = valid[:, :, 1]  # a real block: its first draft row has a live label
        lengths.append(accepted_lengths(np.array(proposals), labels, valid)[real])
        ces.append(float(ce))
        sels.append(float(sel))
        accs.append(float(acc))
        sizes.append(float(valid.sum()))
    accepted = np.concatenate(lengths)
    if accepted.size == 0:
        raise TrainDraftError("no held-out block to measure: the held-out text has no "
                              "token the target writes itself")
    w = np.asarray(sizes) / max(sum(sizes), 1.0)
    return {"heldout_loss": float(np.dot(w, ces)), "heldout_loss_selector": float(np.dot(w, sels)),
            "heldout_accuracy": float(np.dot(w, accs)),
            "tau_estimate": float(1.0 + accepted.mean()), "blocks": int(accepted.size)}


def measure_speculative(target_path: str, draft_dir: Path, prompts: list[list[int]],
                        max_tokens: int) -> dict[str, Any]:
    """The real speculative loop (greedy) on held-out prompts against plain decoding, every
    round drafting the whole block: the draft's own acceptance (the loop's default would
    pause drafting on a machine where plain steps are faster)."""
    bundle = mp.load(target_path, draft=str(draft_dir))
    options = mp.SamplerOptions(temperature=0.0)
    eos = bundle.tokenizer.eos_ids
    model, draft = bundle.model, bundle.draft
    assert draft is not None  # loaded with draft=
    full = {"depth": draft.max_depth}
    # warm-up: compile / allocate once so the first timed run is not penalised
    mp.generate(model, prompts[0], options=options, max_tokens=8, draft=draft,
                       draft_options=full)
    mp.generate(model, prompts[0], options=options, max_tokens=8)
    rounds = committed = spec_tokens = plain_tokens = 0
    spec_s = plain_s = 0.0
    identical = True
    for prompt in prompts:
        spec = mp.generate(model, prompt, options=options, max_tokens=max_tokens,
                                  draft=draft, eos_ids=eos, draft_options=full)
        plain = mp.generate(model, prompt, options=options, max_tokens=max_tokens,
                                   eos_ids=eos)
        identical &= spec.tokens == plain.tokens
        s = spec.stats
        rounds += s.rounds
        committed += s.committed_in_rounds
        spec_tokens += s.generated_tokens
        spec_s += s.decode_seconds
        plain_tokens += plain.stats.generated_tokens
        plain_s += plain.stats.decode_seconds
    spec_tps = spec_tokens / spec_s if spec_s else 0.0
    plain_tps = plain_tokens / plain_s if plain_s else 0.0
    return {"tau": committed / rounds if rounds else 0.0, "rounds": rounds,
            "speculative_tokens_per_second": spec_tps, "plain_tokens_per_second": plain_tps,
            "speedup": spec_tps / plain_tps if plain_tps else 0.0,
            "identical_to_plain": bool(identical), "prompts": len(prompts),
            "max_tokens": max_tokens}


def train_draft(settings: TrainSettings) -> dict[str, Any]:
    """Run the whole thing; returns the final report (also written to ``OUT/report.json``)."""
    started = time.perf_counter()
    out = Path(settings.out).expanduser()
    ckpt_dir = out / CHECKPOINT_DIR
    if settings.kind not in KINDS:
        raise TrainDraftError(f"--kind {settings.kind!r}: choose dflash or dflash2")
    if settings.labels not in ("target", "corpus"):
        raise TrainDraftError(f"--labels {settings.labels!r}: choose target or corpus")
    if settings.anchor_on not in ("all", "target"):
        raise TrainDraftError(f"--anchor-on {settings.anchor_on!r}: choose all or target")
    if settings.anchor_on == "target" and settings.labels != "target":
        raise TrainDraftError("--anchor-on target needs --labels target (the target's greedy "
                              "tokens say which text it wrote)")
    if settings.eval_text not in ("generated", "corpus"):
        raise TrainDraftError(f"--eval-text {settings.eval_text!r}: choose generated or corpus")
    if settings.block_size < 2:
        raise TrainDraftError("--block-size must be at least 2")
    for flag, value in (("--eval-every", settings.eval_every),
                        ("--save-every", settings.save_every), ("--stop-at", settings.stop_at)):
        if value < 0:
            raise TrainDraftError(f"{flag} {value}: a number of steps, 0 for never")
    if settings.keep_best and settings.eval_every < 1:
        raise TrainDraftError("--keep-best needs --eval-every N (the steps it compares)")
    for flag, share in (("--distill-mix", settings.distill_mix),
                        ("--distill-openings", settings.distill_openings)):
        if not 0.0 <= share <= 1.0:
            raise TrainDraftError(f"{flag} {share}: a share, between 0 and 1")
    if settings.resume:
        recover_checkpoint(ckpt_dir)
    if settings.resume and (ckpt_dir / "state.json").exists():
        saved = json.loads((ckpt_dir / "state.json").read_text(encoding="utf-8"))["settings"]
        changed = [k for k in TrainSettings.FIXED if saved.get(k) != getattr(settings, k)]
        if changed:
            raise TrainDraftError(f"--resume: {', '.join(changed)} differ from the checkpoint "
                                  f"in {ckpt_dir}")
    elif settings.resume:
        raise TrainDraftError(f"--resume: no checkpoint in {ckpt_dir}")

    target_dtype = None if settings.target_dtype == "auto" else settings.target_dtype
    bundle = mp.load(settings.target, use_draft=False, dtype=target_dtype)
    target, tokenizer = bundle.model, bundle.tokenizer
    target.freeze()
    if not getattr(target, "supports_taps", True):
        raise DraftConfigError(f"{type(target).__name__} does not expose layer taps")
    vocab = target.vocab_size
    eos_id = tokenizer.eos_id if tokenizer.eos_id is not None else 0
    mask_token_id = find_mask_token(tokenizer, settings.mask_token_id, vocab)
    taps = choose_taps(target.num_layers, settings.taps)
    dtype_name = settings.save_dtype
    if dtype_name == "auto":
        dtype_name = str(target.dtype).replace("mlx.core.", "")
    save_dtype = dtype_by_name(dtype_name)
    config = make_draft_config(settings, target, taps, mask_token_id, dtype_name)
    mx.random.seed(settings.seed)
    draft = build_draft(settings, config, target)
    n_params = sum(v.size for _, v in flat_parameters(draft))

    progress = Progress(settings.steps, settings.quiet, settings.log)
    data = load_data(settings, tokenizer, eos_id)
    rng = np.random.default_rng(settings.seed)
    bs = settings.block_size
    weights_by_row = position_weights(bs, settings.decay_gamma or bs / 2)
    attn0 = draft.layers[0].self_attn

    optimizer = optim.AdamW(learning_rate=settings.lr, weight_decay=settings.weight_decay)
    history: list[dict[str, Any]] = []
    step = 0
    tokens_seen = 0
    elapsed_before = 0.0
    if settings.resume:
        optimizer.init(draft.trainable_parameters())
        saved = load_checkpoint(ckpt_dir, draft, optimizer)
        step, tokens_seen = saved["step"], saved["tokens_seen"]
        elapsed_before = saved.get("elapsed_s", 0.0)
        history = saved.get("history", [])
        set_rng_state(rng, saved["rng"])
        progress.note(f"resumed at step {step} from {ckpt_dir}")
    else:
        shown = {**asdict(settings), "corpus": len(settings.corpus),
                 "heldout": len(settings.heldout)}  # file counts, not thousands of paths
        progress.record({"event": "start", "settings": shown, "taps": taps,
                         "mask_token_id": mask_token_id, "draft_parameters": n_params,
                         "train_tokens": int(data.train.size),
                         "heldout_tokens": int(data.heldout.size)})
        progress.note(f"train-draft: {settings.kind} draft, {n_params / 1e6:.2f}M parameters, "
                      f"taps {taps}, mask {mask_token_id}; corpus {data.documents} documents "
                      f"({data.train.size} tokens), held out {data.heldout_documents} "
                      f"({data.heldout.size} tokens)")

    budget = settings.time_budget_s or 0.0
    if settings.self_distill > 0:
        # Its own seed: a resumed run regenerates exactly the same pool.
        pool_started = time.perf_counter()
        data.pool = build_pool(target, data.train, settings, eos_id, settings.seed + 7,
                               settings.distill_time_s or (budget * 0.4 if budget else 0.0),
                               progress)
        data.pool_seconds = time.perf_counter() - pool_started

    compiled = use_compile(settings.compile)
    train_step = make_train_step(draft, optimizer, settings, compiled)
    progress.record({"event": "compile", "compiled": compiled,
                     "device": str(mx.default_device())})

    total = settings.steps
    t_start = time.perf_counter()
    timed_steps = 0
    phases: list[tuple[float, float, float]] = []  # target, host, draft seconds per step
    last_eval: dict[str, float] = {}
    # --keep-best: (tau estimate, step, the draft's parameters then) of the best evaluation
    best: tuple[float, int, dict[str, mx.array]] | None = None
    while step < total:
        if settings.stop_at and step >= settings.stop_at:
            progress.note(f"stopping at step {step} (--stop-at); --resume continues")
            break
        if budget and elapsed_before + time.perf_counter() - started > budget:
            progress.note(f"time budget of {budget:.0f}s reached at step {step}")
            break
        t0 = time.perf_counter()
        ids = next_windows(rng, data, settings)
        tapped, greedy = target_forward(target, mx.array(ids), taps)
        # The labels need the greedy tokens on the host anyway: evaluating the taps with them
        # costs nothing and splits the step's time into target / host / draft phases.
        mx.eval(tapped, greedy)
        greedy_np = np.array(greedy) if settings.labels == "target" else None
        t1 = time.perf_counter()
        batch, _, _, _ = make_batch(ids, greedy_np, rng, settings, mask_token_id,
                                    weights_by_row, attn0.causal, attn0.window,
                                    allowed=training_anchors(ids, greedy_np, settings))
        optimizer.learning_rate = learning_rate(step, total, settings)
        t2 = time.perf_counter()
        try:
            loss, (loss_ce, loss_sel, acc) = train_step(tapped, batch)
            mx.eval(loss, loss_ce, loss_sel, acc, draft.parameters(), optimizer.state)
        except Exception as exc:  # noqa: BLE001 - a backend that cannot compile some op
            if not compiled:
                raise
            progress.note(f"compiled step failed ({type(exc).__name__}: {exc}); "
                          "continuing uncompiled")
            compiled = False
            train_step = make_train_step(draft, optimizer, settings, False)
            loss, (loss_ce, loss_sel, acc) = train_step(tapped, batch)
            mx.eval(loss, loss_ce, loss_sel, acc, draft.parameters(), optimizer.state)
        t3 = time.perf_counter()
        if timed_steps == 0:
            progress.note(f"first step {t3 - t0:.2f}s (target {t1 - t0:.2f}s, host "
                          f"{t2 - t1:.3f}s, draft {t3 - t2:.2f}s; compiled: {compiled})")
        step += 1
        tokens_seen += batch.tokens
        timed_steps += 1
        now = time.perf_counter()
        phases.append((t1 - t0, t2 - t1, t3 - t2))
        rate = batch.tokens / max(now - t0, 1e-9)  # target forward included
        if timed_steps == 1:  # the first step traces and compiles: keep it out of the pace
            t_start = now
        per_step = (now - t_start) / (timed_steps - 1) if timed_steps > 1 else now - t0
        if budget and timed_steps == 20:
            # Re-plan the cosine schedule to end when the budget does.
            left = budget - (elapsed_before + now - started) - 0.15 * budget
            total = min(settings.steps, step + max(1, int(left / per_step)))
            progress.total = total
        eta = per_step * (total - step)
        event: dict[str, Any] = {
            "event": "step", "step": step, "loss": float(loss.item()),
            "loss_ce": float(loss_ce.item()), "loss_selector": float(loss_sel.item()),
            "accuracy": float(acc.item()),
            # MLX's learning_rate getter is unannotated (it returns an mx.array), so mypy
            # takes the float given to the setter above
            "lr": float(optimizer.learning_rate.item()),  # type: ignore[attr-defined]
            "tokens_per_second": rate, "target_s": round(t1 - t0, 4),
            "host_s": round(t2 - t1, 4), "draft_s": round(t3 - t2, 4)}
        if step % 5 == 0 or step == 1:
            history.append({k: event[k] for k in ("step", "loss", "loss_ce", "accuracy")})
        progress.record(event)
        progress.step(step, event["loss"], event["accuracy"], rate, eta)
        if settings.eval_every and step % settings.eval_every == 0:
            last_eval = estimate_acceptance(draft, target, taps, evaluation_set(
                target, data, settings, eos_id), settings, mask_token_id)
            progress.record({"event": "eval", "step": step, **last_eval})
            progress.note(f"step {step}: held-out loss {last_eval['heldout_loss']:.4f}, "
                          f"tau estimate {last_eval['tau_estimate']:.2f}")
            if settings.keep_best and (best is None or last_eval["tau_estimate"] > best[0]):
                # the arrays themselves: each update gives the draft new ones
                best = (last_eval["tau_estimate"], step, dict(tree_flatten(draft.parameters())))
        if settings.save_every and step % settings.save_every == 0 and step < total:
            save_checkpoint(ckpt_dir, draft, optimizer, checkpoint_state(
                settings, step, tokens_seen, elapsed_before + time.perf_counter() - started,
                rng, history))
    train_seconds = elapsed_before + time.perf_counter() - started
    # the pace after the first step (which traces and compiles): what more steps would cost
    steps_per_second = ((timed_steps - 1) / max(time.perf_counter() - t_start, 1e-9)
                        if timed_steps > 1 else None)
    save_checkpoint(ckpt_dir, draft, optimizer, checkpoint_state(
        settings, step, tokens_seen, train_seconds, rng, history))
    kept_step = step
    if best is not None:
        if step % settings.eval_every:  # the last step against the best evaluated one
            last_eval = estimate_acceptance(draft, target, taps, evaluation_set(
                target, data, settings, eos_id), settings, mask_token_id)
            progress.record({"event": "eval", "step": step, **last_eval})
        if best[0] > last_eval["tau_estimate"]:
            draft.load_weights(list(best[2].items()))
            kept_step = best[1]
            progress.note(f"keeping step {kept_step} (tau estimate {best[0]:.2f}; the last "
                          f"step's {last_eval['tau_estimate']:.2f})")
    save_draft(draft, config, out, save_dtype)
    progress.note(f"saved the draft to {out} ({step} steps, {tokens_seen} tokens, "
                  f"{train_seconds:.0f}s)")

    report: dict[str, Any] = {
        "kind": settings.kind, "target": settings.target, "out": str(out), "steps": step,
        "kept_step": kept_step,
        "tokens_seen": tokens_seen, "train_seconds": round(train_seconds, 1),
        "draft_parameters": int(n_params), "taps": taps, "mask_token_id": mask_token_id,
        "first_loss": history[0]["loss"] if history else None,
        "final_loss": float(np.mean([h["loss"] for h in history[-3:]])) if history else None,
        "first_loss_ce": history[0]["loss_ce"] if history else None,
        "final_loss_ce": float(np.mean([h["loss_ce"] for h in history[-3:]]))
        if history else None,
        "history": history,
        "compiled": compiled,
        "pool_seconds": round(data.pool_seconds, 1),
        "steps_per_second": round(steps_per_second, 3) if steps_per_second else None,
    }
    if len(phases) > 1:  # steady state: the first step (tracing, kernel builds) left out
        steady = np.median(np.array(phases[1:]), axis=0)
        report["step_seconds"] = {"target": round(float(steady[0]), 4),
                                  "host": round(float(steady[1]), 4),
                                  "draft": round(float(steady[2]), 4),
                                  "first_step": round(float(sum(phases[0])), 3)}
    # Held-out figures of the draft as saved (its dtype): reload it the way --draft does.
    saved_draft = mp.load(settings.target, draft=str(out), dtype=target_dtype).draft
    assert saved_draft is not None  # loaded with draft=
    report.update(estimate_acceptance(saved_draft, target, taps, evaluation_set(
        target, data, settings, eos_id), settings, mask_token_id))
    if settings.eval_prompts > 0:
        prompts = heldout_prompts(data.heldout, settings.eval_prompts, eos_id, settings.seed)
        if prompts:
            try:
                report["speculative"] = measure_speculative(settings.target, out, prompts,
                                                            settings.eval_tokens)
            except (NotImplementedError, ImportError, AttributeError) as exc:
                report["speculative"] = {"error": f"{type(exc).__name__}: {exc}"}
    (out / "report.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    progress.record({"event": "report", **{k: v for k, v in report.items() if k != "history"}})
    progress.note(format_report(report))
    return report


def evaluation_set(target: mp.Model, data: Data, settings: TrainSettings,
                   eos_id: int) -> EvaluationSet:
    """The held-out text blocks are measured on (``--eval-text``), built once per run."""
    if data.evaluation is None:
        if settings.eval_text == "corpus":
            data.evaluation = heldout_documents(data.heldout_docs, settings, eos_id)
        else:
            data.evaluation = heldout_continuations(target, data.heldout, settings, eos_id)
    return data.evaluation


def checkpoint_state(settings: TrainSettings, step: int, tokens_seen: int, elapsed: float,
                     rng: np.random.Generator, history: list[dict[str, Any]]) -> dict[str, Any]:
    return {"settings": asdict(settings), "step": step, "tokens_seen": tokens_seen,
            "elapsed_s": elapsed, "rng": rng_state(rng), "history": history}


def next_windows(rng: np.random.Generator, data: Data, settings: TrainSettings) -> np.ndarray:
    """A batch of windows: corpus windows, a share of them from the self-distilled pool."""
    ids = sample_windows(rng, data.train, settings.batch, settings.seq_len)
    if data.pool is not None and data.pool.shape[0]:
        take = rng.random(settings.batch) < settings.distill_mix
        rows = rng.integers(0, data.pool.shape[0], size=settings.batch)
        ids[take] = data.pool[rows[take]]
    return ids


def document_openings(rng: np.random.Generator, stream: np.ndarray, count: int, length: int,
                      eos_id: int) -> np.ndarray:
    """``count`` prompts of ``length`` tokens that start where a document does (after an EOS,
    or the stream's start): [count, length] int32."""
    starts = np.flatnonzero(stream[:-length - 1] == eos_id) + 1
    starts = np.concatenate([[0], starts[starts + length <= stream.shape[0]]])
    picked = rng.choice(starts, size=count)
    return np.stack([stream[s:s + length] for s in picked]).astype(np.int32)


def build_pool(target: mp.Model, stream: np.ndarray, settings: TrainSettings,
               eos_id: int, seed: int, seconds: float, progress: Progress) -> np.ndarray:
    """``settings.self_distill`` sequences: a prompt and the target's greedy rest. A share
    (``distill_openings``) of the batches is prompted with a document's first 4-32 tokens,
    the way people prompt a code model, so the draft also learns the text the target writes
    from a short start (looser than its continuations of long corpus windows); the rest
    continue a corpus window of ``prompt_len`` tokens."""
    rng = np.random.default_rng(seed)
    prompt_len = settings.prompt_len or max(1, settings.seq_len // 4)
    rows: list[np.ndarray] = []
    t0 = time.perf_counter()
    per = max(1, min(settings.self_distill, settings.distill_batch))
    deadline = t0 + seconds if seconds else None
    openings = 0.0  # batches prompted with openings so far, against the share wanted
    while sum(r.shape[0] for r in rows) < settings.self_distill:
        opening = openings < settings.distill_openings * (len(rows) + 1)
        if opening:
            length = min(int(rng.integers(4, 33)), settings.seq_len - 1)
            prompts = document_openings(rng, stream, per, length, eos_id)
        else:
            prompts = sample_windows(rng, stream, per, prompt_len)
        try:
            done = generate_greedy(target, prompts, settings.seq_len, eos_id, deadline)
            if done is None:  # out of time part-way: that batch is dropped
                break
            rows.append(done)
            openings += opening
        except RuntimeError as exc:
            # Some backends reject very wide decode batches (MLX CUDA failed to build its
            # graph at 256 rows): halve the batch, and train on the corpus alone at the end.
            if per <= 8:
                progress.note(f"self-distillation unavailable here ({exc}); corpus only")
                return np.zeros((0, settings.seq_len), dtype=np.int32)
            per //= 2
            progress.note(f"greedy batch failed ({exc}); retrying with {per} rows")
            continue
        if seconds and time.perf_counter() - t0 > seconds:
            break
    if not rows:
        progress.note(f"self-distillation ran out of its {seconds:.0f}s; corpus only")
        return np.zeros((0, settings.seq_len), dtype=np.int32)
    pool = np.concatenate(rows)[:settings.self_distill]
    progress.note(f"self-distilled {pool.shape[0]} sequences of {settings.seq_len} tokens "
                  f"in {time.perf_counter() - t0:.0f}s")
    progress.record({"event": "pool", "sequences": int(pool.shape[0]),
                     "seconds": time.perf_counter() - t0})
    return pool


def heldout_prompts(stream: np.ndarray, count: int, eos_id: int, seed: int,
                    length: int = 32) -> list[list[int]]:
    """Prompts from held-out text: windows that start right after a document boundary."""
    starts = np.flatnonzero(stream[:-length - 1] == eos_id) + 1
    if starts.size == 0:
        starts = np.array([0])
    rng = np.random.default_rng(seed + 99)
    picked = rng.choice(starts, size=min(count, starts.size), replace=False)
    return [stream[s:s + length].tolist() for s in sorted(picked)
            if s + length <= stream.shape[0]]


def format_report(report: dict[str, Any]) -> str:
    pace = report.get("steps_per_second")
    lines = [f"draft: {report['kind']}, {report['draft_parameters'] / 1e6:.2f}M parameters, "
             f"{report['steps']} steps, {report['tokens_seen']} tokens, "
             f"{report['train_seconds']}s" + (f" ({pace:.2f} steps/s after the first)"
                                              if pace else ""),
             f"loss: cross-entropy {report['first_loss_ce']:.4f} -> "
             f"{report['final_loss_ce']:.4f} (train, weighted), "
             f"held-out {report['heldout_loss']:.4f}, accuracy {report['heldout_accuracy']:.3f}"
             f" (selector loss {report['heldout_loss_selector']:.4f})",
             f"acceptance: tau estimate {report['tau_estimate']:.2f} "
             f"(greedy agreement over {report['blocks']} held-out blocks)"]
    spec = report.get("speculative")
    if spec and "error" not in spec:
        lines.append(f"speculative loop (greedy, {spec['prompts']} held-out prompts x "
                     f"{spec['max_tokens']} tokens): tau {spec['tau']:.2f}, "
                     f"{spec['speculative_tokens_per_second']:.1f} vs "
                     f"{spec['plain_tokens_per_second']:.1f} tok/s plain "
                     f"(speedup {spec['speedup']:.2f}x), identical to plain: "
                     f"{spec['identical_to_plain']}")
    elif spec:
        lines.append(f"speculative loop not measured ({spec['error']})")
    return "\n".join(lines)


# -- command line -----------------------------------------------------------------------------


def settings_from_args(args: argparse.Namespace) -> TrainSettings:
    corpus = list(args.corpus)
    if args.corpus_list:
        corpus += read_list_file(args.corpus_list)
    heldout = list(args.heldout)
    if args.heldout_list:
        heldout += read_list_file(args.heldout_list)
    if not corpus:
        raise TrainDraftError("give the corpus: --corpus FILES... or --corpus-list FILE")
    names = {f.name for f in TrainSettings.__dataclass_fields__.values()}
    values = {k: v for k, v in vars(args).items() if k in names}
    values.update(corpus=corpus, heldout=heldout)
    return TrainSettings(**values)


def run(args: argparse.Namespace) -> int:
    """The ``train-draft`` command: train, save, report."""
    settings = settings_from_args(args)
    for value, flag in ((settings.steps, "--steps"), (settings.batch, "--batch"),
                        (settings.anchors, "--anchors"), (settings.layers, "--layers")):
        if value < 1:
            raise TrainDraftError(f"{flag} must be at least 1")
    try:
        train_draft(settings)
    except FileNotFoundError as exc:
        raise ModelFolderError(str(exc)) from None
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m mlxrunner_dflash.train``: the same command without the mlxrunner CLI."""
    parser = argparse.ArgumentParser(prog="train-draft", description=HELP)
    add_arguments(parser)
    args = parser.parse_args(argv)
    try:
        return run(args)
    except mp.MLXRunnerError as exc:
        print(f"train-draft: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
