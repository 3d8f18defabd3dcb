"""Our CUDA kernel sources build, off the GPU, the way the core builds them.

On the GPU machine the core builds each kernel with NVRTC into a cubin once and keeps it in
MLX's kernel cache folder (mlxrunner.nn.cuda_build); a source that does not build there only
shows as a kernel turned off (one warning, the slower path). These tests build each source
for the H200 (``sm_90``) with the core's builder, which needs no GPU. They run where NVRTC
and the CUDA headers are installed (requirements-test.txt installs them on x86-64 Linux,
about 90 MB) and skip elsewhere.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest

from mlxrunner.nn import cuda_build

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16,
          "int32": mx.int32, "uint32": mx.uint32, "uint64": mx.uint64, "bool": mx.bool_}


@pytest.fixture
def builder(tmp_path: Path) -> cuda_build.Builder:
    nvrtc = cuda_build.find_nvrtc()
    if nvrtc is None:
        pytest.skip("NVRTC and the CUDA headers are not installed "
                    "(pip install nvidia-cuda-nvrtc-cu12 nvidia-cuda-runtime-cu12)")
    return cuda_build.Builder(nvrtc, "sm_90", tmp_path)


def _wrap(name: str, source: str, inputs: list[tuple[str, str]],
          outputs: list[tuple[str, str]], template: list[tuple[str, Any]],
          absent: tuple[str, ...] = ()) -> str:
    """The unit the core builds; the inputs and outputs named in ``absent`` left out of the
    launch as the core leaves those the case does not use (a null pointer in the source)."""
    return cuda_build.kernel_source(
        name, source, [(n, DTYPES[t]) for n, t in inputs if n not in absent],
        [(n, DTYPES[t]) for n, t in outputs if n not in absent],
        [(k, DTYPES[v] if isinstance(v, str) else v) for k, v in template],
        [(n, DTYPES[t]) for n, t in inputs if n in absent],
        [(n, DTYPES[t]) for n, t in outputs if n in absent])


def _compile(builder: cuda_build.Builder, name: str, source: str) -> None:
    try:
        _, cubin = builder.cubin(source)
    except RuntimeError as exc:
        pytest.fail(f"{name} does not build:\n{exc}")
    assert cubin[:4] == b"\x7fELF", f"{name}: not a cubin"
    assert name.encode() in cubin  # the kernel under its C name, as the launch asks for it


def test_a_kernels_code_is_worked_out_once_a_process() -> None:
    """Every fused-kernel call of an eager forward asks its kernel's code (the key of its
    kept verdicts): the modules' texts are read and joined once, then the same answer."""
    from mlxrunner.nn import cuda_products

    first = cuda_build.kernel_code(cuda_products.__file__)
    assert first is not None and first is cuda_build.kernel_code(cuda_products.__file__)


def test_a_built_kernel_is_read_back_not_built_again(builder: cuda_build.Builder) -> None:
    from mlxrunner.decode import topk

    launch = topk.kernel_launch(1, 151936, 64)
    source = _wrap("topk", topk._CUDA_CHUNK_TOPK, [("x", "float32")], [("out", "uint64")],
                   launch["template"])
    key, cubin = builder.cubin(source)
    assert builder.compiled == 1
    assert [p.name for p in builder.folder.iterdir()] == [f"{key}.cubin"]  # no temporary left
    again = cuda_build.Builder(builder.nvrtc, builder.arch, builder.folder)
    assert again.cubin(source) == (key, cubin) and again.compiled == 0
    other = cuda_build.Builder(builder.nvrtc, "sm_80", builder.folder)  # another GPU
    assert other.cubin(source)[0] != key and other.compiled == 1


