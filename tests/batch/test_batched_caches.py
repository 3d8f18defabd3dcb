"""Batched caches (mlxrunner.cache.BatchCaches): rows of different lengths decode in one
forward and each row's logits are those of its sequence decoded alone; rows leave without
moving the others, freed rows are reused, the batch compacts; after a block forward each
row rolls back to its own offset (full KV, rings that wrap, recurrent state) and decodes on
as a solo run over its committed tokens would."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from mlxrunner.cache import BatchCaches
from mlxrunner.decode import compiled_steps, forward, prefill

ATOL = 1e-4


def _prompt(vocab: int, length: int, seed: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, vocab, length).tolist()


class Solo:
    """One sequence decoded alone: its caches and the logits of its last token."""

    def __init__(self, model, prompt):
        self.model = model
        self.caches = model.make_cache()
        self.logits, _ = prefill(model, prompt, self.caches)
        self.tokens = list(prompt)

    def feed(self, tokens):
        out = forward(self.model, mx.array([tokens], dtype=mx.int32), self.caches)
        self.tokens += tokens
        return out[0]


def _step(model, batch, rows_tokens):
    """One batched forward: ``rows_tokens`` maps row -> its tokens (same count each)."""
    length = len(next(iter(rows_tokens.values())))
    ids = [[0] * length for _ in range(batch.rows)]
    for row, tokens in rows_tokens.items():
        ids[row] = tokens
    return forward(model, mx.array(ids, dtype=mx.int32), batch.caches)


def test_rows_decode_as_alone_and_rows_are_reused(model):
    vocab = model.vocab_size
    lengths = (3, 11, 7)  # Gemma 4's and the plain model's rings wrap (windows 8 and 5)
    solos = [Solo(model, _prompt(vocab, n, seed=n)) for n in lengths]
    batch = BatchCaches(model.make_cache())
    rows = [batch.add(s.caches) for s in solos]
    assert rows == [0, 1, 2] and batch.rows == 4  # grows by doubling: a free row
    assert batch.row_offsets == (3, 11, 7, 0)
    rng = np.random.default_rng(1)
    joined = None
    for step in range(6):
        if step == 2:  # the middle sequence leaves; a new one takes its row
            batch.remove(rows[1])
            solos[1] = Solo(model, _prompt(vocab, 9, seed=99))
            joined = batch.add(solos[1].caches)
            assert joined == rows[1]
        feed = {row: [int(rng.integers(vocab))] for row in rows}
        logits = _step(model, batch, feed)
        for row, solo in zip(rows, solos):
            want = solo.feed(feed[row])
            assert np.allclose(np.array(logits[row]), np.array(want), atol=ATOL), (step, row)
    assert batch.row_offsets[rows[1]] == 9 + 4


def test_a_compacted_batch_decodes_on(model):
    vocab = model.vocab_size
    solos = [Solo(model, _prompt(vocab, n, seed=n)) for n in (4, 6, 9, 2, 5)]
    batch = BatchCaches(model.make_cache())
    rows = [batch.add(s.caches) for s in solos]
    assert batch.rows == 8
    for row in rows[:3] + rows[4:]:
        batch.remove(row)
    moved = batch.compact()
    assert moved == {rows[3]: 0} and batch.rows == 1
    logits = _step(model, batch, {0: [7]})
    assert np.allclose(np.array(logits[0]), np.array(solos[3].feed([7])), atol=ATOL)


@pytest.mark.parametrize("block", [3, 5])
def test_each_row_rolls_back_to_its_own_offset(model, block):
    vocab = model.vocab_size
    lengths = (9, 4, 12)
    prompts = [_prompt(vocab, n, seed=10 + n) for n in lengths]
    batch = BatchCaches(model.make_cache())
    rows = [batch.add(Solo(model, p).caches) for p in prompts]
    rng = np.random.default_rng(block)
    committed = [list(p) for p in prompts]
    keeps = [(1, block, 2), (block, 1, block - 1)]
    for round_, keep in enumerate(keeps):
        blocks = {row: rng.integers(vocab, size=block).tolist() for row in rows}
        batch.keep_for_restore(block)
        _step(model, batch, blocks)
        offsets = list(batch.row_offsets)
        for row, kept in zip(rows, keep):
            offsets[row] = len(committed[row]) + kept
            committed[row] += blocks[row][:kept]
        batch.restore_rows(offsets)
        assert [batch.row_offsets[r] for r in rows] == [len(c) for c in committed]
        follow = {row: [int(rng.integers(vocab))] for row in rows}
        logits = _step(model, batch, follow)
        for row in rows:
            committed[row] += follow[row]
            alone = Solo(model, committed[row])  # prefilled over the committed tokens
            assert np.allclose(np.array(logits[row, -1]), np.array(alone.logits[0]),
                               atol=ATOL), (round_, row)


def test_batched_steps_are_traced_where_solo_steps_are(model):
    # (the step machinery may decide to run a model's steps eagerly, e.g. products on the
    # host BLAS: then both run eagerly)
    steps = compiled_steps(model)
    steps.clear()
    solo = Solo(model, _prompt(model.vocab_size, 6, seed=6))
    for _ in range(4):
        solo.feed([3])
    solo_replays = steps.replays()
    steps.clear()
    batch = BatchCaches(model.make_cache())
    rows = [batch.add(Solo(model, _prompt(model.vocab_size, n, seed=n)).caches) for n in (5, 8)]
    for _ in range(4):
        _step(model, batch, {row: [3] for row in rows})
    assert steps.enabled
    assert (steps.replays() >= 2) == (solo_replays >= 2)


def test_bad_restores_say_what_is_wrong(model):
    batch = BatchCaches(model.make_cache())
    batch.add(Solo(model, [1, 2, 3]).caches)
    with pytest.raises(ValueError, match="2 offsets for 1 rows"):
        batch.restore_rows([3, 0])
    with pytest.raises(ValueError, match="kept nothing"):
        batch.restore_rows([2])
    with pytest.raises(ValueError, match="cannot restore row 0"):
        batch.keep_for_restore(2)
        _step(model, batch, {0: [4, 5]})
        batch.restore_rows([7])


def test_folded_attention_takes_a_mask_per_row():
    # what a CUDA decode step of a batch attends with (mlxrunner.nn.attend folds short
    # blocks there): one mask per row, against MLX's own function
    from mlxrunner.nn import attention

    rng = np.random.default_rng(0)
    B, Hq, Hk, L, S, D = 3, 8, 2, 2, 11, 16
    q, k, v = (mx.array(rng.standard_normal(shape).astype(np.float32))
               for shape in ((B, Hq, L, D), (B, Hk, S, D), (B, Hk, S, D)))
    ends = np.array([4, 11, 7])[:, None, None, None]
    mask = mx.array(np.arange(S)[None, None, None] <= ends - L + np.arange(L)[:, None])
    got = attention.folded_attention(q, k, v, scale=D ** -0.5, mask=mask)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=D ** -0.5, mask=mask)
    assert np.allclose(np.array(got), np.array(want), atol=1e-5)
    # each row saw only its own keys: row 0 is unchanged by its masked tail
    k2 = k.at[0, :, 5:].add(100.0)
    again = attention.folded_attention(q, k2, v, scale=D ** -0.5, mask=mask)
    assert np.allclose(np.array(again[0]), np.array(got[0]), atol=1e-6)
