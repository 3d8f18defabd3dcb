"""topk_indices against a stable descending sort (numpy), both strategies."""

from __future__ import annotations

import logging
import math

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlxrunner import settings as mlxrunner_settings
from mlxrunner.plugin import topk_indices
from mlxrunner_test_support import graph_labels, logged

CUDA = hasattr(mx, "cuda") and mx.cuda.is_available()


@pytest.fixture
def gpu_default():
    """The GPU as the default device for one test: test modules collected with this one
    may have made the CPU the default at import, and the kernel serves only the GPU."""
    previous = mx.default_device()
    mx.set_default_device(mx.gpu)
    yield
    mx.set_default_device(previous)


def needs_cuda(test):
    """A test of the CUDA kernel itself: skipped off CUDA, run with the GPU as default."""
    return pytest.mark.skipif(not CUDA, reason="needs CUDA")(
        pytest.mark.usefixtures("gpu_default")(test))

STRATEGIES = ("cpu", "gpu")
BIG_KS = (1, 2, 16, 64, 1000, 2048)


def reference(x: np.ndarray, k: int) -> np.ndarray:
    """First k places of a stable descending sort; numpy sorts NaN last."""
    return np.argsort(-x, axis=-1, kind="stable")[..., :k]


def python_reference(row: list[float], k: int) -> list[int]:
    """Independent of numpy: NaN after numbers, larger first, ties to lower index."""
    def key(i: int) -> tuple[bool, float, int]:
        v = row[i]
        return (math.isnan(v), 0.0 if math.isnan(v) else -v, i)

    return sorted(range(len(row)), key=key)[:k]


def check(x: np.ndarray, k: int, dtype: mx.Dtype = mx.float32) -> None:
    want = reference(x.astype(np.float32), k)
    for strategy in STRATEGIES:
        got = np.array(topk_indices(mx.array(x).astype(dtype), k, strategy=strategy))
        assert got.dtype == np.int32
        assert got.shape == x.shape[:-1] + (k,)
        mismatch = np.argwhere(got != want)
        assert mismatch.size == 0, f"{strategy} k={k} first mismatch at {mismatch[:1].tolist()}"


def test_numpy_reference_matches_python_reference() -> None:
    rng = np.random.default_rng(1)
    for _ in range(50):
        n = int(rng.integers(1, 40))
        row = rng.choice([np.nan, -np.inf, np.inf, -0.0, 0.0, 1.5, -2.0], size=n)
        row = row.astype(np.float32)
        assert reference(row, n).tolist() == python_reference(row.tolist(), n)


def test_small_examples() -> None:
    x = np.array([1.0, np.nan, 3.0, -np.inf, 3.0, -0.0, 0.0, np.inf, np.nan], np.float32)
    for strategy in STRATEGIES:
        got = topk_indices(mx.array(x), 9, strategy=strategy).tolist()
        assert got == [7, 2, 4, 0, 5, 6, 3, 1, 8]
    assert topk_indices(mx.array(x), 1).tolist() == [7]
    subnormal = mx.array([1e-45, 0.0, -1e-45, -0.0], mx.float32)  # distinct from 0
    for strategy in STRATEGIES:
        assert topk_indices(subnormal, 4, strategy=strategy).tolist() == [0, 1, 3, 2]
    assert topk_indices(mx.array([np.nan, -np.inf], mx.float32), 1).tolist() == [1]
    assert topk_indices(mx.array([np.nan, np.nan], mx.float32), 1).tolist() == [0]


def test_no_rows() -> None:
    for n in (5, 70000):
        for strategy in STRATEGIES:
            got = topk_indices(mx.zeros((0, 3, n)), 2, strategy=strategy)
            assert got.shape == (0, 3, 2) and got.dtype == mx.int32


def test_default_strategy_follows_device() -> None:
    x = mx.random.normal((3, 5000), key=mx.random.key(0))
    assert topk_indices(x, 20).tolist() == topk_indices(x, 20, strategy="cpu").tolist()