def test_a_kernels_cases_are_built_once_and_told_apart(builder: cuda_build.Builder,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel builds each case (its inputs' and outputs' dtypes, which of them are
    absent, its template values with their types) once: a case met again launches the same
    image without building, whatever its arrays' shapes; a template's True against 1 and an
    absent input against a given one of its dtype are other sources, built apart."""
    launched: list[dict[str, Any]] = []
    monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel",
                        lambda **launch: launched.append(launch) or [])
    monkeypatch.setattr(cuda_build, "_builder", builder)
    kernel = cuda_build.CudaKernel(
        "mlxrunner_case_test", ["x", "y"], ["out"],
        "out[threadIdx.x] = x[threadIdx.x] + (y ? y[threadIdx.x] : T(0)) * T(S);")

    def launch(n: int, y: bool, s: int | bool) -> dict[str, Any]:
        x = mx.zeros((n,))
        kernel(inputs=[x, x if y else mx.float32], template=[("T", mx.float32), ("S", s)],
               grid=(n, 1, 1), threadgroup=(n, 1, 1), output_shapes=[(n,)],
               output_dtypes=[mx.float32])
        return launched[-1]

    first = launch(4, True, 1)
    assert builder.compiled == 1 and len(first["inputs"]) == 2
    again = launch(8, True, 1)
    assert builder.compiled == 1 and again["compiled_source"] is first["compiled_source"]
    assert again["output_shapes"] == [(8,)] and again["output_dtypes"] == [mx.float32]
    launch(4, True, True)  # (S spelled ``true``: the same machine code, another source)
    assert builder.compiled == 2
    absent = launch(4, False, 1)
    assert builder.compiled == 3 and len(absent["inputs"]) == 1
    assert absent["compiled_source"] != first["compiled_source"]
    launch(4, True, True), launch(4, False, 1)
    assert builder.compiled == 3 and len(launched) == 6
    # a case the caller names is found by its name alone (the caller vouches that the name
    # settles the source: here a second template under the same name is not even read)
    named = [kernel(inputs=[mx.zeros((4,)), mx.zeros((4,))], template=template,
                    grid=(4, 1, 1), threadgroup=(4, 1, 1), output_shapes=[(4,)],
                    output_dtypes=[mx.float32], case=("named", 2))
             for template in ([("T", mx.float32), ("S", 2)], [("T", mx.float32), ("S", 3)])]
    assert builder.compiled == 4 and named == [[], []]
    assert launched[-1]["compiled_source"] is launched[-2]["compiled_source"]


def _product_source() -> str:
    from mlxrunner.nn import cuda_products

    template = [("T", "bfloat16"), ("K", 1024), ("N", 3584), ("M", 1), ("NT", 256),
                ("RES", False), ("GLU", 1), ("UPX", False), ("ADDN", False)]
    inputs = [("x", "bfloat16"), ("w", "bfloat16"), ("res", "bfloat16"), ("up_x", "bfloat16")]
    return _wrap("mlxrunner_product", cuda_products.PRODUCT_SOURCE, inputs,
                 [("y", "bfloat16")], template)


def _cuobjdump() -> Path | None:
    """NVIDIA's cuobjdump (the ``nvidia-cuda-cuobjdump`` wheel): reads fat binaries."""
    for entry in sys.path:
        found = sorted(Path(entry).glob("nvidia/*/bin/cuobjdump")) if entry else []
        if found:
            return found[0]
    return None


def test_a_packed_kernel_is_its_cubin_in_fewer_bytes(builder: cuda_build.Builder,
                                                             tmp_path: Path) -> None:
    """A launch's packed image holds the very cubin (cuobjdump, NVIDIA's reader of fat
    binaries, extracts it byte for byte) in well under half its bytes, which MLX hashes
    at every launch."""
    packer, reader = cuda_build.find_nvfatbin(), _cuobjdump()
    if packer is None or reader is None:
        pytest.skip("nvFatbin or cuobjdump is not installed "
                    "(pip install nvidia-nvfatbin nvidia-cuda-cuobjdump)")
    _, cubin = builder.cubin(_product_source())
    image = packer.pack(cubin, "sm_90")
    assert image[:4] == bytes.fromhex("50ed55ba")  # a fat binary (0xBA55ED50), not an ELF
    assert len(image) < 0.45 * len(cubin), (len(image), len(cubin))
    out = tmp_path / "out"
    out.mkdir()
    (tmp_path / "k.fatbin").write_bytes(image)
    listed = subprocess.run([str(reader), "-lelf", str(tmp_path / "k.fatbin")], check=True,
                            capture_output=True, text=True).stdout
    assert "sm_90" in listed, listed
    subprocess.run([str(reader), "-xelf", "all", str(tmp_path / "k.fatbin")], check=True,
                   capture_output=True, cwd=out)
    assert [p.read_bytes() for p in out.iterdir()] == [cubin]


def _zstd(image: bytes) -> bool:
    """Whether a fat binary's one entry is compressed with zstd (its flags' bit 0x8000;
    LZ4: 0x2000), read off the entry's header (flags at its byte 40)."""
    flags = int.from_bytes(image[16 + 40:16 + 48], "little")
    assert flags & 0xA000, hex(flags)  # compressed one way or the other
    return bool(flags & 0x8000)


def test_packed_images_are_kept_and_used_only_where_the_driver_loads_them(
        builder: cuda_build.Builder, monkeypatch: pytest.MonkeyPatch) -> None:
    if cuda_build.find_nvfatbin() is None:
        pytest.skip("nvFatbin is not installed (pip install nvidia-nvfatbin)")
    key, cubin = builder.cubin(_product_source())
    assert builder.image(key, cubin) is cubin  # no packer: the cubin
    loaded: list[bytes] = []
    monkeypatch.setattr(cuda_build, "driver_loads", lambda image: loaded.append(image) or True)
    packing = cuda_build.Builder(builder.nvrtc, builder.arch, builder.folder,
                                 cuda_build.find_nvfatbin())
    image = packing.image(key, cubin)
    assert image != cubin and _zstd(image) and loaded == [image]  # the driver loaded it
    assert sorted(p.name for p in builder.folder.iterdir()) == [f"{key}.cubin",
                                                                f"{key}.size.fatbin"]
    assert packing.image(key, cubin) is image and loaded == [image]  # once

    class Refusing(cuda_build.NvFatbin):
        def pack(self, cubin: bytes, arch: str) -> bytes:
            raise AssertionError("packed again")

    reader = Refusing(packing.packer.lib._name)  # type: ignore[union-attr]
    again = cuda_build.Builder(builder.nvrtc, builder.arch, builder.folder, reader)
    assert again.image(key, cubin) == image  # read back from the folder

    # a driver that reads LZ4 alone (before CUDA 12.8): the next mode
    monkeypatch.setattr(cuda_build, "driver_loads", lambda image: not _zstd(image))
    older = cuda_build.Builder(builder.nvrtc, builder.arch, builder.folder,
                               cuda_build.find_nvfatbin())
    lz4 = older.image(key, cubin)
    assert not _zstd(lz4) and len(image) < len(lz4) < 0.6 * len(cubin)
    assert older.packer is not None and older.packer.mode == "speed"
    # one that reads neither: the cubins
    monkeypatch.setattr(cuda_build, "driver_loads", lambda image: False)
    oldest = cuda_build.Builder(builder.nvrtc, builder.arch, builder.folder,
                                cuda_build.find_nvfatbin())
    assert oldest.image(key, cubin) is cubin and oldest.packer is None


def test_a_pack_that_fails_is_tried_once_a_kernel(builder: cuda_build.Builder,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """An nvFatbin that refuses (too old for the options, say): the cubin, and no second
    try at the next launch of the same kernel (every eager step launches it again)."""
    packer = cuda_build.find_nvfatbin()
    if packer is None:
        pytest.skip("nvFatbin is not installed (pip install nvidia-nvfatbin)")
    tries = []

    class Failing(cuda_build.NvFatbin):
        def pack(self, cubin: bytes, arch: str) -> bytes:
            tries.append(arch)
            raise RuntimeError("nvFatbinCreate failed (4)")

    monkeypatch.setattr(cuda_build, "driver_loads", lambda image: True)
    key, cubin = builder.cubin(_product_source())
    failing = cuda_build.Builder(builder.nvrtc, builder.arch, builder.folder,
                                 Failing(packer.lib._name))
    assert [failing.image(key, cubin) for _ in range(3)] == [cubin] * 3 and len(tries) == 1


def test_a_source_that_does_not_build_says_why(builder: cuda_build.Builder) -> None:
    source = _wrap("broken", "out[0] = undeclared_name;", [("x", "float32")],
                   [("out", "float32")], [])
    with pytest.raises(RuntimeError, match="undeclared_name"):
        builder.cubin(source)
    assert list(builder.folder.glob("*")) == []


@pytest.mark.parametrize("rows,n,k", [(1, 151936, 64), (64, 151936, 64), (64, 262144, 20)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_topk_chunk_kernel_compiles(builder, rows: int, n: int, k: int, dtype: str) -> None:
    from mlxrunner.decode import topk

    launch = topk.kernel_launch(rows, n, k)
    _compile(builder, "topk", _wrap("topk", topk._CUDA_CHUNK_TOPK, [("x", dtype)],
                                  [("out", "uint64")], launch["template"]))


@pytest.mark.parametrize("n", [151936, 4099])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_greedy_kernel_compiles(builder, n: int, dtype: str) -> None:
    from mlxrunner.decode import topk

    _compile(builder, "greedy", _wrap("greedy", topk._CUDA_GREEDY, [("x", dtype)],
                                      [("out", "int32")],
                                      [("T", dtype), ("N", n), ("NT", topk.GREEDY_THREADS)]))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_deltanet_kernels_compile(builder, dtype: str) -> None:
    from mlxrunner.nn import cuda_deltanet as ck

    inputs = [("proj", dtype), ("conv_tail", dtype), ("state", "float32"),
              ("conv_weight", dtype), ("A_log", dtype), ("dt_bias", dtype),
              ("norm_weight", dtype)]
    shape = [("T", dtype), ("Hk", 16), ("Hv", 16), ("Dk", 128), ("Dv", 128), ("K", 4),
             ("C", 6144), ("P", 8224), ("OZ", 6144), ("OB", 8192), ("OA", 8208)]
    step = [("out", dtype), ("new_tail", dtype), ("new_state", "float32")]
    _compile(builder, "step", _wrap("step", ck.DELTANET_STEP_SOURCE, inputs, step,
                                  shape + [("NT", 512), ("EPS_E9", 1000)]))
    block = step + [("k_out", "float32"), ("delta_out", "float32"), ("g_out", "float32")]
    _compile(builder, "block", _wrap("block", ck.DELTANET_BLOCK_SOURCE, inputs, block,
                                   shape + [("L", 8), ("NT", 512), ("EPS_E9", 1000)]))


# the query's heads work in the kernel: none; Gemma 4's sliding query (weighted norm, all
# 256 dims rotated by base) and full one (512, a quarter rotated by periods); interleaved
# pairs at an offset a sequence, taking half of each head (Qwen3.5's query and gate)
QUERY_HEADS = {"none": (False, (256, 0, 0, False, 2, False, False, False)),
               "sliding": (True, (256, 0, 2, True, 256, False, False, False)),
               "full": (True, (512, 0, 2, True, 128, False, True, False)),
               "interleaved": (True, (256, 0, 1, True, 64, True, False, True))}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("D,mask,query", [(256, 0, "none"), (512, 1, "none"), (128, 2, "none"),
                                          (256, 0, "sliding"), (512, 1, "full"),
                                          (128, 2, "interleaved"), (2, 1, "none")])
@pytest.mark.parametrize("split", [False, True])
def test_attention_kernel_compiles(builder, dtype: str, D: int, mask: int, query: str,
                                   split: bool) -> None:
    from mlxrunner.nn import attention as nn

    inputs = [("q", dtype), ("keys", dtype), ("values", dtype), ("scale", "float32"),
              ("mask", "bool"), ("dims", "int32"), ("gate", dtype), ("cnt", "int32"),
              ("qw", dtype), ("qeps", "float32"), ("qoff", "int32"), ("qfreqs", "float32"),
              ("qrf", "float32")]
    outputs = [("out", dtype), ("parts", "float32")]
    heads, (width, start, norm, rot, dims, trad, freqs, perb) = QUERY_HEADS[query]
    if query == "interleaved":
        width, start = 2 * D, D
    template = [("T", dtype), ("HQ", 8), ("HK", 2), ("D", D), ("DV", min(D, 512)),
                ("NT", nn.SPLIT_THREADS if split else nn.ATTEND_THREADS),
                ("U", nn.keys_at_once(D, min(D, 512))), ("MASK", mask),
                ("GATE", mask == 0), ("SPLIT", split), ("PMAX", nn.SPLIT_BLOCKS),
                ("QH", heads), ("QW", width), ("QC", start), ("QNORM", norm), ("QROT", rot),
                ("QRD", dims), ("QTRAD", trad), ("QFREQS", freqs), ("QPERB", perb)]
    absent = (("mask",) if mask == 0 else ("gate",)) + \
        (() if split else ("cnt", "parts")) + \
        (() if heads else ("qw", "qeps", "qoff", "qrf")) + \
        (() if norm == 2 else ("qw",)) + (() if freqs else ("qfreqs",))
    _compile(builder, "attend", _wrap("attend", nn.ATTEND_SOURCE, inputs, outputs, template,
                                    absent=absent))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("res,glu,upx", [(False, 0, False), (True, 0, False), (False, 1, False),
                                        (False, 2, False), (False, 2, True)])
@pytest.mark.parametrize("rows", [1, 4])  # a decode step; the most rows a product takes
def test_fused_product_kernel_compiles(builder, dtype: str, res: bool, glu: int,
                                       upx: bool, rows: int) -> None:
    from mlxrunner.nn import cuda_products

    assert rows <= cuda_products.MAX_ROWS
    template = [("T", dtype), ("K", 2048), ("N", 2048), ("M", rows), ("NT", 256),
                ("RES", res), ("GLU", glu), ("UPX", upx), ("ADDN", False)]
    inputs = [("x", dtype), ("w", dtype), ("res", dtype), ("up_x", dtype)]
    unread = (() if res else ("res",)) + (() if upx else ("up_x",))
    _compile(builder, "mlxrunner_product", _wrap(
        "mlxrunner_product", cuda_products.PRODUCT_SOURCE, inputs, [("y", dtype)], template,
        absent=unread))
    if not (res or glu):  # a post norm's residual add after it, with a scale and without
        for scaled in (False, True):
            _compile(builder, "mlxrunner_product_add_norm", _wrap(
                "mlxrunner_product_add_norm", cuda_products.PRODUCT_ADD_NORM_SOURCE,
                inputs + [("pw", dtype), ("pres", dtype), ("ps", dtype), ("peps", "float32"),
                          ("cnt", "int32")], [("y", dtype), ("h", dtype)],
                template[:-1] + [("ADDN", True), ("PSCALE", scaled)],
                absent=unread + (() if scaled else ("ps",))))
    if not glu:  # the norm of its final rows after it: the residual sum, or a post norm's
        for addn, scaled in ([(False, False)] if res else
                             [(False, False), (True, False), (True, True)]):
            _compile(builder, "mlxrunner_product_norm", _wrap(
                "mlxrunner_product_norm", cuda_products.PRODUCT_NORM_SOURCE,
                inputs + [("pw", dtype), ("pres", dtype), ("ps", dtype), ("peps", "float32"),
                          ("cnt", "int32"), ("nw", dtype), ("neps", "float32")],
                [("y", dtype), ("h", dtype), ("hn", dtype)],
                template[:-1] + [("ADDN", addn), ("PSCALE", scaled)],
                absent=unread + (() if scaled else ("ps",))
                + (() if addn else ("pw", "pres", "peps", "h"))))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("rows", [1, 4])
def test_chained_product_kernels_compile(builder, dtype: str, rows: int) -> None:
    """Chains as a decode step makes them, at Gemma 4 E2B's sizes: a layer's end (o with
    its post norm's add and the next norm, gate/up, down with a post norm's add of o's
    stream, the per-layer gate times its input, the projection with a scaled add and the
    next norm, the next layer's q/k/v) and a pre-norm MLP (gate/up, down plus a residual
    written earlier in the launch, with the norm after it)."""
    from mlxrunner.nn import cuda_products
    from mlxrunner.nn.cuda_products import Link, Ref

    t = DTYPES[dtype]

    def rows_of(n: int) -> mx.array:
        return mx.zeros((rows, n), t)

    def weight(n: int, k: int) -> mx.array:
        return mx.zeros((n, k), t)

    norm = (mx.ones((1536,), t), 1e-6)
    layer_end = [
        Link(rows_of(2048), weight(1536, 2048), post=(rows_of(1536), *norm, None), then=norm),
        Link(rows_of(1536), weight(12288, 1536), 2),
        Link(rows_of(6144), weight(1536, 6144), post=(Ref(0, "h"), *norm, None)),
        Link(rows_of(1536), weight(256, 1536), 2, up=rows_of(256)),
        Link(rows_of(256), weight(1536, 256), post=(Ref(2, "h"), *norm, mx.ones((1,), t)),
             then=norm),
        Link(rows_of(1536), weight(3072, 1536))]
    mlp = [Link(rows_of(1536), weight(12288, 1536), 1),
           Link(rows_of(6144), weight(1536, 6144), residual=rows_of(1536), then=norm)]
    for links in (layer_end, mlp):
        kernel, inputs, template, _, _ = cuda_products.chain_arguments(links)
        source = cuda_build.kernel_source(
            kernel.name, kernel.source, [(n, a.dtype) for n, a in inputs.items()],
            [(n, t) for n in kernel.output_names], template)
        _compile(builder, kernel.name, source)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("freqs,trad,per_sequence,positions", [
    (False, False, False, 2), (True, False, True, 2), (False, True, False, 2),
    (True, False, False, 0)])
def test_heads_kernel_compiles(builder, dtype: str, freqs: bool, trad: bool,
                               per_sequence: bool, positions: int) -> None:
    from mlxrunner.nn import cuda_norms

    template = [("T", dtype), ("D", 256), ("H0", 8), ("H1", 2), ("H2", 2), ("W0", 512),
                ("W1", 256), ("W2", 256), ("C0", 0), ("C1", 0), ("C2", 0), ("NORM0", 2),
                ("NORM1", 2), ("NORM2", 1), ("ROT0", True), ("ROT1", True), ("ROT2", False),
                ("RD", 64), ("TRAD", trad), ("FREQS", freqs), ("L", positions),
                ("PERB", per_sequence), ("NT", cuda_norms.HEAD_THREADS)]
    inputs = [(n, dtype) for n in ("x0", "x1", "x2", "w0", "w1", "w2")]
    inputs += [("eps", "float32"), ("offset", "int32"), ("freqs", "float32"), ("rf", "float32")]
    _compile(builder, "mlxrunner_heads", _wrap(
        "mlxrunner_heads", cuda_norms.HEADS_SOURCE, inputs,
        [(n, dtype) for n in ("y0", "y1", "y2")], template,
        absent=("w2",) + (() if freqs else ("freqs",))))
    alone = {"H1": 0, "H2": 0, "W1": 256, "W2": 256, "NORM1": 0, "NORM2": 0, "ROT1": False,
             "ROT2": False}  # (a layer's queries alone, the others as the core fills them)
    one_part = [(k, alone.get(k, v)) for k, v in template]
    _compile(builder, "mlxrunner_heads", _wrap(
        "mlxrunner_heads", cuda_norms.HEADS_SOURCE, inputs,
        [(n, dtype) for n in ("y0", "y1", "y2")], one_part,
        absent=("x1", "x2", "w1", "w2", "y1", "y2") + (() if freqs else ("freqs",))))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("scale", [False, True])
def test_add_norm_kernel_compiles(builder, dtype: str, scale: bool) -> None:
    from mlxrunner.nn import cuda_norms

    _compile(builder, "mlxrunner_add_norm", _wrap(
        "mlxrunner_add_norm", cuda_norms.ADD_NORM_SOURCE,
        [("x", dtype), ("w", dtype), ("res", dtype), ("s", dtype), ("eps", "float32")],
        [("y", dtype)], [("T", dtype), ("D", 1536), ("NT", cuda_norms.ADD_THREADS),
                         ("SCALE", scale)], absent=() if scale else ("s",)))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("index,D", [("int32", 1536), ("uint32", 8960), ("int32", 6)])
def test_rows_kernel_compiles(builder, dtype: str, index: str, D: int) -> None:
    from mlxrunner.nn import cuda_rows

    _compile(builder, "mlxrunner_rows", _wrap(
        "mlxrunner_rows", cuda_rows.ROWS_SOURCE,
        [("table", dtype), ("ids", index), ("count", "int32")], [("out", dtype)],
        [("T", dtype), ("D", D), ("NT", cuda_rows.THREADS)]))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("N,glu", [(6144, 1), (6144, 2), (6, 1)])
def test_gated_kernel_compiles(builder, dtype: str, N: int, glu: int) -> None:
    from mlxrunner.nn import cuda_gated

    _compile(builder, "mlxrunner_gated", _wrap(
        "mlxrunner_gated", cuda_gated.GATED_SOURCE, [("y", dtype)], [("out", dtype)],
        [("T", dtype), ("N", N), ("GLU", glu), ("NT", cuda_gated.THREADS)]))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_fresh_kv_kernel_compiles(builder, dtype: str) -> None:
    from mlxrunner.nn import attention

    _compile(builder, "mlxrunner_fresh_kv", _wrap(
        "mlxrunner_fresh_kv", attention.FRESH_SOURCE,
        [("k", dtype), ("v", dtype), ("dims", "int32")], [("k_out", dtype), ("v_out", dtype)],
        [("T", dtype), ("HK", 1), ("WK", 256), ("HV", 1), ("WV", 256),
         ("NT", attention.FRESH_THREADS)]))


def test_a_one_entry_scale_reaches_the_launch_as_it_is(builder: cuda_build.Builder,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A post-norm add's scale of shape [1] (a Gemma 4 layer's scalar) is handed to the
    launch itself, not reshaped (a graph node at every layer); a scalar one is made [1]."""
    from mlxrunner.nn import cuda_norms

    launched: list[dict[str, Any]] = []
    monkeypatch.setattr(mx.fast, "precompiled_cuda_kernel",
                        lambda **launch: launched.append(launch) or [mx.zeros((2, 64))])
    monkeypatch.setattr(cuda_build, "_builder", builder)
    x, weight = mx.zeros((2, 64), mx.bfloat16), mx.ones((64,), mx.bfloat16)
    for scale in (mx.ones((1,), mx.bfloat16), mx.array(2.0, mx.bfloat16)):
        cuda_norms._launch_add_norm(x, x, weight, 1e-6, scale)
        passed = launched[-1]["inputs"][3]
        assert passed.shape == (1,) and (passed is scale) == (scale.ndim == 1)
