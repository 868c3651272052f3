"""Capture sizes and the O(1) table from a real batch size to its padded (captured) size."""
from __future__ import annotations

from typing import List, Sequence

DEFAULT_MAX_CAPTURE_SIZE = 256


def default_capture_sizes(max_size: int) -> List[int]:
    """1, 2, 4, then every multiple of 8 up to 256, then every multiple of 16; max_size is always included.

    Dense where batches are common and padding waste matters most; 35 sizes for max_size=256.
    """
    sizes = [s for s in (1, 2, 4) if s <= max_size]
    sizes += [s for s in range(8, min(max_size, 256) + 1, 8)]
    sizes += [s for s in range(256 + 16, max_size + 1, 16)]
    if not sizes or sizes[-1] != max_size:
        sizes.append(max_size)
    return sizes


class PaddingTable:
    """padded_size(real) is a list lookup: the smallest captured size >= real, or 0 when real > max."""

    __slots__ = ("sizes", "max_size", "_table")

    def __init__(self, sizes: Sequence[int]):
        self.sizes = sorted(sizes)
        self.max_size = self.sizes[-1]
        table = [0] * (self.max_size + 1)
        it = iter(self.sizes)
        current = next(it)
        for real in range(1, self.max_size + 1):
            while current < real:
                current = next(it)
            table[real] = current
        self._table = table

    def padded_size(self, real: int) -> int:
        """0 means: not paddable (zero rows, or above the max capture size)."""
        if real > self.max_size or real < 0:
            return 0
        return self._table[real]
