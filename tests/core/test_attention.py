"""mlxrunner.nn.attend: the folded grouped-query attention equals MLX's fused function."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

import mlxrunner
from mlxrunner import settings
from mlxrunner.nn import attend, attention, cuda_norms, kernels
from mlxrunner_test_support import folded_masks_on_cuda, graph_labels, logged, on_cuda_and_emulated

on_cuda, emulated = on_cuda_and_emulated()


def _case(B, Hq, Hk, L, S, D, Dv, dtype, seed=0):
    keys = mx.random.split(mx.random.key(seed), 3)
    q = mx.random.normal((B, Hq, L, D), key=keys[0]).astype(dtype)
    k = mx.random.normal((B, Hk, S, D), key=keys[1]).astype(dtype)
    v = mx.random.normal((B, Hk, S, Dv), key=keys[2]).astype(dtype)
    return q, k, v


def _masks(L, S):
    rows = mx.arange(L)[:, None]
    cols = mx.arange(S)[None]
    return {"none": None,
            "block": cols <= (S - L) + rows,  # a verify block at the end of the buffer
            "vector": mx.arange(S) % 3 != 1,  # one row for every query
            "ring": (cols > rows) & (cols <= rows + S - L)}


@pytest.mark.parametrize("Hq,Hk", [(4, 4), (4, 2), (8, 1)])
@pytest.mark.parametrize("L", [1, 3, 8])
@pytest.mark.parametrize("mask", ["none", "block", "vector", "ring"])
def test_folded_equals_mlx_float32(Hq, Hk, L, mask):
    q, k, v = _case(2, Hq, Hk, L, 40, 32, 16, mx.float32, seed=L)
    m = _masks(L, 40)[mask]
    got = attention.folded_attention(q, k, v, scale=0.3, mask=m)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.3, mask=m)
    assert got.shape == want.shape == (2, Hq, L, 16)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)


def test_folded_equals_mlx_bfloat16():
    q, k, v = _case(1, 8, 2, 4, 300, 64, 64, mx.bfloat16, seed=5)
    m = _masks(4, 300)["block"]
    got = attention.folded_attention(q, k, v, scale=64 ** -0.5, mask=m)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=64 ** -0.5, mask=m)
    assert got.dtype == mx.bfloat16
    np.testing.assert_allclose(np.array(got.astype(mx.float32)),
                               np.array(want.astype(mx.float32)), rtol=2e-2, atol=2e-2)


def test_a_masked_key_is_not_seen():
    q, k, v = _case(1, 2, 1, 1, 6, 8, 8, mx.float32)
    mask = mx.array([True, True, False, True, True, True])
    changed = mx.concatenate([v[:, :, :2], v[:, :, 2:3] + 100.0, v[:, :, 3:]], axis=2)
    a = attention.folded_attention(q, k, v, scale=1.0, mask=mask)
    b = attention.folded_attention(q, k, changed, scale=1.0, mask=mask)
    assert mx.array_equal(a, b)
    assert not mx.array_equal(attention.folded_attention(q, k, changed, scale=1.0),
                              attention.folded_attention(q, k, v, scale=1.0))


def test_attend_folds_only_short_blocks_on_cuda(monkeypatch):
    q, k, v = _case(1, 4, 2, 2, 10, 8, 8, mx.float32)
    mask = _masks(2, 10)["block"]
    calls = []
    real = attention.folded_attention

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return real(*args, **kwargs)

    monkeypatch.setattr(attention, "folded_attention", spy)
    monkeypatch.setattr(attention, "_cuda_default", lambda: False)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.5, mask=mask)
    assert mx.allclose(attend(q, k, v, scale=0.5, mask=mask), want)
    assert calls == []  # not CUDA: MLX's function
    monkeypatch.setattr(attention, "_cuda_default", lambda: True)
    assert mx.allclose(attend(q, k, v, scale=0.5, mask=mask), want, atol=1e-5)
    assert calls == [(1, 4, 2, 8)]
    attend(q, k, v, scale=0.5, mask="causal")  # a string mask: MLX's function
    long_q = mx.zeros((1, 4, attention.FOLD_MAX_QUERIES + 1, 8))
    attend(long_q, mx.zeros((1, 2, 40, 8)), mx.zeros((1, 2, 40, 8)), scale=0.5)
    with settings.overridden(attention="mlx"):
        attend(q, k, v, scale=0.5, mask=mask)
    assert calls == [(1, 4, 2, 8)]


@pytest.mark.parametrize("scale", [1.0, 0.25])
@pytest.mark.parametrize("mask", ["causal", "ring", "none"])
def test_attend_folds_prompts_mlx_has_no_kernel_for_on_cuda(monkeypatch, mask, scale):
    """A prompt's block with heads wider than MLX's fused kernels take (Gemma 4's 256 and
    512) is folded on CUDA: the result is MLX's function's, its causal mask made once for
    every layer of the shape (not arange, arange and compare at each call, as MLX's own
    operations do), the queries not scaled by 1; narrower heads stay MLX's (its fused
    kernel), and ``attention=mlx`` keeps MLX's function."""
    L, S = attention.FOLD_MAX_QUERIES + 4, attention.FOLD_MAX_QUERIES + 9
    q, k, v = _case(1, 8, 2, L, S, 256, 512, mx.float32, seed=11)
    m = "causal" if mask == "causal" else _masks(L, S)[mask]
    mx.eval(q, k, v, m)  # (the graph read below: attention's own operations alone)
    want = mx.fast.scaled_dot_product_attention(q, k, v, scale=scale, mask=m)
    masks = folded_masks_on_cuda(monkeypatch, attention)
    got = attend(q, k, v, m, scale=scale)
    labels = graph_labels(got)
    np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-5, atol=1e-5)
    assert len(masks) == 1
    for banned in ("Arange", "GreaterEqual", "LessEqual"):
        assert banned not in labels, (banned, labels)
    assert ("Multiply" in labels) == (scale != 1.0), labels
    assert labels.count("Matmul") == 2 and labels.count("Softmax") == 1, labels
    if mask == "causal":  # the next layer's call reads the same mask, made once
        attend(q, k, v, m, scale=scale)
        assert masks[1] is masks[0] and masks[0].shape == (L, S)
    narrow = [x[..., :64] for x in (q, k, v)]
    attend(*narrow, m, scale=scale)
    with settings.overridden(attention="mlx"):
        attend(q, k, v, m, scale=scale)
    assert len(masks) == (2 if mask == "causal" else 1)


