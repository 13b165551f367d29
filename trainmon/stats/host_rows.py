"""This step's CPU partials rows, in one float64 buffer reused from step to step.

A CPU capture writes its row straight into the buffer and keeps only the row's index: no tensor
per row, no stacking at the end of the step, and ``finish_step`` takes every row as one numpy
copy (no Python object per row on the training thread: the rows become numbers on the writer
thread).  Hooks run this once per module input/output, so per-capture cost is what matters.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import numpy as np
import torch

__all__ = ["HostRows"]


class HostRows:
    def __init__(self, width: int, capacity: int = 1024):
        self.width = width
        self.count = 0
        # Held while rows are reserved and filled: a hook on another thread (autograd runs GPU
        # work on device threads) must not write into a buffer that is being grown.
        self.lock = threading.Lock()
        self.tensor = torch.empty((capacity, width), dtype=torch.float64)
        self.array = self.tensor.numpy()  # same memory: eager rows are written through numpy

    def reserve(self, k: int) -> int:
        """Index of the first of ``k`` new rows (the buffer may move: read ``tensor`` after)."""
        start = self.count
        if start + k > self.tensor.shape[0]:
            self._grow(start + k)
        self.count = start + k
        return start

    def rows(self, ids: Iterable[int]) -> torch.Tensor:
        """A copy of the rows ``ids`` (for merging shards over a process group)."""
        return self.tensor[torch.as_tensor(list(ids), dtype=torch.long)]

    def take(self) -> np.ndarray:
        """A copy of every row written since the last ``take``/``clear`` (float64 ``[rows,
        width]``); the buffer is then reused."""
        with self.lock:
            values = self.array[: self.count].copy()
            self.count = 0
        return values

    def clear(self) -> None:
        self.count = 0

    def _grow(self, need: int) -> None:
        bigger = torch.empty((max(need, 2 * self.tensor.shape[0]), self.width), dtype=torch.float64)
        bigger[: self.count] = self.tensor[: self.count]
        self.tensor, self.array = bigger, bigger.numpy()
