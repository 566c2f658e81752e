"""Shared fixtures of the micro-benchmark suites (benchmarks/arena, quant, stream, kv) and the harness tests.

- ``synced_benchmark``: pytest-benchmark's ``benchmark`` with a device synchronization after every call,
  so a round measures the GPU work it queued, not just the launch. Use it exactly like ``benchmark``::

      def test_nf4_quantize(synced_benchmark):
          w = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
          synced_benchmark(quantize, w, "nf4")

- ``step_timer``: a context manager that synchronizes before and after and records wall seconds, for
  timings outside pytest-benchmark.

``benchmarks/`` is put on ``sys.path`` so the harness tests import ``compare``, ``report``, ``quality``
and ``engines`` as the scripts do.
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))


def _device_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The first CUDA device among the call's tensor arguments (None: nothing to synchronize)."""
    import torch

    for a in (*args, *kwargs.values()):
        if isinstance(a, torch.Tensor) and a.is_cuda:
            return a.device
    return torch.device("cuda") if torch.cuda.is_available() else None


def synchronize(device: Any) -> None:
    """Wait for ``device`` (no-op for None / CPU)."""
    import torch

    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@pytest.fixture
def synced_benchmark(request: pytest.FixtureRequest) -> Callable[..., Any]:
    """``benchmark(fn, *args, **kwargs)`` with a CUDA synchronization after every call of ``fn``.

    Pass ``device=`` to name the device to wait for; otherwise the first CUDA tensor argument's device
    (or the current CUDA device when there is one) is used. Returns what ``fn`` returned.
    """
    benchmark = request.getfixturevalue("benchmark")

    def run(fn: Callable[..., Any], *args: Any, device: Any = None, **kwargs: Any) -> Any:
        dev = device if device is not None else _device_of(args, kwargs)

        def call() -> Any:
            out = fn(*args, **kwargs)
            synchronize(dev)  # the round ends when the device has finished the work it was given
            return out

        synchronize(dev)  # nothing queued before the first round is billed to it
        benchmark.extra_info["device"] = str(dev) if dev is not None else "cpu"
        return benchmark(call)

    return run


class StepTimer:
    """Seconds of the last ``with`` block, measured between device synchronizations."""

    def __init__(self, device: Any = None) -> None:
        self.device = device
        self.seconds: list[float] = []

    @contextlib.contextmanager
    def __call__(self) -> Iterator[StepTimer]:
        synchronize(self.device)
        t0 = time.perf_counter()
        yield self
        synchronize(self.device)
        self.seconds.append(time.perf_counter() - t0)


@pytest.fixture
def step_timer() -> StepTimer:
    """A :class:`StepTimer` on the current CUDA device (CPU when there is none)."""
    import torch

    return StepTimer(torch.device("cuda") if torch.cuda.is_available() else None)
