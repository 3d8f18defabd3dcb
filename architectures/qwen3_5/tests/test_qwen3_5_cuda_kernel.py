"""The fused CUDA DeltaNet step, checked without a GPU.

- Dispatch: off the CUDA backend (here) the pure-MLX step runs; on CUDA a kernel that
  fails or disagrees in its self-check is disabled and the pure-MLX step runs instead
  (exercised with stand-in launchers).
- Logic: the kernel source is compiled by the host C++ compiler inside a tiny emulation of
  CUDA's thread model (a thread per CUDA thread, barriers for __syncthreads and warp
  shuffles) and compared with the pure-MLX step, float32. This checks the indexing and
  the arithmetic; CUDA-only details (bf16 conversions, nvrtc) are left to the GPU run,
  where the self-check guards them.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from pathlib import Path

import mlx.core as mx
import mlxrunner_qwen3_5.cuda_kernels as ck
import mlxrunner_qwen3_5.model as qm
import numpy as np
import pytest

mx.set_default_device(mx.cpu)

DIMS = dict(hk=2, hv=4, dk=32, dv=32)  # Hk != Hv; the kernel needs Dk % 32 == 0
EPS = 1e-6
KERNEL = 4


def step_inputs(B: int = 2, seed: int = 0) -> tuple[mx.array, ...]:
    hk, hv, dk, dv = DIMS["hk"], DIMS["hv"], DIMS["dk"], DIMS["dv"]
    C = 2 * hk * dk + hv * dv
    keys = mx.random.split(mx.random.key(seed), 10)
    shapes = [(B, 1, C), (B, 1, hv * dv), (B, 1, hv), (B, 1, hv), (B, KERNEL - 1, C),
              (B, hv, dv, dk), (C, KERNEL, 1), (hv,), (hv,), (dv,)]
    arrays = [mx.random.normal(s, key=k) for s, k in zip(shapes, keys)]
    arrays[5] = 0.3 * arrays[5]  # state
    arrays[7] = mx.log(mx.random.uniform(0.05, 2.0, (hv,), key=keys[7]))  # A_log
    arrays[9] = 1.0 + 0.2 * arrays[9]  # gated norm weight
    return tuple(arrays)


def pure_mlx(args: tuple[mx.array, ...]) -> tuple[mx.array, ...]:
    return qm._decode_step(DIMS["hk"], DIMS["hv"], DIMS["dk"], DIMS["dv"], EPS)(*args)


def test_cpu_uses_the_pure_mlx_step():
    assert not ck.cuda_backend()
    assert not ck.applies(**DIMS)
    args = step_inputs()

    def launch(*a, **k):
        raise AssertionError("the CUDA kernel must not run on the CPU")

    got = ck.deltanet_step(args, lambda *a: pure_mlx(a), *DIMS.values(), EPS, launch=launch)
    for x, y in zip(got, pure_mlx(args)):
        assert mx.array_equal(x, y)


@pytest.mark.parametrize("behaviour", ["raises", "wrong", "right"])
def test_self_check_gates_the_kernel(behaviour, monkeypatch):
    monkeypatch.setattr(ck, "applies", lambda *a: True)
    monkeypatch.setattr(ck, "_verdicts", {})
    calls = []

    def launch(args, *dims):
        calls.append(len(calls))
        if behaviour == "raises":
            raise RuntimeError("nvrtc: error")
        out = pure_mlx(args)
        if behaviour == "wrong":
            return (out[0], out[1], out[2] + 1.0)
        return out

    args = step_inputs()
    for _ in range(2):  # the verdict is kept: one self-check per shape and dtype
        got = ck.deltanet_step(args, lambda *a: pure_mlx(a), *DIMS.values(), EPS, launch=launch)
        for x, y in zip(got, pure_mlx(args)):
            assert mx.array_equal(x, y)
    assert len(ck._verdicts) == 1
    assert list(ck._verdicts.values()) == [behaviour == "right"]
    # self-check once, then the kernel on every call only when it passed
    assert len(calls) == (3 if behaviour == "right" else 1)


def test_switch_turns_the_kernel_off(monkeypatch):
    monkeypatch.setattr(ck, "cuda_backend", lambda: True)
    assert ck.applies(**DIMS)
    assert not ck.applies(1, 2, 8, 32)  # Dk not a multiple of 32
    monkeypatch.setenv(ck.ENV_SWITCH, "0")
    assert not ck.applies(**DIMS)


HARNESS = r"""
#include <barrier>
#include <cmath>
#include <cstddef>
#include <thread>
#include <vector>

