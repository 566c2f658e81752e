"""Host memory backends: page-locked slabs through CuPy's CUDA runtime, or pageable torch memory.

[Note: lifetime] A page-locked slab is exposed to torch as one ``uint8`` tensor built by
``torch.frombuffer`` over a ctypes array at the slab's address. The ctypes array owns a
:class:`_HostAllocation` whose finalizer calls ``freeHost``; torch keeps the buffer object alive while any
tensor view of the slab lives. So closing an arena never leaves a dangling view: the memory is returned
when the arena *and* every view of it are gone.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import logging
import threading
import time
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch

from tidal_arena.errors import PageLockLimitError

logger = logging.getLogger(__name__)

#: cudaHostAllocPortable / cudaHostRegisterPortable: pinned for every CUDA context, not just the current one.
PORTABLE = 1

_LOGGED: set[str] = set()
_LOG_LOCK = threading.Lock()


def log_once(key: str, msg: str, *args: object, level: int = logging.INFO) -> None:
    """Log ``msg`` at most once per process for ``key`` (degradations are logged once, then counted)."""
    with _LOG_LOCK:
        if key in _LOGGED:
            return
        _LOGGED.add(key)
    logger.log(level, msg, *args)


def cupy_runtime() -> tuple[ModuleType | None, str]:
    """``(cupy.cuda.runtime, "")`` when CUDA and CuPy are usable, else ``(None, why)``. Imports CuPy lazily."""
    if not torch.cuda.is_available():
        return None, "torch sees no CUDA device"
    try:
        cupy = importlib.import_module("cupy")
    except Exception as exc:  # ImportError, or CuPy failing to load its CUDA libraries
        return (
            None,
            f"CuPy is not importable ({type(exc).__name__}: {exc}); install tidal-arena[cuda12|cuda13]",
        )
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None, "CuPy sees no CUDA device"
    except Exception as exc:
        return None, f"CuPy cannot query devices ({type(exc).__name__}: {exc})"
    # torch's is_pinned() answers False for every pointer until torch itself has initialised CUDA, so
    # memory page-locked by CuPy would look pageable to torch (and to non_blocking copies' bookkeeping)
    torch.cuda.init()
    return cupy.cuda.runtime, ""


class _HostAllocation:
    """Owns one ``cudaHostAlloc`` region; frees it when the last reference (arena or tensor view) is gone."""

    def __init__(self, runtime: ModuleType, ptr: int, nbytes: int) -> None:
        self.runtime = runtime
        self.ptr = ptr
        self.nbytes = nbytes

    def __del__(self) -> None:
        # at interpreter shutdown or with a torn-down CUDA context there is nothing left to free into
        with contextlib.suppress(Exception):
            self.runtime.freeHost(self.ptr)


@dataclass
class Slab:
    """One contiguous host region. ``tensor`` is a ``uint8`` view of exactly ``nbytes`` usable bytes."""

    tensor: torch.Tensor  # [nbytes] uint8, data_ptr aligned to the arena's alignment
    nbytes: int
    pinned: bool
    lock_seconds: float = 0.0


def alloc_pinned_slab(runtime: ModuleType, nbytes: int, device: int | None) -> Slab:
    """Page-lock exactly ``nbytes`` through ``cudaHostAlloc`` (no power-of-two rounding).

    Raises:
        PageLockLimitError: the driver refused (out of page-lockable memory).
    """
    t0 = time.perf_counter()
    try:
        if device is None:
            ptr = runtime.hostAlloc(nbytes, PORTABLE)
        else:
            with importlib.import_module("cupy").cuda.Device(device):
                ptr = runtime.hostAlloc(nbytes, PORTABLE)
    except Exception as exc:
        raise PageLockLimitError(
            f"cudaHostAlloc of {nbytes} bytes ({nbytes / 2**30:.2f} GiB) failed: {exc}. Fix: lower "
            "ArenaConfig.max_pinned_bytes or slab_bytes, free other pinned memory, or use "
            "on_limit='pageable' to fall back to pageable memory."
        ) from exc
    seconds = time.perf_counter() - t0
    owner = _HostAllocation(runtime, ptr, nbytes)
    arr = (ctypes.c_uint8 * nbytes).from_address(ptr)
    arr._tidal_owner = owner  # type: ignore[attr-defined]  # see [Note: lifetime]
    tensor = torch.frombuffer(arr, dtype=torch.uint8)  # [nbytes]
    return Slab(tensor=tensor, nbytes=nbytes, pinned=True, lock_seconds=seconds)


def alloc_pageable_slab(nbytes: int, alignment: int) -> Slab:
    """Ordinary host memory, over-allocated so the usable view starts on an ``alignment`` boundary."""
    raw = torch.empty(nbytes + alignment, dtype=torch.uint8)  # [nbytes + alignment]
    skip = (-raw.data_ptr()) % alignment
    return Slab(tensor=raw[skip : skip + nbytes], nbytes=nbytes, pinned=False)


class CompletedEvent:
    """An event that has already completed: what copies return on the CPU, where they are synchronous."""

    def query(self) -> bool:
        """Always True."""
        return True

    def synchronize(self) -> None:
        """Nothing to wait for."""

    def wait(self, stream: Any = None) -> None:
        """Nothing to wait for (mirrors ``torch.cuda.Event.wait``)."""


# In-place pinning counters (pin_ / unpin_), read by arena_stats(). Guarded by _PIN_LOCK.
_PIN_LOCK = threading.Lock()
_PIN = {"pin_calls": 0, "pin_noops": 0, "pinned_in_place_bytes": 0, "pin_seconds": 0.0}


def pin_counters() -> dict[str, float]:
    """A copy of the in-place pinning counters."""
    with _PIN_LOCK:
        return dict(_PIN)


def bump_pin(key: str, by: float = 1) -> None:
    """Add ``by`` to one in-place pinning counter."""
    with _PIN_LOCK:
        _PIN[key] += by


def profile_range(name: str) -> contextlib.AbstractContextManager[object]:
    """``record_function(name)`` while a profiler runs, else a free no-op (allocation is a µs-scale hot path)."""
    if torch.autograd._profiler_enabled():
        return torch.profiler.record_function(name)
    return contextlib.nullcontext()
