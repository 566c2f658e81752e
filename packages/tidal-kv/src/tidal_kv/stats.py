"""Counters of a :class:`~tidal_kv.PagedKVCache`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class KVStats:
    """Counters of a :class:`PagedKVCache` since construction (``reset`` keeps them)."""

    h2d_bytes: int = 0
    """Bytes copied host -> device (page gathers)."""
    d2h_bytes: int = 0
    """Bytes copied device -> host (filled pages)."""
    pages_flushed: int = 0
    """Pages written to the host (one D2H copy per filled page)."""
    pages_gathered: int = 0
    """Pages copied back to the device."""
    pages_reused: int = 0
    """Pages an offloaded layer found already in its slot (no copy needed)."""
    prefetched: int = 0
    """Offloaded-layer updates whose page copy was issued ahead, while earlier layers computed."""
    gathered_on_demand: int = 0
    """Offloaded-layer updates that had to copy pages in when they arrived (no prefetch in flight)."""
    inspections: int = 0
    """Calls of the slow ``gather`` copy path (e.g. legacy ``cache[i]`` indexing); 0 in a decode loop."""
    reallocations: int = 0
    """Device reallocations because a sequence outgrew the capacity (or the shapes changed after reset)."""
    gather_stream_switches: int = 0
    """Times ``gather_stream="auto"`` moved gathers between the side and the compute stream."""
    inline_gathers: int = 0
    """Gathers issued on the compute stream (see :mod:`tidal_kv.policy`)."""
    events: list[str] = field(default_factory=list)
    """Decisions and degradations, in order (placement, growth, fallbacks)."""
