"""`ArenaStats`: a snapshot of one arena's accounting, and byte formatting for messages."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


def fmt_bytes(n: int) -> str:
    """``"1.50 GiB (1610612736 B)"``: a readable size that keeps the exact byte count."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if abs(n) >= 1 << shift:
            return f"{n / (1 << shift):.2f} {unit} ({n} B)"
    return f"{n} B"


@dataclass(frozen=True)
class ArenaStats:
    """A snapshot of one arena's accounting. All sizes in bytes.

    Attributes:
        backend: ``"cupy"`` (page-locked) or ``"pageable"``.
        pinned: whether the slabs are page-locked.
        reserved_bytes: bytes held in slabs (what is page-locked on the CuPy backend).
        used_bytes: bytes of live blocks (each rounded up to the alignment).
        free_bytes: bytes ready to be handed out.
        pending_bytes: freed bytes still waiting for their copy's event.
        largest_free_block: the largest allocation that succeeds without growing.
        fragmentation: ``1 - largest_free_block / free_bytes`` (0 when nothing is free).
        cap_bytes: the current cap on ``reserved_bytes``.
        slabs: number of slabs.
        blocks: number of live blocks (fallback blocks included).
        peak_used_bytes: the largest ``used_bytes`` seen.
        fallbacks: allocations served from pageable memory because the cap was reached.
        fallback_bytes: bytes of live fallback blocks.
        page_lock_calls: ``cudaHostAlloc`` calls made (one per slab).
        page_lock_seconds: seconds spent in those calls.
        by_tag: bytes of live blocks per tag.
        degraded_reason: why ``backend="auto"`` runs on pageable memory ("" when it does not).
    """

    backend: str
    pinned: bool
    reserved_bytes: int
    used_bytes: int
    free_bytes: int
    pending_bytes: int
    largest_free_block: int
    fragmentation: float
    cap_bytes: int
    slabs: int
    blocks: int
    peak_used_bytes: int
    fallbacks: int
    fallback_bytes: int
    page_lock_calls: int
    page_lock_seconds: float
    by_tag: dict[str, int] = field(default_factory=dict)
    degraded_reason: str = ""

    def as_dict(self) -> dict[str, Any]:
        """The snapshot as a plain dict (``by_tag`` copied)."""
        return asdict(self)
