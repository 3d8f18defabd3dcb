"""The batch's step shapes stay few however its load varies (docs/batching.md, "Shapes a
server traces"): buffers grow through a short list of sizes and a round's verify forward is
a power of two wide."""

from __future__ import annotations

import pytest

from mlxrunner.batch import verify_width
from mlxrunner.cache import bucket_capacity


@pytest.mark.parametrize("step", [256, 1024])
def test_buffer_sizes_are_few_and_hold_what_they_must(step: int) -> None:
    sizes: set[int] = set()
    previous = 0
    for length in range(1, 64 * step + 1, 37):
        size = bucket_capacity(length, step)
        assert size >= length and size % step == 0 and size >= previous
        assert bucket_capacity(size, step) == size  # a size is its own bucket: kept as it is
        if length > 4 * step:
            assert size - length < size / 3
        sizes.add(size)
        previous = size
    assert sorted(s // step for s in sizes) == [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64]


def test_verify_widths_are_powers_of_two_within_a_window() -> None:
    assert [verify_width(n) for n in range(1, 18)] == [1, 2, 4, 4] + [8] * 4 + [16] * 8 + [32]
    assert [verify_width(n, longest=6) for n in range(1, 7)] == [1, 2, 4, 4, 6, 6]