@pytest.mark.parametrize("k", [0, 6])
def test_bad_k(k: int) -> None:
    with pytest.raises(ValueError, match="k must be between 1 and the row length 5"):
        topk_indices(mx.zeros((2, 5)), k)


def test_bad_input() -> None:
    with pytest.raises(ValueError, match="at least one axis"):
        topk_indices(mx.array(1.0), 1)
    with pytest.raises(ValueError, match="unknown strategy"):
        topk_indices(mx.zeros((5,)), 1, strategy="tpu")


special = st.sampled_from([math.nan, -math.inf, math.inf, -0.0, 0.0])
anything = st.one_of(st.floats(width=32, allow_nan=True, allow_infinity=True), special)


@st.composite
def rows_and_k(draw: st.DrawFn) -> tuple[np.ndarray, int]:
    lead = draw(st.lists(st.integers(1, 3), max_size=2))
    n = draw(st.integers(1, 300))
    kind = draw(st.sampled_from(["any", "three", "normal"]))
    size = int(np.prod(lead)) * n
    if kind == "three":
        values = draw(st.lists(st.sampled_from([-1.0, 0.5, 2.0]), min_size=size, max_size=size))
    elif kind == "normal":
        seed = draw(st.integers(0, 2**31))
        values = np.random.default_rng(seed).normal(size=size).tolist()
    else:
        values = draw(st.lists(anything, min_size=size, max_size=size))
    x = np.array(values, np.float32).reshape(*lead, n)
    return x, draw(st.integers(1, n))


@settings(max_examples=150, deadline=None)
@given(rows_and_k())
def test_small_rows_match_reference(case: tuple[np.ndarray, int]) -> None:
    x, k = case
    check(x, k)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 5000), st.integers(0, 2**31), st.sampled_from([mx.bfloat16, mx.float16]))
def test_low_precision_inputs(n: int, seed: int, dtype: mx.Dtype) -> None:
    rng = np.random.default_rng(seed)
    x = np.array(mx.array(rng.normal(size=(2, n)).astype(np.float32)).astype(dtype)
                 .astype(mx.float32))  # exactly representable: many ties
    k = int(rng.integers(1, min(n, 200) + 1))
    check(x, k, dtype)


