"""Run an ``mx.fast.cuda_kernel`` source on the CPU, for tests without a GPU.

MLX builds a custom CUDA kernel from a body (the ``source``), the input and output names
and template constants. :func:`emulate_kernel` compiles the same body with the host C++
compiler inside a small model of CUDA's execution: blocks one after another, each with
one OS thread per CUDA thread; ``__syncthreads`` and warp shuffles (``__shfl_xor_sync``)
are barriers; ``__shared__`` arrays are shared by the block's threads. Activations are
float32 (``T`` is ``float``), so this checks a kernel's indexing and arithmetic, not its
half-precision conversions or speed; on the GPU a self-check still guards the kernel.

Needs ``g++`` (C++20); :func:`emulation_available` says whether it is there.
"""

from __future__ import annotations

import ctypes
import hashlib
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

_C_TYPES = {np.dtype(np.float32): ("float", ctypes.c_float),
            np.dtype(np.int32): ("int", ctypes.c_int32),
            np.dtype(np.uint64): ("unsigned long long", ctypes.c_uint64),
            np.dtype(np.bool_): ("bool", ctypes.c_bool)}

_PRELUDE = r"""
#include <algorithm>
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstddef>
#include <cstring>
#include <thread>
#include <vector>

struct Dim { int x = 0; int y = 0; int z = 0; };
static thread_local Dim blockIdx, threadIdx;
static Dim gridDim, blockDim;
static std::barrier<>* block_barrier;
static std::vector<std::barrier<>*> warp_barriers;
static float warp_values[1024];

static void __syncthreads() { block_barrier->arrive_and_wait(); }
static float __shfl_xor_sync(unsigned, float v, int offset) {
    int t = threadIdx.x, warp = t / 32, lane = t % 32;
    warp_values[t] = v;
    warp_barriers[warp]->arrive_and_wait();
    float r = warp_values[warp * 32 + (lane ^ offset)];
    warp_barriers[warp]->arrive_and_wait();
    return r;
}
static float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
// (blocks run one after another here: the last block to count is the grid's last)
static int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST); }
static unsigned int atomicInc(unsigned int* p, unsigned int limit) {  // wraps past limit to 0
    unsigned int old = __atomic_load_n(p, __ATOMIC_SEQ_CST);
    while (!__atomic_compare_exchange_n(p, &old, old >= limit ? 0u : old + 1u, false,
                                        __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {}
    return old;
}
static unsigned int atomicAdd(unsigned int* p, unsigned int v) {
    return __atomic_fetch_add(p, v, __ATOMIC_SEQ_CST);
}
static unsigned int atomicExch(unsigned int* p, unsigned int v) {
    return __atomic_exchange_n(p, v, __ATOMIC_SEQ_CST);
}
static void __nanosleep(unsigned int) { std::this_thread::yield(); }
static void __threadfence() { std::atomic_thread_fence(std::memory_order_seq_cst); }
template <typename T> static T __ldcg(const T* p) { return *p; }
using std::max;  // CUDA's integer min and max
using std::min;
static unsigned int __float_as_uint(float x) {
    unsigned int u;
    std::memcpy(&u, &x, sizeof u);
    return u;
}
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
struct alignas(16) uint4 { unsigned int x, y, z, w; };
struct alignas(16) float4 { float x, y, z, w; };
static float4 make_float4(float x, float y, float z, float w) { return {x, y, z, w}; }
"""

_RUNNER = r"""
extern "C" void run(int blocks_x, int blocks_y, int threads, void** args) {
    gridDim.x = blocks_x;
    gridDim.y = blocks_y;
    blockDim.x = threads;
    for (int b = 0; b < blocks_x * blocks_y; ++b) {
        std::barrier<> block(threads);
        block_barrier = &block;
        std::vector<std::barrier<>*> warps;
        for (int w = 0; w < (threads + 31) / 32; ++w) warps.push_back(new std::barrier<>(32));
        warp_barriers = warps;
        std::vector<std::thread> pool;
        for (int t = 0; t < threads; ++t) {
            pool.emplace_back([=] {
                blockIdx.x = b % blocks_x;
                blockIdx.y = b / blocks_x;
                threadIdx.x = t;
                body(CALL);
            });
        }
        for (auto& th : pool) th.join();
        for (auto* w : warps) delete w;
    }
}
"""

