"""DFlash2: DFlash plus block-local dynamic convolutions and a candidate selector.

Convolution (``conv_kernel_size`` K, ``conv_group_size``; G = hidden / group
size): from a sublayer's normalised input x, ``dyn = kernel_projection(x)`` as
``[B, L, 2, K, G]``; ``conv(x)[t] = sum_o (base[o] + dyn[t, o, group(c)]) * x[t-o]``,
zero before the block's first row. Half 0 convolves the sublayer's input, half 1
its output.

Selector (``selector_top_k`` K, ``selector_rank`` R): per block row the K best
ids of the head, unary scores (scaled, softcapped logits), and pairwise scores
``sum_r pred(prev)[r] * proj[r] * succ(id_j)[r]``; row 0's predecessor is the
anchor (``current``), row p's the candidate chosen at p-1. Temperature 0:
argmax (q one-hot). Else ``softmax(row / T)`` over the K candidates, one draw,
and q is that sparse distribution.
"""

from __future__ import annotations

from typing import Any

import mlx.core as mx
import mlx.nn as nn

import mlxrunner.nn as mnn
from mlxrunner.nn import Linear
from mlxrunner.plugin import BlockDraftSession, DraftConfigError, DraftProposal, Model, topk_indices

from .dflash import DFlashArgs, DFlashDraftModel, DFlashLayer, Store


def block_convolve(x: mx.array, base: mx.array, dynamic: mx.array, group_size: int) -> mx.array:
    """``out[t, c] = sum_o (base[o, c] + dynamic[t, o, c // group_size]) * x[t - o, c]``.

    x [B, L, C]; base [K, C]; dynamic [B, L, K, G]; rows before the first are zero.
    """
    _, L, _ = x.shape
    kernel = base.shape[0]
    out = None
    for o in range(min(kernel, L)):
        shifted = x if o == 0 else mx.pad(x[:, :L - o], [(0, 0), (o, 0), (0, 0)])
        weight = base[o].astype(x.dtype) + mx.repeat(dynamic[:, :, o, :], group_size, axis=-1)
        term = weight * shifted
        out = term if out is None else out + term
    assert out is not None  # kernel >= 1 (BlockConv sets tap 0) and L >= 1
    return out