# ---- the fused kernel ------------------------------------------------------------------


def _emulated(q, k, v, scale, mask, splits=1, gate=None, heads=None):
    """The kernel's body under the host emulation (float32): its output (times
    ``sigmoid(gate)``), with ``splits`` > 1 merged by the blocks that finish each row;
    with ``heads`` (a cuda_norms.HeadSource) the queries made from their raw heads."""
    from mlxrunner.testing.cuda_emulation import emulate_kernel

    B, Hq, L, D = q.shape
    query = {"qw": None, "qeps": None, "qoff": None, "qfreqs": None, "qrf": None}
    query_template = (D, 0, 0, False, 2, False, False, False)
    if heads is not None:
        (x, weight, eps, rotate), (_dims, _trad, log2_base, rope_scale, freqs), offsets, _ = \
            heads
        q = x
        query = {"qw": None if weight is None else np.array(weight),
                 "qeps": np.array([0.0 if eps is None else eps], np.float32),
                 "qoff": np.array(offsets), "qfreqs": None if freqs is None else np.array(freqs),
                 "qrf": np.array([log2_base or 0.0, rope_scale], np.float32)}
        query_template = attention._heads_case(heads)
    Hk, S, Dv = k.shape[1], k.shape[2], v.shape[3]
    rows = B * Hq * L
    kind = 0 if mask is None else mask.ndim
    split = splits > 1
    threads = attention.SPLIT_THREADS if split else attention.ATTEND_THREADS
    counters = np.zeros(rows, np.int32)
    got = emulate_kernel(
        attention.ATTEND_SOURCE,
        {"q": np.array(q), "keys": np.array(k), "values": np.array(v),
         "scale": np.array([scale], np.float32),
         "mask": None if mask is None else np.array(mask),  # (None: absent, as the core's)
         "dims": np.array([L, S, splits], np.int32),
         "gate": None if gate is None else np.array(gate),
         "cnt": counters if split else None, **query},
        {"out": ((B, Hq, L, Dv), np.float32),
         "parts": ((rows * splits * (Dv + 2),), np.float32) if split else None},
        [("T", mx.float32), ("HQ", Hq), ("HK", Hk), ("D", D), ("DV", Dv),
         ("NT", threads), ("U", attention.keys_at_once(D, Dv)),
         ("MASK", kind), ("GATE", gate is not None), ("SPLIT", split),
         ("PMAX", attention.SPLIT_BLOCKS), ("QH", heads is not None),
         *zip(("QW", "QC", "QNORM", "QROT", "QRD", "QTRAD", "QFREQS", "QPERB"),
              query_template)],
        blocks=(rows, splits) if split else rows, threads=threads)
    assert not counters.any()  # every row's counter back at 0, ready for the next launch
    return got["out"]