struct Dim { int x = 0; };
static thread_local Dim blockIdx, threadIdx;
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
#define __shared__ static

static void body(const float* proj, const float* conv_tail, const float* state,
                 const float* conv_weight, const float* A_log, const float* dt_bias,
                 const float* norm_weight,
                 float* out, float* new_tail, float* new_state) {
    using T = float;
    CONSTANTS
SOURCE
}

extern "C" void run(int blocks, int threads, const float** in, float** outs) {
    for (int bh = 0; bh < blocks; ++bh) {
        std::barrier<> block(threads);
        block_barrier = &block;
        std::vector<std::barrier<>*> warps;
        for (int w = 0; w < threads / 32; ++w) warps.push_back(new std::barrier<>(32));
        warp_barriers = warps;
        std::vector<std::thread> pool;
        for (int t = 0; t < threads; ++t) {
            pool.emplace_back([=] {
                blockIdx.x = bh;
                threadIdx.x = t;
                body(in[0], in[1], in[2], in[3], in[4], in[5], in[6],
                     outs[0], outs[1], outs[2]);
            });
        }
        for (auto& th : pool) th.join();
        for (auto* w : warps) delete w;
    }
}
"""


@pytest.mark.skipif(shutil.which("g++") is None, reason="needs a host C++ compiler")
def test_kernel_source_matches_the_pure_mlx_step(tmp_path: Path):
    B, threads = 2, 64
    hk, hv, dk, dv = DIMS["hk"], DIMS["hv"], DIMS["dk"], DIMS["dv"]
    C = 2 * hk * dk + hv * dv
    constants = " ".join(f"constexpr int {k} = {v};" for k, v in dict(
        Hk=hk, Hv=hv, Dk=dk, Dv=dv, K=KERNEL, C=C, NT=threads, EPS_E9=round(EPS * 1e9),
        P=C + hv * dv + 2 * hv, OZ=C, OB=C + hv * dv, OA=C + hv * dv + hv).items())
    source = tmp_path / "step.cpp"
    source.write_text(HARNESS.replace("CONSTANTS", constants)
                      .replace("SOURCE", ck.DELTANET_STEP_SOURCE))
    library = tmp_path / "step.so"
    result = subprocess.run(["g++", "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread",
                             str(source), "-o", str(library)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr[-3000:]
    lib = ctypes.CDLL(str(library))

    args = step_inputs(B)
    # the kernel reads qkv, z, b, a in place from the joined in-projection row
    joined = mx.concatenate(args[:4], axis=-1)
    inputs = [np.ascontiguousarray(np.array(x, dtype=np.float32)) for x in (joined, *args[4:])]
    want = [np.array(x) for x in pure_mlx(args)]
    outputs = [np.zeros(w.shape, np.float32) for w in want]
    as_ptr = ctypes.POINTER(ctypes.c_float)
    in_ptrs = (as_ptr * 7)(*[x.ctypes.data_as(as_ptr) for x in inputs])
    out_ptrs = (as_ptr * 3)(*[x.ctypes.data_as(as_ptr) for x in outputs])
    lib.run(B * hv, threads, in_ptrs, out_ptrs)
    for name, got, expected in zip(("out", "conv tail", "state"), outputs, want):
        assert np.abs(got - expected).max() < 2e-5, name
