"""The device's own time for a model's prompt and decode steps, with the host out of the way.

A bench's rates are the larger of the host's work (Python building a graph, MLX submitting
its kernels) and the device's; a row whose host is faster than its device shows a wait
but not how long the device takes. Here one kernel holds the device first (spinning on the
GPU's clock, ``%globaltimer``) while the host builds and submits the measured work behind
it; that kernel notes the clock as it lets go, and a second notes it after the work's last
output: the difference is the device's time alone. A figure counts only when the host had
submitted everything before the hold ended (else it is None): the device never waited.
MLX lets at most 10 submissions (each a CUDA graph of up to ``MLX_MAX_OPS_PER_BUFFER``
kernels) wait on the device before the host waits too, so the work measured is one decode
step (a Gemma 4 E2B step is 4 graphs for us, 7 for mlx-lm) and a prompt only where its
graphs stay under that (run o: our eager Gemma prompt did, the others did not).

CUDA only (MLX's CPU device runs a graph on the host).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

# One thread: pass ids on (the measured work reads the copy, so it runs after this kernel;
# copied first, so the copy is inside the hold), hold the device hold[0] nanoseconds, note
# the clock.
_MARK_SOURCE = r"""
    for (int i = 0; i < N; ++i) out[i] = ids[i];
    unsigned long long start, now;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(start));
    now = start;
    while (now - start < hold[0]) {
        __nanosleep(20000);
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(now));
    }
    clock[0] = now;
"""
_mark_kernel: Any = None
# The clock once every input exists (reading none of them).
_STAMP_SOURCE = "asm volatile(\"mov.u64 %0, %%globaltimer;\" : \"=l\"(clock[0]));"
_stamp_kernels: dict[int, Any] = {}


def available() -> bool:
    cuda = getattr(mx, "cuda", None)
    return bool(cuda is not None and cuda.is_available() and mx.default_device() == mx.gpu)


def _mark(ids: mx.array, hold_ns: int) -> tuple[mx.array, mx.array]:
    """The device's clock after holding it ``hold_ns`` (once ``ids`` exist), and a copy of
    ``ids`` for the measured work to read (so that it runs after the hold)."""
    global _mark_kernel
    if _mark_kernel is None:
        _mark_kernel = mx.fast.cuda_kernel(name="bench_clock_mark", input_names=["ids", "hold"],
                                           output_names=["clock", "out"], source=_MARK_SOURCE)
    clock, out = _mark_kernel(inputs=[ids, mx.array([hold_ns], mx.uint64)],
                              output_shapes=[(1,), ids.shape],
                              output_dtypes=[mx.uint64, ids.dtype], grid=(1, 1, 1),
                              threadgroup=(1, 1, 1),
                              template=[("T", ids.dtype), ("N", ids.size)])
    return clock, out


def _stamp(after: list[mx.array]) -> mx.array:
    """The device's clock once every array of ``after`` is written."""
    kernel = _stamp_kernels.get(len(after))
    if kernel is None:
        kernel = _stamp_kernels[len(after)] = mx.fast.cuda_kernel(
            name=f"bench_clock_stamp_{len(after)}",
            input_names=[f"a{i}" for i in range(len(after))], output_names=["clock"],
            source=_STAMP_SOURCE, ensure_row_contiguous=False)
    return kernel(inputs=after, output_shapes=[(1,)], output_dtypes=[mx.uint64],
                  grid=(1, 1, 1), threadgroup=(1, 1, 1))[0]


def device_ms(work: Callable[[mx.array], list[mx.array]], ids: mx.array, hold_s: float
              ) -> float | None:
    """Milliseconds the device takes for ``work(ids)`` up to the arrays it returns (it may
    submit parts of itself with ``mx.async_eval``, as a decode loop does), queued behind a
    hold of ``hold_s``; None when the host took longer than the hold to submit it."""
    mx.synchronize()
    start = time.perf_counter()
    before, ids = _mark(ids, int(hold_s * 1e9))
    mx.async_eval(before, ids)
    after = _stamp(work(ids))
    mx.async_eval(after)
    submitted = time.perf_counter() - start
    mx.eval(before, after)
    if submitted >= hold_s:
        return None
    return (after.item() - before.item()) / 1e6


def call_us(fns: list[Callable[[mx.array], Any]], x: mx.array, calls: int = 15,
            hold_s: float = 0.02) -> float | None:
    """Median microseconds the device takes for one call ``fn(x)`` alone (its kernels and
    their launches on the device, as in a chain of dependent calls), cycling through
    ``fns`` (copies of one case whose weights together pass the device's cache); None where
    the host fell behind."""
    device_ms(lambda v: _leaves(fns[0](v)), x, hold_s)  # (the clock's kernels built: untimed)
    times = []
    for n in range(calls):
        fn = fns[n % len(fns)]
        ms = device_ms(lambda v, fn=fn: _leaves(fn(v)), x, hold_s)
        if ms is None:
            return None
        times.append(1e3 * ms)
    return statistics.median(times)


def _leaves(tree: Any) -> list[mx.array]:
    return [a for _, a in tree_flatten(tree) if isinstance(a, mx.array)] \
        if not isinstance(tree, mx.array) else [tree]


def fill(model: Any, ids: mx.array, cache: list[Any]) -> None:
    """``model(ids, cache=cache)`` for a prompt chunk whose logits no one reads (a bench's
    prefill, caches evaluated): a row with ``fill_caches`` (ours, ``harness.Ours``) fills
    them as its prefill fills a chunk before a prompt's last."""
    own = getattr(model, "fill_caches", None)
    if own is not None:
        own(ids, cache)
    else:
        model(ids, cache=cache)


def decode_and_prompt_ms(model: Any, prompt: mx.array, steps: int = 1, repeats: int = 5,
                         hold_s: float = 0.5, chunk: int | None = None
                         ) -> dict[str, float | None]:
    """Medians over ``repeats`` of the device's milliseconds for ``model``'s prefill of
    ``prompt`` (a fresh cache; with ``chunk``, prefilled that many tokens at a time as the
    bench does, and not measured: None) and for one of ``steps`` greedy decode steps after
    it."""
    prefill: list[float | None] = []
    decode: list[float | None] = []
    for repeat in range(repeats + 1):  # (the first builds the clock's kernels: untimed)
        cache = model.make_cache()

        def prompt_into_cache(ids: mx.array, cache: list[Any] = cache) -> list[mx.array]:
            fill(model, ids[None], cache)  # (the caches, as a bench's prefill evaluates them)
            # (only arrays: mlx-lm's recurrent caches hold None before they are written)
            return [a for c in cache if c is not None for _, a in tree_flatten(c.state)
                    if isinstance(a, mx.array)]

        def steps_from(y: mx.array, cache: list[Any] = cache) -> list[mx.array]:
            for _ in range(steps):
                y = mx.argmax(model(y, cache=cache)[:, -1, :], axis=-1, keepdims=True)
                mx.async_eval(y)  # (submitted as the decode loop submits it)
            return [y]

        prompt_ms = None
        if chunk is None:
            prompt_ms = device_ms(prompt_into_cache, prompt[:-1], hold_s)
        else:
            for at in range(0, prompt.size - 1, chunk):
                mx.eval(prompt_into_cache(prompt[at:min(at + chunk, prompt.size - 1)]))
        step_ms = device_ms(steps_from, prompt[None, -1:], hold_s)
        if repeat:
            prefill.append(prompt_ms)
            decode.append(step_ms)
    return {"prefill_device_ms": _median(prefill),
            "decode_device_ms": None if (d := _median(decode)) is None else d / steps}


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if len(known) == len(values) else None