@emulated
@pytest.mark.parametrize("Hq,Hk,L,mask", [(2, 1, 1, "none"), (4, 2, 3, "block"),
                                          (2, 2, 2, "vector"), (4, 1, 2, "ring")])
def test_kernel_source_on_the_cpu(Hq, Hk, L, mask):
    """The kernel body under the host emulation (float32) equals the folded attention,
    with keys fewer and more than the block's warps, D and Dv not multiples of 32."""
    shapes = [(5, 40, 24), (70, 64, 32)]
    if mask == "block":  # once: Gemma's full-attention widths (16 values a lane)
        shapes.append((300, 512, 512))
    for S, D, Dv in shapes:
        q, k, v = _case(1, Hq, Hk, L, S, D, Dv, mx.float32, seed=S + L)
        m = _masks(L, S)[mask]
        want = attention.folded_attention(q, k, v, scale=0.2, mask=m)
        np.testing.assert_allclose(_emulated(q, k, v, 0.2, m), np.array(want),
                                   rtol=1e-5, atol=1e-5)


@emulated
@pytest.mark.parametrize("L,mask", [(1, "none"), (3, "block")])
def test_gated_kernel_source_on_the_cpu(L, mask):
    """With an output gate the kernel's output is the attention times sigmoid(gate)."""
    q, k, v = _case(1, 4, 2, L, 40, 64, 24, mx.float32, seed=3)
    gate = 3 * mx.random.normal((1, 4, L, 24), key=mx.random.key(8))
    m = _masks(L, 40)[mask]
    want = attention.folded_attention(q, k, v, scale=0.2, mask=m) * mx.sigmoid(gate)
    np.testing.assert_allclose(_emulated(q, k, v, 0.2, m, gate=gate), np.array(want),
                               rtol=1e-5, atol=1e-5)