_built: dict[str, ctypes.CDLL] = {}


def emulation_available() -> bool:
    return shutil.which("g++") is not None


def _constant(name: str, value: Any) -> str:
    if isinstance(value, bool):
        return f"constexpr bool {name} = {'true' if value else 'false'};"
    if isinstance(value, int):
        return f"constexpr int {name} = {value};"
    return f"using {name} = float;"  # a dtype: activations are float32 here


def emulate_kernel(source: str, inputs: Mapping[str, np.ndarray | None],
                   outputs: Mapping[str, tuple[tuple[int, ...], Any] | None],
                   template: list[tuple[str, Any]], blocks: int | tuple[int, int],
                   threads: int) -> dict[str, np.ndarray]:
    """Run kernel body ``source`` for ``blocks`` blocks (x, or (x, y)) of ``threads``
    threads.

    ``inputs``: name -> array (float32, int32 or uint64), in the kernel's input order;
    ``outputs``: name -> (shape, numpy dtype), in its output order; ``template``: the
    ``(name, value)`` list given to MLX (ints, bools; dtypes become ``float``). An input or
    output given as None is absent, as :class:`mlxrunner.nn.cuda_build.CudaKernel` leaves
    one out (a null pointer: a kernel that touches it crashes). Outputs start as NaN
    (float) or 0 (integers) so that unwritten elements show. Returns the outputs given, by
    name.
    """
    if threads % 32 or threads > 1024:
        raise ValueError("threads must be a multiple of 32, at most 1024")
    arrays = {n: None if a is None else np.ascontiguousarray(a) for n, a in inputs.items()}
    results = {n: np.full(o[0], np.nan if np.dtype(o[1]).kind == "f" else 0, dtype=o[1])
               for n, o in outputs.items() if o is not None}
    params = [f"const {'float' if a is None else _C_TYPES[a.dtype][0]}* {n}"
              for n, a in arrays.items()]
    params += [f"{'float' if o is None else _C_TYPES[np.dtype(o[1])][0]}* {n}"
               for n, o in outputs.items()]
    names = list(arrays) + list(outputs)
    call = ", ".join(f"static_cast<{p.rsplit(' ', 1)[0]}>(args[{i}])"
                     for i, p in enumerate(params))
    constants = "\n    ".join(_constant(k, v) for k, v in template)
    program = (_PRELUDE + f"\nstatic void body({', '.join(params)}) {{\n    {constants}\n"
               + source + "\n}\n" + _RUNNER.replace("CALL", call))
    digest = hashlib.sha256(program.encode()).hexdigest()[:16]
    lib = _built.get(digest)
    if lib is None:
        # the loaded library stays mapped once its folder is gone (no files left behind)
        with tempfile.TemporaryDirectory(prefix="mlxrunner-cuda-emulation-") as name:
            folder = Path(name)
            (folder / "kernel.cpp").write_text(program)
            result = subprocess.run(["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread",
                                     str(folder / "kernel.cpp"), "-o", str(folder / "kernel.so")],
                                    capture_output=True, text=True)
            if result.returncode != 0:
                raise AssertionError(f"the kernel source does not compile as C++:\n"
                                     f"{result.stderr[-3000:]}")
            lib = _built[digest] = ctypes.CDLL(str(folder / "kernel.so"))
    given = {**{n: a for n, a in arrays.items() if a is not None}, **results}
    pointers = (ctypes.c_void_p * len(names))(
        *[given[n].ctypes.data if n in given else None for n in names])
    bx, by = (blocks, 1) if isinstance(blocks, int) else blocks
    lib.run(bx, by, threads, pointers)
    return results
