"""Shared fixtures: pageable arenas, a CPU stand-in for a CUDA event, random bytes, kernel counters,
copy bandwidth."""

from __future__ import annotations

import threading

import pytest
import torch

from tidal_arena import ArenaConfig, PinnedArena


class ManualEvent:
    """A CPU stand-in for ``torch.cuda.Event``: ``query()`` turns True once :meth:`set` is called."""

    def __init__(self) -> None:
        self._done = threading.Event()

    def set(self) -> None:
        self._done.set()

    def query(self) -> bool:
        return self._done.is_set()


def random_bytes(n: int, seed: int) -> torch.Tensor:
    """``n`` random bytes (never zeros-only data)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def kernel_memory_counters() -> dict[str, int]:
    """VmLck / VmPin / VmRSS of this process and system-wide used memory, in bytes."""
    out: dict[str, int] = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmLck", "VmPin", "VmRSS"):
                out[key] = int(rest.split()[0]) * 1024
    meminfo: dict[str, int] = {}
    with open("/proc/meminfo") as f:
        for line in f:
            key, _, rest = line.partition(":")
            meminfo[key] = int(rest.split()[0]) * 1024
    out["meminfo_used"] = meminfo["MemTotal"] - meminfo.get("MemAvailable", meminfo["MemFree"])
    return out


def copy_bandwidth_gbps(src: torch.Tensor, dst: torch.Tensor, reps: int = 8) -> float:
    """GB/s of ``dst.copy_(src, non_blocking=True)``, timed with CUDA events after a warm-up."""
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()  # why: the warm-up copy must finish before timing starts
    start, end = (
        torch.cuda.Event(enable_timing=True),
        torch.cuda.Event(enable_timing=True),
    )  # why: device-side timing of the copies
    start.record()
    for _ in range(reps):
        dst.copy_(src, non_blocking=True)
    end.record()
    end.synchronize()  # why: elapsed_time needs both events complete
    return src.numel() * src.element_size() * reps / (start.elapsed_time(end) / 1e3) / 1e9


@pytest.fixture
def make_arena():
    """Factory for pageable arenas that are closed after the test."""
    made: list[PinnedArena] = []

    def make(**kwargs) -> PinnedArena:
        kwargs.setdefault("backend", "pageable")
        arena = PinnedArena(ArenaConfig(**kwargs))
        made.append(arena)
        return arena

    yield make
    for a in made:
        a.close()


@pytest.fixture
def manual_event():
    """The :class:`ManualEvent` class (a CPU stand-in for a CUDA event)."""
    return ManualEvent


@pytest.fixture
def rand_bytes():
    """:func:`random_bytes`."""
    return random_bytes


@pytest.fixture
def mem_counters():
    """:func:`kernel_memory_counters`."""
    return kernel_memory_counters


@pytest.fixture
def copy_gbps():
    """:func:`copy_bandwidth_gbps`."""
    return copy_bandwidth_gbps
