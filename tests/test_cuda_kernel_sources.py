"""Our CUDA kernel sources compile, off the GPU.

MLX builds a ``mx.fast.cuda_kernel`` at its first launch, on the GPU machine; a source that
does not compile there only shows as a kernel turned off (one warning, the slower path).
These tests wrap each source the way MLX does (inputs as ``const T*``, outputs as ``T*``,
template arguments as ``constexpr``/``using`` lines) and compile it with NVRTC for the H200
(``compute_90``), which needs no GPU. They run where NVRTC and the CUDA headers are
installed (requirements-test.txt installs them on x86-64 Linux, about 90 MB) and skip
elsewhere.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

import pytest

CUDA_TYPES = {"float32": "float", "bfloat16": "__nv_bfloat16", "float16": "__half", "int32": "int",
              "uint64": "unsigned long long", "bool": "bool"}


def _nvidia_dir(package: str) -> Path | None:
    try:
        module = __import__(f"nvidia.{package}", fromlist=["_"])
    except ImportError:
        return None
    return Path(next(iter(module.__path__)))


@pytest.fixture(scope="module")
def nvrtc() -> tuple[Any, Path]:
    lib_dir, runtime = _nvidia_dir("cuda_nvrtc"), _nvidia_dir("cuda_runtime")
    if lib_dir is None or runtime is None:
        pytest.skip("NVRTC and the CUDA headers are not installed "
                    "(pip install nvidia-cuda-nvrtc-cu12 nvidia-cuda-runtime-cu12)")
    libs = sorted((lib_dir / "lib").glob("libnvrtc.so*"))
    if not libs:
        pytest.skip(f"no libnvrtc in {lib_dir}")
    return ctypes.CDLL(str(libs[0])), runtime / "include"


def _wrap(name: str, source: str, inputs: list[tuple[str, str]],
          outputs: list[tuple[str, str]], template: list[tuple[str, Any]]) -> str:
    """The kernel as MLX's custom_kernel builds it (its header swapped for CUDA's own)."""
    lines = ["#include <cuda_bf16.h>", "#include <cuda_fp16.h>",
             "namespace mlx { namespace core { namespace cu {",
             f"__global__ void {name}("]
    args = [f"    const {CUDA_TYPES[t]}* {n}" for n, t in inputs]
    args += [f"    {CUDA_TYPES[t]}* {n}" for n, t in outputs]
    lines.append(",\n".join(args) + ") {")
    for key, value in template:
        if isinstance(value, bool):
            lines.append(f"  constexpr bool {key} = {'true' if value else 'false'};")
        elif isinstance(value, int):
            lines.append(f"  constexpr int {key} = {value};")
        else:
            lines.append(f"  using {key} = {CUDA_TYPES[value]};")
    lines += [source, "}", "}}}"]
    return "\n".join(lines)


def _compile(nvrtc: tuple[Any, Path], name: str, source: str) -> None:
    lib, include = nvrtc
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(),
                                  0, None, None) == 0
    options = [b"--gpu-architecture=compute_90", f"--include-path={include}".encode(),
               b"-std=c++17"]
    status = lib.nvrtcCompileProgram(prog, len(options),
                                     (ctypes.c_char_p * len(options))(*options))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    lib.nvrtcDestroyProgram(ctypes.byref(prog))
    assert status == 0, f"{name} does not compile:\n{log.value.decode()}"


@pytest.mark.parametrize("rows,n,k", [(1, 151936, 64), (64, 151936, 64), (64, 262144, 20)])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_topk_chunk_kernel_compiles(nvrtc, rows: int, n: int, k: int, dtype: str) -> None:
    from mlxrunner.decode import topk

    launch = topk.kernel_launch(rows, n, k)
    _compile(nvrtc, "topk", _wrap("topk", topk._CUDA_CHUNK_TOPK, [("x", dtype)],
                                  [("out", "uint64")], launch["template"]))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_deltanet_kernels_compile(nvrtc, dtype: str) -> None:
    from mlxrunner.nn import cuda_deltanet as ck

    inputs = [("proj", dtype), ("conv_tail", dtype), ("state", "float32"),
              ("conv_weight", dtype), ("A_log", dtype), ("dt_bias", dtype),
              ("norm_weight", dtype)]
    shape = [("T", dtype), ("Hk", 16), ("Hv", 16), ("Dk", 128), ("Dv", 128), ("K", 4),
             ("C", 6144), ("P", 8224), ("OZ", 6144), ("OB", 8192), ("OA", 8208)]
    step = [("out", dtype), ("new_tail", dtype), ("new_state", "float32")]
    _compile(nvrtc, "step", _wrap("step", ck.DELTANET_STEP_SOURCE, inputs, step,
                                  shape + [("NT", 512), ("EPS_E9", 1000)]))
    block = step + [("k_out", "float32"), ("delta_out", "float32"), ("g_out", "float32")]
    _compile(nvrtc, "block", _wrap("block", ck.DELTANET_BLOCK_SOURCE, inputs, block,
                                   shape + [("L", 8), ("NT", 512), ("EPS_E9", 1000)]))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("D,mask", [(256, 0), (512, 1), (128, 2)])
def test_attention_kernel_compiles(nvrtc, dtype: str, D: int, mask: int) -> None:
    from mlxrunner.nn import attention as nn

    inputs = [("q", dtype), ("keys", dtype), ("values", dtype), ("scale", "float32"),
              ("mask", "bool"), ("dims", "int32")]
    template = [("T", dtype), ("HQ", 8), ("HK", 2), ("D", D), ("DV", min(D, 512)),
                ("NT", nn.ATTEND_THREADS), ("U", nn.keys_at_once(D, min(D, 512))),
                ("MASK", mask)]
    _compile(nvrtc, "attend_split", _wrap("attend_split", nn.ATTEND_SPLIT_SOURCE, inputs,
                                          [("part_o", "float32"), ("part_max", "float32"),
                                           ("part_sum", "float32")], template))
    _compile(nvrtc, "attend", _wrap("attend", nn.ATTEND_SOURCE, inputs,
                                    [("out", dtype)],
                                    [("T", dtype), ("HQ", 8), ("HK", 2), ("D", D),
                                     ("DV", min(D, 512)), ("NT", nn.ATTEND_THREADS),
                                     ("U", nn.keys_at_once(D, min(D, 512))),
                                     ("MASK", mask)]))