class BlockConv(nn.Module):
    """``base_kernel`` [2, K, hidden] and ``kernel_projection``: hidden -> 2 * K * G."""

    def __init__(self, hidden: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        self.kernel_size = kernel_size
        self.group_size = group_size
        self.groups = hidden // group_size
        # identity until trained: tap 0 weight 1, others 0
        base = mx.zeros((2, kernel_size, hidden))
        base[:, 0, :] = 1.0
        self.base_kernel = base
        self.kernel_projection = Linear(hidden, 2 * kernel_size * self.groups, bias=False)

    def kernels(self, x: mx.array) -> mx.array:
        """Dynamic kernels from the normalised sublayer input: [B, L, 2, K, G]."""
        B, L, _ = x.shape
        return self.kernel_projection(x).reshape(B, L, 2, self.kernel_size, self.groups)

    def __call__(self, x: mx.array, half: int, dynamic: mx.array) -> mx.array:
        return block_convolve(x, self.base_kernel[half], dynamic[:, :, half], self.group_size)


class DFlash2Layer(DFlashLayer):
    def __init__(self, args: DFlashArgs, index: int) -> None:
        super().__init__(args, index)
        self.attention_conv = BlockConv(args.hidden_size, args.conv_kernel_size,
                                        args.conv_group_size)
        self.mlp_conv = BlockConv(args.hidden_size, args.conv_kernel_size, args.conv_group_size)

    def __call__(self, h: mx.array, pos: int | mx.array, store: Store) -> mx.array:
        x = self.input_layernorm(h)
        dyn = self.attention_conv.kernels(x)
        out = self.self_attn(self.attention_conv(x, 0, dyn), pos, store)
        h = h + self.attention_conv(out, 1, dyn)
        x = self.post_attention_layernorm(h)
        dyn = self.mlp_conv.kernels(x)
        out = self.mlp(self.mlp_conv(x, 0, dyn))
        return h + self.mlp_conv(out, 1, dyn)


class CandidateSelector(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, rank: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.vocab_size = vocab_size
        self.predecessor_codebook = nn.Embedding(vocab_size, rank)
        self.successor_codebook = nn.Embedding(vocab_size, rank)
        self.hidden_projection = Linear(hidden, rank, bias=False)

    def scores(self, hidden: mx.array, logits: mx.array, anchor: mx.array,
               scale: Any) -> tuple[mx.array, mx.array, mx.array]:
        """For B blocks of n rows: candidate ids [B, n, K], the anchor's score row [B, K]
        for row 0, and transition scores [B, n-1, K, K] (row p's scores given each slot of
        row p-1).

        ``hidden`` [B, n, hidden]; ``logits`` the raw head outputs [B, n, V]; ``anchor``
        [B]; ``scale`` maps logits to unary scores.
        """
        ids = topk_indices(logits, self.top_k)
        unary = scale(mx.take_along_axis(logits, ids, axis=-1)).astype(mx.float32)
        proj = self.hidden_projection(hidden).astype(mx.float32)  # [B, n, R]
        succ = self.successor_codebook(ids).astype(mx.float32)  # [B, n, K, R]
        anchor_code = self.predecessor_codebook(anchor.reshape(-1))
        anchor_code = anchor_code.astype(mx.float32)  # [B, R]
        first = (succ[:, 0] @ (anchor_code * proj[:, 0])[..., None])[..., 0] + unary[:, 0]
        rows, n, k = ids.shape
        if n == 1:  # one row: no transitions (a quantized codebook takes no empty ids)
            return ids, first, mx.zeros((rows, 0, k, k), dtype=mx.float32)
        pred = self.predecessor_codebook(ids[:, :-1]).astype(mx.float32)  # [B, n-1, K, R]
        transitions = (pred * proj[:, 1:, None, :]) @ succ[:, 1:].swapaxes(-1, -2)
        transitions = transitions + unary[:, 1:, None, :]
        return ids, first, transitions


class DFlash2DraftModel(DFlashDraftModel):
    """DFlash2: convolutions around each sublayer and a candidate selector; drafts
    ``block_size - 1`` tokens every round."""

    adaptive_depth = False
    layer_class = DFlash2Layer

    def __init__(self, config: dict[str, Any], target: Model) -> None:
        args = DFlashArgs.from_config(config)
        name = type(self).__name__
        if args.conv_kernel_size < 1 or args.conv_group_size < 1:
            raise DraftConfigError(f"{name}: conv_kernel_size and conv_group_size must be "
                                   f"positive, got {args.conv_kernel_size} and "
                                   f"{args.conv_group_size}")
        if args.hidden_size % args.conv_group_size:
            raise DraftConfigError(f"{name}: hidden size {args.hidden_size} is not a multiple "
                                   f"of conv_group_size {args.conv_group_size}")
        if args.selector_rank < 1 or not 1 <= args.selector_top_k <= target.vocab_size:
            raise DraftConfigError(f"{name}: selector_rank must be positive and "
                                   f"selector_top_k within 1..{target.vocab_size}, got "
                                   f"{args.selector_rank} and {args.selector_top_k}")
        super().__init__(config, target)
        self.candidate_selector = CandidateSelector(target.vocab_size, args.hidden_size,
                                                    args.selector_rank, args.selector_top_k)

    def sanitize(self, weights: dict[str, mx.array]) -> dict[str, mx.array]:
        # Published DFlash2 checkpoints store the codebooks without ".weight".
        out = dict(weights)
        for book in ("predecessor_codebook", "successor_codebook"):
            bare = f"candidate_selector.{book}"
            if bare in out and f"{bare}.weight" not in out:
                out[f"{bare}.weight"] = out.pop(bare)
        return out

    def selector_scores(self, hidden: mx.array, anchor: mx.array
                        ) -> tuple[mx.array, mx.array, mx.array]:
        """Candidates, row 0's scores and transition scores of block rows ``hidden``."""
        logits = self.raw_logits(hidden).astype(mx.float32)
        return self.candidate_selector.scores(hidden, logits, anchor, self.scale_logits)

    def greedy_tokens(self, hidden: mx.array, anchor: mx.array) -> mx.array:
        return greedy_path(*self.selector_scores(hidden, anchor))

    def sampled(self, session: BlockDraftSession, hidden: mx.array, anchor: mx.array
                ) -> DraftProposal:
        ids, first, transitions = self.selector_scores(hidden, anchor)
        return sampled_path(ids[0], first[0], transitions[0], session.temperature,
                            session.draw)


def greedy_path(ids: mx.array, first: mx.array, transitions: mx.array) -> mx.array:
    """Temperature 0, for B blocks: row 0 takes the argmax of ``first`` [B, K], row p the
    argmax of the transition row of the slot chosen at p-1. Returns the tokens [B, n].

    Every row's best successor of every slot comes from one reduction up front, so the
    sequential part is one small gather per row (it runs inside the traced block, where
    each operation costs host time on every round)."""
    rows, n, k = ids.shape
    slot = mx.argmax(first, axis=-1).astype(mx.int32)[:, None]  # [B, 1]
    slots = [slot]
    if n > 1:
        best = mx.argmax(transitions, axis=-1).astype(mx.int32).reshape(rows, -1)
    for p in range(1, n):
        slot = mx.take_along_axis(best, slot + (p - 1) * k, axis=1)
        slots.append(slot)
    chosen = mx.concatenate(slots, axis=1) + mnn.constant(tuple(range(0, n * k, k)), mx.int32)
    return mx.take_along_axis(ids.reshape(rows, n * k), chosen, axis=1)


def sampled_path(ids: mx.array, first: mx.array, transitions: mx.array, temperature: float,
                 draw: Any) -> DraftProposal:
    """Temperature > 0: each row draws a slot from ``softmax(row / T)`` (``draw(probs [1, K])
    -> [1]``); q is that sparse distribution over the row's candidates."""
    row = first
    slots: list[mx.array] = []
    probs: list[mx.array] = []
    for p in range(ids.shape[0]):
        if p > 0:
            row = mx.take(transitions[p - 1], slots[-1], axis=0)
        q = mx.softmax(row / temperature, precise=True)
        slots.append(draw(q[None])[0])
        probs.append(q)
    tokens = mx.take_along_axis(ids, mx.stack(slots).astype(mx.int32)[:, None], axis=-1)[:, 0]
    return DraftProposal(tokens, mx.stack(probs), ids)