def mixed_rows(rows: int, n: int, seed: int) -> np.ndarray:
    """Random, tie-heavy (values from a set of 3), NaN/-inf and constant rows."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, n)).astype(np.float32)
    for r in range(rows):
        kind = r % 4
        if kind == 1:
            x[r] = rng.choice(np.array([-1.0, 0.25, 3.0], np.float32), size=n)
        elif kind == 2:
            x[r, rng.integers(0, n, size=max(1, n // 10))] = np.nan
            x[r, rng.integers(0, n, size=max(1, n // 10))] = -np.inf
        elif kind == 3 and r % 8 == 3:
            x[r] = 0.5  # all ties
    return x


@pytest.mark.parametrize("n", [1, 2047, 2048, 2049])
@pytest.mark.parametrize("rows", [1, 64])
def test_chunk_boundaries(n: int, rows: int) -> None:
    x = mixed_rows(rows, n, seed=n + rows)
    for k in BIG_KS:
        if k <= n:
            check(x, k)
    check(x, n)


@pytest.mark.parametrize("n", [151936, 248320, 262144])
def test_vocabularies_batch_1(n: int) -> None:
    for kind in range(3):  # random, tie-heavy, NaN/-inf
        x = mixed_rows(kind + 1, n, seed=n)[kind:]
        for k in BIG_KS:
            check(x, k)


@pytest.mark.parametrize("n,ks", [(151936, (16, 2048)), (248320, (1, 64)), (262144, (2, 1000))])
def test_vocabularies_batch_64(n: int, ks: tuple[int, ...]) -> None:
    x = mixed_rows(64, n, seed=n + 64)
    want_all = reference(x, max(ks))
    for k in ks:
        want = want_all[..., :k]
        for strategy in STRATEGIES:
            got = np.array(topk_indices(mx.array(x), k, strategy=strategy))
            assert (got == want).all(), f"{strategy} n={n} k={k}"


@pytest.mark.parametrize("n", [2049, 70000])
def test_gpu_strategy_with_partitioned_chunks(n: int) -> None:
    # the variant that selects each chunk's k by partition instead of a sort
    from mlxrunner.decode import topk

    x = mixed_rows(4, n, seed=n)
    for k in (2, 20, 64, 512):
        got = np.array(topk._topk_gpu(mx.array(x), k, select="partition"))
        assert (got == reference(x, k)).all(), k


def chunk_keys_like_the_cuda_kernel(x: mx.array, k: int) -> mx.array:
    """What the CUDA kernel returns, from MLX ops: sorted unsigned keys per chunk."""
    from mlxrunner.decode import topk

    n = x.shape[-1]
    rows = x.reshape(-1, n)
    keys = topk._chunked_keys(rows, topk._index(-(-n // topk.CHUNK) * topk.CHUNK))
    unsigned = (keys ^ mx.array(-(2**63), dtype=mx.int64)).view(mx.uint64)
    return mx.sort(unsigned, axis=-1)[..., :k]


def test_gpu_strategy_levels_after_the_cuda_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    from mlxrunner.decode import topk

    monkeypatch.setattr(topk, "_cuda_first_k_per_chunk", chunk_keys_like_the_cuda_kernel)
    x = mixed_rows(4, 70000, seed=5)
    for k in (2, 20, 64, 512):
        got = np.array(topk._topk_gpu(mx.array(x).reshape(2, 2, -1), k, select="kernel"))
        assert (got.reshape(4, k) == reference(x, k)).all(), k


@needs_cuda
@pytest.mark.parametrize("n", [2049, 151936, 262144])
def test_cuda_kernel_strategy(n: int) -> None:
    from mlxrunner.decode import topk

    x = mixed_rows(8, n, seed=n)
    for dtype in (mx.float32, mx.bfloat16):
        xd = np.array(mx.array(x).astype(dtype).astype(mx.float32))
        for k in (2, 3, 20, 40, 64, 100, 512):
            direct = np.array(topk._cuda_first_k_per_chunk(mx.array(xd).astype(dtype), k))
            assert direct.shape == (8, -(-n // 2048), k)
            got = np.array(topk._topk_gpu(mx.array(xd).astype(dtype), k, select="kernel"))
            assert (got == reference(xd, k)).all(), (dtype, k)


# ---- the CUDA kernel's logic, checked off the GPU ---------------------------------


def _emulate_network(keys: np.ndarray, p: int) -> None:
    """The kernel's sort-and-halve network over one block's 2048 keys, in place."""
    from mlxrunner.decode import topk

    ch = topk.CHUNK
    t = np.arange(ch // 2)
    size = 2
    while size <= p:
        stride = size >> 1
        while stride > 0:
            lo = 2 * t - (t & (stride - 1))
            hi = lo + stride
            up = (size == p) | ((lo & size) == 0)
            a, bb = keys[lo], keys[hi]
            swap = (a > bb) == up
            keys[lo[swap]], keys[hi[swap]] = bb[swap], a[swap]
            stride >>= 1
        size <<= 1
    s = p
    while s < ch:
        pairs = ch // (2 * s)
        t2 = np.arange(pairs * p)
        g, i = t2 // p, t2 % p
        a_i = g * 2 * s + i
        b_i = g * 2 * s + s + (p - 1 - i)
        keys[a_i] = np.minimum(keys[a_i], keys[b_i])
        stride = p >> 1
        while stride > 0:
            t3 = np.arange(pairs * (p // 2))
            g, u = t3 // (p // 2), t3 % (p // 2)
            lo = g * 2 * s + 2 * u - (u & (stride - 1))
            hi = lo + stride
            a, bb = keys[lo], keys[hi]
            swap = a > bb
            keys[lo[swap]], keys[hi[swap]] = bb[swap], a[swap]
            stride >>= 1
        s <<= 1


def emulate_cuda_kernel(x: np.ndarray, k: int, subchunks: int | None = None) -> np.ndarray:
    """The kernel's exact index arithmetic in numpy (every stage's compare-swaps are
    disjoint, so each stage runs as one vectorised step): [rows, spans, k] uint64."""
    from mlxrunner.decode import topk

    rows_n, n = x.shape
    launch = topk.kernel_launch(rows_n, n, k, subchunks)
    n_t, k_t, p, m = (value for _, value in launch["template"])
    assert (n_t, k_t) == (n, k)
    ch = topk.CHUNK
    span = ch + (m - 1) * (ch - p)
    chunks = launch["grid"][0] // launch["threadgroup"][0]  # MLX: blocks = grid / threadgroup
    out = np.zeros((rows_n, chunks, k), np.uint64)
    bits = x.astype(np.float32).view(np.uint32)
    for row in range(rows_n):
        for chunk in range(chunks):
            keys = np.full(ch, np.iinfo(np.uint64).max, np.uint64)
            for sub in range(m):
                kept = 0 if sub == 0 else p
                first = chunk * span + (0 if sub == 0 else ch + (sub - 1) * (ch - p))
                if first >= n:
                    break
                idx = first + np.arange(ch - kept)
                fresh = np.full(ch - kept, np.iinfo(np.uint64).max, np.uint64)
                real = idx < n
                b = bits[row, idx[real]].copy()
                b[b == 0x80000000] = 0
                asc = np.where(b & 0x80000000, ~b, b | 0x80000000).astype(np.uint32)
                order = np.where((b & 0x7FFFFFFF) <= 0x7F800000, ~asc,
                                 0xFFFFFFFF).astype(np.uint64)
                fresh[real] = (order << np.uint64(32)) | idx[real].astype(np.uint64)
                keys[kept:] = fresh
                _emulate_network(keys, p)
            out[row, chunk] = keys[:k]
    return out


@pytest.mark.parametrize("n", [2049, 4096, 5000])
def test_cuda_kernel_algorithm_emulated(n: int) -> None:
    from mlxrunner.decode import topk

    x = mixed_rows(3, n, seed=n)
    for k in (2, 3, 20, 40, 100, 512):
        want = np.array(chunk_keys_like_the_cuda_kernel(mx.array(x), k))
        # padding: the kernel writes 2**64 - 1, the stand-in a NaN key past the row
        want[(want & np.uint64(0xFFFFFFFF)) >= n] = np.iinfo(np.uint64).max
        got = emulate_cuda_kernel(x, k)
        assert got.shape == want.shape == (3, -(-n // topk.CHUNK), k)
        assert (got == want).all(), k


@pytest.mark.parametrize("n,m", [(5000, 2), (9000, 3), (4100, 3)])
def test_cuda_kernel_spans_of_several_chunks_emulated(n: int, m: int) -> None:
    """A block that walks M sub-chunks keeps the first k of its whole span."""
    x = mixed_rows(2, n, seed=n + m)
    order = np.argsort(-x, axis=-1, kind="stable")
    for k in (2, 20, 64, 100):
        launch_span = 2048 + (m - 1) * (2048 - (1 << (k - 1).bit_length()))
        got = emulate_cuda_kernel(x, k, subchunks=m)
        assert got.shape == (2, -(-n // launch_span), k)
        for row in range(2):
            for span in range(got.shape[1]):
                lo, hi = span * launch_span, min(n, (span + 1) * launch_span)
                inside = order[row][(order[row] >= lo) & (order[row] < hi)][:k]
                got_index = (got[row, span] & np.uint64(0xFFFFFFFF)).astype(np.int64)
                real = got[row, span] != np.iinfo(np.uint64).max
                assert got_index[real].tolist() == inside.tolist(), (k, row, span)


@pytest.mark.parametrize("rows,n,k,m", [(64, 151936, 64, 3), (64, 262144, 64, 5),
                                        (64, 262144, 20, 2), (64, 151936, 20, 1),
                                        (1, 151936, 64, 1), (8, 151936, 64, 1)])
def test_cuda_kernel_span_choice(rows: int, n: int, k: int, m: int) -> None:
    """Long spans only where the rows keep the GPU busy, and then just long enough to leave
    one block sort of candidates."""
    from mlxrunner.decode import topk

    launch = topk.kernel_launch(rows, n, k)
    assert dict(launch["template"])["M"] == m
    if m > 1:
        assert launch["chunks"] * k <= topk.CHUNK
        assert rows * launch["chunks"] >= topk.KERNEL_MIN_BLOCKS


@pytest.mark.parametrize("n,k", [(2049, 2), (2049, 512), (151936, 40), (262144, 64)])
def test_cuda_kernel_launch_geometry(n: int, k: int) -> None:
    from mlxrunner.decode import topk

    launch = topk.kernel_launch(8, n, k)
    chunks = launch["chunks"]
    assert (chunks - 1) * topk.CHUNK < n <= chunks * topk.CHUNK
    assert launch["grid"] == (chunks * 256, 8, 1) and launch["threadgroup"] == (256, 1, 1)
    assert launch["output_shape"] == (8, chunks, k)
    power = dict(launch["template"])["P"]
    assert power >= k and power & (power - 1) == 0 and power < 2 * k
    assert all(type(v) is int for _, v in launch["template"])  # MLX takes int, bool, Dtype


@pytest.fixture
def fresh_kernel_state(monkeypatch: pytest.MonkeyPatch):
    from mlxrunner.decode import topk
    from mlxrunner.nn import kernels

    monkeypatch.setattr(topk, "_kernel_refused", set())
    monkeypatch.setattr(kernels, "_verdicts", {})
    monkeypatch.setattr(topk, "_cuda_ready", lambda: True)
    return topk


@pytest.fixture
def kernel_calls(fresh_kernel_state, monkeypatch) -> list:
    """The shapes the (stand-in) kernel is called with; it computes what the kernel does."""
    calls = []

    def stand_in(x: mx.array, k: int, subchunks: int | None = None) -> mx.array:
        calls.append(x.shape)
        return chunk_keys_like_the_cuda_kernel(x, k)

    monkeypatch.setattr(fresh_kernel_state, "_cuda_first_k_per_chunk", stand_in)
    return calls


def test_kernel_is_the_default_when_it_checks_out(fresh_kernel_state, kernel_calls) -> None:
    topk, calls = fresh_kernel_state, kernel_calls
    x = mixed_rows(4, 5000, seed=3)
    for _ in range(2):
        got = np.array(topk._topk_gpu(mx.array(x), 20))
        assert (got == reference(x, 20)).all()
    # one first-use check (2 probe rows), then the two real calls; no second check
    assert calls == [(2, 5000), (4, 5000), (4, 5000)]
    assert topk.kernel_status() == "on"


def test_prepare_settles_the_check_before_a_trace(fresh_kernel_state, kernel_calls,
                                                  monkeypatch) -> None:
    """prepare_topk_indices runs the first-use check eagerly, so a later call (inside a
    trace) finds it settled; on the CPU and for k = 1 it does nothing."""
    from mlxrunner.nn import kernels
    from mlxrunner.plugin import prepare_topk_indices

    topk, calls = fresh_kernel_state, kernel_calls
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)
    prepare_topk_indices(1, 5000, 1)
    assert calls == []
    prepare_topk_indices(1, 5000, 16)
    assert calls == [(2, 5000)] and kernels._verdicts[
        ("topk", ("chunk", 5000, 16, "mlx.core.float32", 1))] is True
    got = mx.compile(lambda x: topk._topk_gpu(x, 16))(mx.array(mixed_rows(1, 5000, seed=2)))
    assert (np.array(got) == reference(mixed_rows(1, 5000, seed=2), 16)).all()
    assert calls == [(2, 5000), (1, 5000)]  # no second check
    monkeypatch.setattr(mx, "default_device", lambda: mx.cpu)
    prepare_topk_indices(1, 7000, 16)
    assert calls == [(2, 5000), (1, 5000)]


@pytest.mark.parametrize("failure", ["raises", "wrong"])
def test_kernel_falls_back_with_one_warning_a_case(fresh_kernel_state, monkeypatch, caplog,
                                                   failure) -> None:
    """A case whose check fails (the kernel refused, or a wrong answer) logs one warning
    naming it and is sorted, exactly, from then on; each case is checked on its own."""
    topk = fresh_kernel_state

    def broken(x: mx.array, k: int, subchunks: int | None = None) -> mx.array:
        if failure == "raises":
            raise ValueError("[custom_kernel] something the GPU refused")
        keys = chunk_keys_like_the_cuda_kernel(x, k)
        return mx.concatenate([keys[..., 1:], keys[..., -1:]], axis=-1)  # loses each best

    monkeypatch.setattr(topk, "_cuda_first_k_per_chunk", broken)
    x = mixed_rows(4, 5000, seed=4)
    warned = "unavailable (ValueError" if failure == "raises" else "disagrees with the"
    with caplog.at_level(logging.WARNING, logger="mlxrunner.nn"):
        for _ in range(2):
            got = np.array(topk._topk_gpu(mx.array(x), 20))
            assert (got == reference(x, 20)).all()
        assert logged(caplog).count(f"topk_indices: the CUDA chunk kernel {warned}") == 1
        got = np.array(topk._topk_gpu(mx.array(x), 64))  # another case, checked anew
        assert (got == reference(x, 64)).all()
        assert logged(caplog).count("topk_indices: the CUDA chunk kernel") == 1
    assert topk.kernel_status() == ("off for 2 case(s) that failed their check "
                                    "(first: N=5000, K=20, mlx.core.float32)")


def test_the_chunk_kernel_is_off_where_turned_off(fresh_kernel_state, kernel_calls) -> None:
    """MLXRUNNER_KERNELS without topk: the chunked sort, no check, and the status says so."""
    topk, calls = fresh_kernel_state, kernel_calls
    x = mixed_rows(2, 5000, seed=5)
    with mlxrunner_settings.overridden(kernels=frozenset({"attention"})):
        assert (np.array(topk._topk_gpu(mx.array(x), 20)) == reference(x, 20)).all()
        assert topk.kernel_status() == "off: turned off (MLXRUNNER_KERNELS)"
    assert calls == []


def test_check_rows_cover_the_ordering_rules() -> None:
    from mlxrunner.decode import topk

    rows = np.array(topk.check_rows(2, 2049))
    assert np.isnan(rows).any() and np.isneginf(rows).any() and np.isposinf(rows).any()
    assert (np.signbit(rows) & (rows == 0)).any()  # -0.0
    assert len(np.unique(rows[~np.isnan(rows)])) < rows.size - 1000  # many ties


def test_check_rows_build_no_gather() -> None:
    """The greedy pick's self-check runs before a fresh run's first token: a gather in its
    rows would be a kernel MLX's CUDA backend builds then (seconds, bench/startup.py)."""
    from mlxrunner.decode import topk

    labels = graph_labels(topk.check_rows(3, 2051))
    assert not [label for label in labels if "Gather" in label], labels


