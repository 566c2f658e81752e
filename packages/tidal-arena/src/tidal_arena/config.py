"""`ArenaConfig` and the page-lock budget (the cap, physical RAM, ``ulimit -l``)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

MiB = 1 << 20
GiB = 1 << 30

#: Default cap on an arena's reserved bytes, as a fraction of physical RAM.
DEFAULT_RAM_FRACTION = 0.7

BACKENDS = ("auto", "cupy", "pageable")
ON_LIMIT = ("error", "pageable")


def _check_int(name: str, value: object, minimum: int, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"ArenaConfig.{name}: expected an int, got {type(value).__name__} {value!r}. {fix}")
    if value < minimum:
        raise ValueError(f"ArenaConfig.{name}: must be >= {minimum}, got {value}. {fix}")


@dataclass(frozen=True)
class ArenaConfig:
    """Configuration of a :class:`~tidal_arena.PinnedArena`.

    Attributes:
        backend: ``"auto"`` (CuPy page-locked memory when CUDA and CuPy are present, else pageable memory,
            logged once), ``"cupy"`` (page-locked memory; an error when CUDA or CuPy is missing) or
            ``"pageable"`` (ordinary host memory; the allocator logic is identical). Default ``"auto"``.
        slab_bytes: growth granularity: when no free block fits, the arena reserves a new slab of
            ``max(slab_bytes, request)`` bytes (within the cap). Default 256 MiB.
        max_pinned_bytes: cap on the bytes the arena reserves. ``None`` (default) means
            ``0.7 × physical RAM``; on the page-locked backend the cap never exceeds ``ulimit -l``.
        alignment: byte alignment of every block's start (a power of two ≥ 16). Default 512.
        on_limit: what an allocation beyond the cap does: ``"error"`` (default) raises
            :class:`~tidal_arena.ArenaExhausted`; ``"pageable"`` hands out pageable memory instead, with a
            one-time warning and the ``fallbacks`` stat counting it.
        device: CUDA device whose context page-locks the memory (the memory is portable: usable from every
            device). ``None`` (default) means the current device.
    """

    backend: Literal["auto", "cupy", "pageable"] = "auto"
    slab_bytes: int = 256 * MiB
    max_pinned_bytes: int | None = None
    alignment: int = 512
    on_limit: Literal["error", "pageable"] = "error"
    device: int | None = None

    def __post_init__(self) -> None:
        if self.backend not in BACKENDS:
            raise ValueError(
                f"ArenaConfig.backend: got {self.backend!r}; accepted: {', '.join(map(repr, BACKENDS))}. "
                "Use 'auto' unless you must force page-locked ('cupy') or pageable memory."
            )
        _check_int("slab_bytes", self.slab_bytes, 1, "Pass the growth granularity in bytes, e.g. 256 << 20.")
        if self.max_pinned_bytes is not None:
            _check_int(
                "max_pinned_bytes",
                self.max_pinned_bytes,
                1,
                "Pass a byte count, or None for 0.7 x physical RAM (never above ulimit -l).",
            )
        _check_int("alignment", self.alignment, 16, "Pass a power of two >= 16, e.g. 512.")
        if self.alignment & (self.alignment - 1):
            raise ValueError(
                f"ArenaConfig.alignment: must be a power of two, got {self.alignment}. "
                "Pass a power of two >= 16, e.g. 512."
            )
        if self.on_limit not in ON_LIMIT:
            raise ValueError(
                f"ArenaConfig.on_limit: got {self.on_limit!r}; accepted: {', '.join(map(repr, ON_LIMIT))}. "
                "'error' raises ArenaExhausted beyond the cap; 'pageable' falls back to pageable memory."
            )
        if self.device is not None:
            _check_int("device", self.device, 0, "Pass a CUDA device index, or None for the current device.")


def physical_ram_bytes() -> int:
    """Physical RAM in bytes, as the kernel reports it now (it can grow on some virtual machines)."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def memlock_limit_bytes() -> int | None:
    """The soft ``ulimit -l`` (RLIMIT_MEMLOCK) in bytes, or ``None`` when unlimited or unknown."""
    try:
        import resource
    except ImportError:  # pragma: no cover - non-POSIX
        return None
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if soft == resource.RLIM_INFINITY or soft < 0:
        return None
    return int(soft)


def effective_cap(config: ArenaConfig, pinned: bool) -> tuple[int, str]:
    """The arena's cap in bytes and which limit binds (for error messages).

    Args:
        config: the arena's configuration.
        pinned: whether the arena's memory is page-locked (then ``ulimit -l`` also applies).

    Returns:
        ``(cap_bytes, reason)`` where reason is e.g. ``"max_pinned_bytes"`` or ``"ulimit -l"``.
    """
    if config.max_pinned_bytes is not None:
        cap, why = config.max_pinned_bytes, "max_pinned_bytes"
    else:
        cap, why = int(DEFAULT_RAM_FRACTION * physical_ram_bytes()), "the default cap (0.7 x physical RAM)"
    if pinned:
        lim = memlock_limit_bytes()
        if lim is not None and lim < cap:
            cap, why = lim, "ulimit -l"
    return cap, why