def test_attend_gates_its_output_on_every_path(monkeypatch):
    """attend(gate=g) is attend() times sigmoid(g): MLX's function (the CPU), the folded
    form and the kernel (its stand-in here) alike; a gate of another shape is applied
    after the kernel, not fused."""
    q, k, v = _case(1, 4, 2, 1, 30, 16, 16, mx.float32)
    gate = 2 * mx.random.normal((1, 4, 1, 16), key=mx.random.key(3))
    mask = mx.arange(30) < 20
    want = attention.attend(q, k, v, mask, scale=0.3) * mx.sigmoid(gate)
    np.testing.assert_allclose(np.array(attention.attend(q, k, v, mask, scale=0.3, gate=gate)),
                               np.array(want), rtol=1e-6, atol=1e-6)
    monkeypatch.setattr(attention, "_cuda_default", lambda: True)
    monkeypatch.setattr(kernels, "_verdicts", {})
    fused = []

    def stand_in(q, k, v, scale, mask, splits=None, gate=None, heads=None):
        fused.append(gate is not None)
        out = attention.folded_attention(q, k, v, scale=scale, mask=mask)
        return out if gate is None else out * mx.sigmoid(gate)

    monkeypatch.setattr(attention, "_launch", stand_in)
    for mode in ("kernel", "folded"):
        with settings.overridden(attention=mode):
            got = attention.attend(q, k, v, mask, scale=0.3, gate=gate)
        np.testing.assert_allclose(np.array(got), np.array(want), rtol=1e-6, atol=1e-6)
    assert fused[-1] is True  # the case's check, then the gated launch
    wide = mx.broadcast_to(gate[:, :1], gate.shape)  # [1, 1, 1, 16] broadcast: not fused
    attention.attend(q, k, v, mask, scale=0.3, gate=gate[:, :1])
    assert fused[-1] is False
    np.testing.assert_allclose(
        np.array(attention.attend(q, k, v, mask, scale=0.3, gate=gate[:, :1])),
        np.array(attention.attend(q, k, v, mask, scale=0.3) * mx.sigmoid(wide)),
        rtol=1e-6, atol=1e-6)


@emulated
@pytest.mark.parametrize("mask", ["none", "vector", "block"])
@pytest.mark.parametrize("gated", [False, True])
def test_split_kernel_source_on_the_cpu(mask, gated):
    """The split form (each block one run of the keys, the row's last block merging the
    runs' partials) equals the folded attention, with runs that hold no live key."""
    L = 1 if mask != "block" else 3
    q, k, v = _case(1, 2, 1, L, 70, 64, 32, mx.float32, seed=11)
    m = _masks(L, 70)[mask]
    if m is not None:
        m = m & (mx.arange(70) >= 25) if m.ndim == 1 else m & (mx.arange(70)[None] >= 25)
    gate = 3 * mx.random.normal((1, 2, L, 32), key=mx.random.key(9)) if gated else None
    want = attention.folded_attention(q, k, v, scale=0.2, mask=m)
    want = want if gate is None else want * mx.sigmoid(gate)
    if m is not None:  # a key no query sees may hold anything: NaN, infinities
        seen = m if m.ndim == 1 else m.any(axis=0)
        k = mx.where(seen[None, None, :, None], k, mx.nan)
        v = mx.where(seen[None, None, :, None], v, mx.inf)
    for splits in (2, 3, 7):  # 7: runs of 10 keys, the first two fully masked
        np.testing.assert_allclose(_emulated(q, k, v, 0.2, m, splits, gate), np.array(want),
                                   rtol=1e-5, atol=1e-5)


def _raw_heads(B, L, H, width, D, norm, rotation, seed):
    """A query's raw heads ``[B, L, H, width]`` as a fused heads launch would note them
    (cuda_norms.HeadSource, taking D entries of each from ``width - D``) and the queries
    MLX's operations make of them."""
    keys = [mx.random.key(seed + i) for i in range(2)]
    x = 3 * mx.random.normal((B, L, H, width), key=keys[0])
    weight = 1 + 0.1 * mx.random.normal((D,), key=keys[1]) if norm == 2 else None
    eps = None if norm == 0 else 1e-6
    offsets = mx.array([37, 1000][:B], dtype=mx.int32)
    source = ((x, weight, eps, rotation is not None),
              rotation or (2, False, 0.0, 1.0, None), offsets, width - D)
    want = cuda_norms._reference_heads([source[0]], source[1], offsets, D, [width - D])[0]
    return source, want


@emulated
@pytest.mark.parametrize("D,norm,rotation,split", [
    (64, 2, (64, False, math.log2(10000.0), 1.0, None), False),  # Gemma's sliding query
    (128, 2, (64, False, None, 1.0, "freqs"), True),  # its full one: a part rotated
    (64, 1, (32, True, math.log2(500.0), 0.5, None), True),  # interleaved pairs, scaled
    (64, 0, None, False)])  # neither norm nor rotation: the heads as they are