@needs_cuda
def test_cuda_kernel_is_the_gpu_default() -> None:
    from mlxrunner.decode import topk

    x = mixed_rows(8, 151936, seed=1)
    got = np.array(topk_indices(mx.array(x), 40))
    assert (got == reference(x, 40)).all()
    assert topk.kernel_status() == "on"


@needs_cuda
@pytest.mark.parametrize("n,k", [(151936, 64), (262144, 20), (262144, 64)])
def test_cuda_kernel_long_spans_at_batch_64(n: int, k: int) -> None:
    from mlxrunner.decode import topk

    assert dict(topk.kernel_launch(64, n, k)["template"])["M"] > 1
    x = mixed_rows(64, n, seed=k)
    got = np.array(topk._topk_gpu(mx.array(x), k, select="kernel"))
    assert (got == reference(x, k)).all()


@pytest.mark.skipif(not __import__("mlxrunner.testing.cuda_emulation", fromlist=["_"])
                    .emulation_available(), reason="needs a host C++ compiler (g++)")
@pytest.mark.parametrize("n,k,m", [(5000, 20, 1), (5000, 64, 2), (9000, 64, 3), (4100, 2, 3)])
def test_cuda_kernel_source_runs_on_the_cpu(n: int, k: int, m: int) -> None:
    """The kernel source itself (not a re-implementation) under the host emulation of
    CUDA's threads: each span's first k keys, in order, for one and several sub-chunks."""
    from mlxrunner.decode import topk
    from mlxrunner.testing.cuda_emulation import emulate_kernel

    x = mixed_rows(2, n, seed=n + k)
    launch = topk.kernel_launch(2, n, k, subchunks=m)
    got = emulate_kernel(topk._CUDA_CHUNK_TOPK, {"x": x.astype(np.float32)},
                         {"out": (launch["output_shape"], np.uint64)},
                         launch["template"], blocks=(launch["chunks"], 2), threads=256)["out"]
    assert (got == emulate_cuda_kernel(x, k, subchunks=m)).all()


