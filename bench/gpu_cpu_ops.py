"""float32 operations on the default device (the GPU) against the CPU, at Gemma 4 E2B's
shapes: which of MLX's operations round differently there (``gpu_cpu_parity.py`` finds a
model's logits drift; this says which operation does it). Each row: the largest absolute
difference over the largest absolute value of the CPU's result.

    python bench/gpu_cpu_ops.py
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

os.environ.setdefault("MLX_ENABLE_TF32", "0")  # as mlxrunner runs: float32 products in float32

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402


def main() -> int:
    key = iter(mx.random.split(mx.random.key(0), 64))

    def rand(*shape: int, scale: float = 1.0) -> mx.array:
        return mx.random.normal(shape, key=next(key)) * scale

    T, H, I, V = 64, 1536, 6144, 262144
    x, w_up, w_down = rand(T, H), rand(I, H, scale=0.02), rand(H, I, scale=0.02)
    w_wide = rand(H, 2 * I, scale=0.02)
    head, h_last = rand(V, H, scale=0.02), rand(1, H)
    act, logits = rand(T, I, scale=3.0), rand(T, 4096, scale=40.0)
    q256, k256 = rand(1, 8, T, 256), rand(1, 1, T, 256)
    q512, k512 = rand(1, 8, T, 512), rand(1, 1, T, 512)
    norm_w = rand(H, scale=0.1) + 1.0
    freqs = mx.power(1e6, mx.arange(0, 128, 2) / 512.0)
    cases: dict[str, Callable[[], mx.array]] = {
        "matmul 64x1536 @ 1536x6144": lambda: x @ w_up.T,
        "matmul 64x6144 @ 6144x1536": lambda: act @ w_down.T,
        "matmul 64x12288 @ 12288x1536": lambda: mx.concatenate([act, act], -1) @ w_wide.T,
        "matmul 1x1536 @ 1536x262144 (head)": lambda: h_last @ head.T,
        "gelu (tanh approximation)": lambda: nn.gelu_approx(act),
        "softcap 30 tanh(x / 30)": lambda: 30.0 * mx.tanh(logits / 30.0),
        "rms_norm": lambda: mx.fast.rms_norm(x, norm_w, 1e-6),
        "rope head 512 (128 rotated), freqs": lambda: mx.fast.rope(
            q512, 128, traditional=False, base=None, scale=1.0, offset=7, freqs=freqs),
        "rope head 256, base 1e4": lambda: mx.fast.rope(q256, 256, traditional=False,
                                                        base=1e4, scale=1.0, offset=7),
        "attention head 256, causal, scale 1": lambda: mx.fast.scaled_dot_product_attention(
            q256, k256, k256, scale=1.0, mask="causal"),
        "attention head 512, causal, scale 1": lambda: mx.fast.scaled_dot_product_attention(
            q512, k512, k512, scale=1.0, mask="causal"),
        "softmax (precise)": lambda: mx.softmax(logits, axis=-1, precise=True),
        "exp": lambda: mx.exp(act),
        "sigmoid": lambda: mx.sigmoid(act),
        "tanh": lambda: mx.tanh(act),
    }
    print(f"float32 GPU vs CPU per operation: device {mx.default_device()}, mlx "
          f"{mx.__version__}", flush=True)
    for name, fn in cases.items():
        gpu = fn()
        mx.eval(gpu)
        with mx.stream(mx.cpu):
            cpu = fn()
            mx.eval(cpu)
        diff = float(mx.abs(gpu - cpu).max())
        scale = float(mx.abs(cpu).max())
        print(f"  {name:40s} max |diff| {diff:9.3g}   relative {diff / scale:9.3g}",
              flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