@pytest.mark.parametrize("B,width", [(1, None), (2, "twice")])
def test_query_heads_made_in_the_kernel_in_emulation(D, norm, rotation, split, B, width):
    """From a query's raw heads (normalised, rotated at each sequence's offset, taking part
    of each head) the kernel attends as the heads then the folded attention do."""
    if rotation is not None and rotation[4] == "freqs":
        dims = rotation[0]
        rotation = rotation[:4] + (2.0 ** (mx.arange(0, dims, 2, dtype=mx.float32) / 4),)
    source, q = _raw_heads(B, 2, 4, D if width is None else 2 * D, D, norm, rotation, D + B)
    _, k, v = _case(B, 4, 2, 2, 70, D, 32, mx.float32, seed=D)
    m = _masks(2, 70)["block"]
    want = attention.folded_attention(q, k, v, scale=0.2, mask=m)
    got = _emulated(mx.zeros(q.shape), k, v, 0.2, m, 3 if split else 1, heads=source)
    np.testing.assert_allclose(got, np.array(want), rtol=2e-5, atol=2e-5)


@emulated
@pytest.mark.parametrize("Dv,splits", [(32, attention.SPLIT_THREADS + 44), (512, 64), (30, 9)])
def test_more_splits_than_a_blocks_threads_merge_in_emulation(Dv, splits):
    """One query row (a batch of one, one head) splits its keys over more runs than the
    merging block has threads (each thread weighs several partials); over many runs of
    Gemma's widest values (four columns a load, the runs dealt over subsets of the block);
    and values whose width is no multiple of four (a column a load)."""
    q, k, v = _case(1, 1, 1, 1, 600, 32, Dv, mx.float32, seed=4)
    m = mx.arange(600) % 5 != 2
    want = attention.folded_attention(q, k, v, scale=0.2, mask=m)
    np.testing.assert_allclose(_emulated(q, k, v, 0.2, m, splits), np.array(want),
                               rtol=1e-5, atol=1e-5)