@pytest.mark.skipif(not __import__("mlxrunner.testing.cuda_emulation", fromlist=["_"])
                    .emulation_available(), reason="needs a host C++ compiler (g++)")
@pytest.mark.parametrize("n", [4096, 4099, 70])
def test_greedy_kernel_source_runs_on_the_cpu(n: int) -> None:
    """The greedy pick's kernel source under the host emulation: each row's first index of
    its largest value (NaN last, ties to the lower index, every row kind of mixed_rows),
    16 bytes a load (n a whole number of them) and one entry a load."""
    from mlxrunner.decode import topk
    from mlxrunner.testing.cuda_emulation import emulate_kernel

    x = mixed_rows(8, n, seed=n)
    x[0, [3, n - 1]] = np.float32(7.0)  # two maxima: the first wins
    x[2, :] = np.nan  # all NaN: index 0, as the sort has it
    x[4, [1, 5]] = [np.float32(-0.0), np.float32(0.0)]
    x[4, x[4] > 0] = -1.0  # then -0.0 and 0.0 are the row's largest: the first
    got = emulate_kernel(topk._CUDA_GREEDY, {"x": x},
                         {"out": ((8, 1), np.int32)},
                         [("T", mx.float32), ("N", n), ("NT", topk.GREEDY_THREADS)],
                         blocks=8, threads=topk.GREEDY_THREADS)["out"]
    assert (got == reference(x, 1)).all()
    assert got[4, 0] == 1


@needs_cuda
@pytest.mark.parametrize("n", [151936, 262144, 4099])
def test_greedy_kernel_on_the_gpu(n: int) -> None:
    from mlxrunner.decode import topk

    x = mixed_rows(8, n, seed=n + 1)
    for dtype in (mx.float32, mx.bfloat16):
        xd = np.array(mx.array(x).astype(dtype).astype(mx.float32))
        rows = mx.array(xd).astype(dtype)
        assert topk._greedy_serves(rows)  # its self-check passed
        got = np.array(topk._greedy(rows.reshape(2, 4, n)))
        assert got.shape == (2, 4, 1)
        assert (got.reshape(8, 1) == reference(xd, 1)).all(), dtype
