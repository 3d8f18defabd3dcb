"""Constants a trace holds, and small arrays moved out of MLX's managed scalar pool."""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

import mlxrunner
from mlxrunner.constants import constant
from mlxrunner.decode import compiled_steps, forward
from mlxrunner.nn.kernels import off_scalar_pool, on_cuda
from mlxrunner_test_support import on_cuda_and_emulated

# (the tests below set the GPU themselves: a module imported earlier may have set the CPU)
on_gpu, _ = on_cuda_and_emulated()


@pytest.mark.parametrize(("values", "dtype"), [
    ((1e-6,), mx.float32), ((True,), mx.bool_), ((3, 4, 5), mx.int32),
    ((0.5,), mx.bfloat16), (tuple(range(6)), mx.float32)])
def test_constant_holds_its_values_alone(values: tuple, dtype: mx.Dtype) -> None:
    # a padded buffer is a view of the first entries: nothing of the padding shows
    made = constant(values, dtype)
    assert made.shape == (len(values),) and made.dtype == dtype
    assert made.tolist() == mx.array(values, dtype=dtype).tolist()
    assert constant(values, dtype) is made  # made once per (values, dtype)
    assert (made * 2).tolist() == (mx.array(values, dtype=dtype) * 2).tolist()


@pytest.mark.parametrize(("a", "small"), [
    (mx.array(7, mx.int32), True), (mx.array([2.5], mx.bfloat16), True),
    (mx.array([1, 2], mx.int32), True), (mx.array([1, 2, 3], mx.int32), False),
    (mx.zeros((4, 4)), False)])
def test_off_scalar_pool_keeps_values(a: mx.array, small: bool) -> None:
    moved = off_scalar_pool(a)
    assert moved.shape == a.shape and moved.dtype == a.dtype
    assert moved.tolist() == a.tolist()
    # a copy only where MLX's CUDA backend pools the array (at most 8 bytes)
    assert (moved is not a) == (small and on_cuda())


@on_gpu
def test_a_kernel_reads_moved_scalars() -> None:
    mx.set_default_device(mx.gpu)  # (MLX's managed scalar pool is on CUDA only)
    x = mx.arange(8, dtype=mx.float32)
    scale = off_scalar_pool(mx.array([3.0], mx.float32))
    offset = off_scalar_pool(mx.array(5, mx.int32))
    assert (x * scale + offset).tolist() == [3.0 * i + 5 for i in range(8)]


GEMMA4 = Path(__file__).resolve().parents[2] / "architectures" / "gemma4" / "tests" / \
    "fixtures" / "e2b"


@on_gpu
def test_small_parameters_move_once_and_the_step_stays_traced() -> None:
    mx.set_default_device(mx.gpu)  # (MLX's managed scalar pool is on CUDA only)
    # Gemma 4's layer scalars (one element a layer) are moved out of the pool before the
    # model's first traced step; moving them through the model's update must not drop the
    # steps it keeps (a trace made again at every step)
    if not (GEMMA4 / "config.json").exists():
        pytest.skip(f"no tiny Gemma 4 checkpoint at {GEMMA4}")
    model = mlxrunner.load_model(GEMMA4, dtype="bfloat16")
    before = {name: p for name, p in tree_flatten(model.parameters()) if p.nbytes <= 8}
    assert before, "the fixture has no small parameters"
    caches = model.make_cache()
    mx.eval(forward(model, mx.array([[1, 2, 3, 4]]), caches))
    steps = compiled_steps(model)
    for token in range(5, 10):
        mx.eval(forward(model, mx.array([[token]]), caches))
    assert compiled_steps(model) is steps and steps.enabled
    assert steps.replays() >= 3
    after = dict(tree_flatten(model.parameters()))
    for name, p in before.items():
        assert after[name] is not p and after[name].tolist() == p.tolist()
