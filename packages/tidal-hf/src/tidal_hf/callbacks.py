"""``StepTimeCallback``: wall time of each optimizer step (device-synchronized) and the device peak."""

from __future__ import annotations

import statistics
import time
from typing import Any

import torch
from transformers import TrainerCallback

__all__ = ["StepTimeCallback"]


class StepTimeCallback(TrainerCallback):
    """Record each training step's wall time, synchronizing the device at both ends.

    Attributes:
        times: seconds per optimizer step, in order.
        peak_bytes: the device's peak allocated bytes over the run (0 on the CPU).
    """

    def __init__(self) -> None:
        self.times: list[float] = []
        self.peak_bytes = 0
        self._t0: float | None = None

    @staticmethod
    def _sync() -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()  # why: the step's queued GPU work belongs to the step's time

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._sync()
        self._t0 = time.perf_counter()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._sync()
        if self._t0 is not None:
            self.times.append(time.perf_counter() - self._t0)
        if torch.cuda.is_available():
            self.peak_bytes = max(self.peak_bytes, torch.cuda.max_memory_allocated())

    def median(self, warmup: int = 2) -> float:
        """Median step time after the first ``warmup`` steps (NaN when none are left)."""
        rest = self.times[warmup:]
        return statistics.median(rest) if rest else float("nan")