def test_a_decode_steps_keys_split_over_the_gpu():
    """A decode step's few query rows split their keys into runs of at least
    MIN_SPLIT_KEYS, up to about SPLIT_BLOCKS blocks in all; a short buffer or many rows
    do not split."""
    assert attention.key_splits(8, 2 * attention.MIN_SPLIT_KEYS - 1) == 1
    assert attention.key_splits(8, 640) == 640 // attention.MIN_SPLIT_KEYS
    assert attention.key_splits(8, 32768) == attention.SPLIT_BLOCKS // 8
    assert attention.key_splits(8, 8192) * attention.MIN_SPLIT_KEYS <= 8192
    assert attention.key_splits(attention.SPLIT_BLOCKS, 32768) == 1  # enough rows already
    for rows, keys in ((8, 100), (1, 600), (3, 1000)):  # no run left empty
        splits = attention.key_splits(rows, keys)
        assert (splits - 1) * -(-keys // splits) < keys


def test_kernel_serves_only_after_its_check(monkeypatch, caplog):
    """attend() runs the kernel only for cases that passed its check (run the first time a
    case is asked for, or by prepare_attend); a kernel that fails its check stays off with
    one warning per case; MLXRUNNER_ATTENTION=folded keeps the folded form."""
    monkeypatch.setattr(attention, "_cuda_default", lambda: True)
    monkeypatch.setattr(kernels, "_verdicts", {})
    launches = []

    def stand_in(q, k, v, scale, mask, splits=None, gate=None,
                 heads=None):  # the kernel's arithmetic
        launches.append(q.shape)
        out = attention.folded_attention(q, k, v, scale=scale, mask=mask)
        return out if gate is None else out * mx.sigmoid(gate)

    monkeypatch.setattr(attention, "_launch", stand_in)
    q, k, v = _case(1, 4, 2, 1, 30, 16, 16, mx.float32)
    mask = mx.arange(30) < 20
    want = attention.folded_attention(q, k, v, scale=0.3, mask=mask)
    assert mx.array_equal(attention.attend(q, k, v, scale=0.3, mask=mask), want)
    assert len(launches) == 2  # the case's check, then the launch itself
    attention.prepare_attend(4, 2, 16, 16, 1, mx.float32)
    assert len(launches) == 7  # the other mask kinds' checks, and each split over keys
    assert mx.array_equal(attention.attend(q, k, v, scale=0.3, mask=mask), want)
    assert len(launches) == 8
    with settings.overridden(attention="folded"):
        attention.attend(q, k, v, scale=0.3, mask=mask)
    assert len(launches) == 8

    def broken(*args):
        raise ValueError("refused")

    monkeypatch.setattr(attention, "_launch", broken)
    attention.prepare_attend(8, 2, 16, 16, 1, mx.float32)
    attention.prepare_attend(8, 2, 16, 16, 1, mx.float32)
    assert logged(caplog).count("fused attention kernel unavailable") == 6  # once a case
    q8 = mx.zeros((1, 8, 1, 16))
    attention.attend(q8, k, v, scale=0.3, mask=mask)  # folded, no error


@on_cuda
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
@pytest.mark.parametrize("Hq,Hk,D,L,S", [(8, 2, 256, 1, 1024), (8, 1, 512, 1, 1024),
                                         (8, 1, 256, 8, 1024), (4, 2, 128, 16, 1024),
                                         (8, 2, 256, 1, 8192), (8, 2, 256, 8, 32768),
                                         (8, 1, 256, 1, 50), (8, 1, 512, 1, 640)])
def test_kernel_matches_mlx_operations_on_the_gpu(dtype, Hq, Hk, D, L, S):
    previous = mx.default_device()
    mx.set_default_device(mx.gpu)
    try:
        q, k, v = _case(2, Hq, Hk, L, S, D, D, dtype, seed=D)
        gate = (2 * mx.random.normal((2, Hq, L, D), key=mx.random.key(D))).astype(dtype)
        for name, m in _masks(L, S).items():
            got = attention._launch(q, k, v, D ** -0.5, m)
            want = attention.folded_attention(q, k, v, scale=D ** -0.5, mask=m)
            if name == "block":  # with an output gate
                got = attention._launch(q, k, v, D ** -0.5, m, gate=gate)
                want = want * mx.sigmoid(gate)
            tolerance = 1e-4 if dtype == mx.float32 else 3e-2
            np.testing.assert_allclose(np.array(got.astype(mx.float32)),
                                       np.array(want.astype(mx.float32)),
                                       rtol=tolerance, atol=tolerance, err_msg=name)
        # the self-check of this very case (split keys or not) lets the kernel serve
        assert attention._kernel_serves(q, k, v, None)
        assert kernels._verdicts[("attention", attention._case(q, k, v, None))]
    finally:
        mx.set_default_device(previous)


def test_an_unknown_mode_is_refused():
    with pytest.raises(mlxrunner.MLXRunnerError, match="MLXRUNNER_ATTENTION='fast'"):
        settings.Settings.from_environment({"MLXRUNNER_ATTENTION": "fast"})


# -- a cache's first write -------------------------------------------------------------------

@emulated
@pytest.mark.parametrize("blocks", [1, 3, 64])
def test_a_first_writes_buffers_come_from_one_launch_in_emulation(blocks):
    """Keys and values of two sequences (their heads and widths unlike) into buffers of 9
    positions, the 5 given first, zeros after; few blocks stride over every entry."""
    from mlxrunner.testing.cuda_emulation import emulate_kernel

    rng = np.random.default_rng(blocks)
    B, n, S, (Hk, Wk), (Hv, Wv) = 2, 5, 9, (3, 4), (2, 6)
    k = rng.normal(size=(B, Hk, n, Wk)).astype(np.float32)
    v = rng.normal(size=(B, Hv, n, Wv)).astype(np.float32)
    got = emulate_kernel(
        attention.FRESH_SOURCE, {"k": k, "v": v, "dims": np.array([B, n, S], np.int32)},
        {"k_out": ((B, Hk, S, Wk), np.float32), "v_out": ((B, Hv, S, Wv), np.float32)},
        [("T", mx.float32), ("HK", Hk), ("WK", Wk), ("HV", Hv), ("WV", Wv),
         ("NT", attention.FRESH_THREADS)], blocks=(blocks, 2), threads=attention.FRESH_THREADS)
    for name, x in (("k_out", k), ("v_out", v)):
        want = np.concatenate([x, np.zeros((*x.shape[:2], S - n, x.shape[3]), np.float32)], 2)
        np.testing.assert_array_equal(got[name], want, err_msg=name)


@pytest.mark.parametrize("kind", ["kv", "ring"])
def test_a_first_write_of_buffers_made_elsewhere_is_the_caches_own(monkeypatch, kind):
    """On CUDA a prompt's first write into a KV cache or a ring takes its buffers from one
    launch (stood in for here by MLX's operations): what attention reads, the mask, the
    cache's buffers and offset, and the steps after it are those of the cache's own write;
    a one-token write, a later write and a block that fills a ring's window write as
    before."""
    from mlxrunner.cache import KVCache, RingCache

    made = []

    def launch(keys, values, length):
        made.append(length)
        return attention._reference_fresh(keys, values, length)

    def new():
        return KVCache() if kind == "kv" else RingCache(8)

    rng = np.random.default_rng(7)
    k, v = (mx.array(rng.normal(size=(1, 2, 16, 4)).astype(np.float32)) for _ in range(2))
    plain = new()
    want = [mnn_store(plain, k[:, :, :5], v[:, :, :5])]
    want += [mnn_store(plain, k[:, :, i:i + 1], v[:, :, i:i + 1]) for i in range(5, 12)]
    monkeypatch.setattr(attention, "kernel_allowed", lambda name: True)
    monkeypatch.setattr(attention, "_fresh_serves", lambda case: True)
    monkeypatch.setattr(attention, "_launch_fresh", launch)
    fused = new()
    got = [mnn_store(fused, k[:, :, :5], v[:, :, :5])]
    got += [mnn_store(fused, k[:, :, i:i + 1], v[:, :, i:i + 1]) for i in range(5, 12)]
    assert made == [256 if kind == "kv" else 8], made
    for g, w in zip(got, want):
        for a, b in zip(g, w):
            if isinstance(b, mx.array):
                np.testing.assert_array_equal(np.array(a), np.array(b))
            else:
                assert a == b
    for a, b in zip(fused.state, plain.state):
        np.testing.assert_array_equal(np.array(a), np.array(b))
    assert fused.offset == plain.offset == 12
    # not a first write, or (a ring) a block of its whole window: the cache's own write
    mnn_store(new(), k[:, :, :1], v[:, :, :1])
    if kind == "ring":
        mnn_store(new(), k[:, :, :8], v[:, :, :8])
    assert len(made) == 1, made


def mnn_store(cache, keys, values):
    return attention.store(cache, keys, values)


@on_cuda
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_a_first_write_matches_the_caches_own_on_the_gpu(dtype):
    from mlxrunner.cache import KVCache, RingCache

    mx.set_default_device(mx.gpu)
    keys = [mx.random.key(40 + i) for i in range(2)]
    k = mx.random.normal((1, 2, 300, 256), key=keys[0]).astype(dtype)
    v = mx.random.normal((1, 2, 300, 256), key=keys[1]).astype(dtype)
    for make in (KVCache, lambda: RingCache(512)):
        fused, plain = make(), make()
        assert attention.fresh_buffers(k, v, fused.fresh_length(300)) is not None, \
            "the kernel should serve this case"
        got = attention.store(fused, k, v)
        with settings.overridden(kernels=frozenset()):
            want = attention.store(plain, k, v)
        for a, b in [*zip(got[:2], want[:2]), *zip(fused.state, plain.state)]:
            np.testing.assert_array_equal(np.array(a.astype(mx.float32)),
                                          np.array(b.astype(mx.float32)))
