"""Profiled activities as intervals: what the GPU did, when it sat idle, and what the host did meanwhile.

Shared by the torch.profiler probes (``kv/overlap.py``, ``stream/full_finetune.py --profile``). Times are
microseconds, as Kineto reports them.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Ev", "annotation_ms", "gpu_idle_gaps", "kineto_events", "merged", "overlap", "total"]


@dataclass(frozen=True)
class Ev:
    """One profiled activity: on the GPU (``device``) or a host call, microseconds; ``thread``: the host
    thread that ran a host activity (0 when unknown or on the GPU)."""

    name: str
    start: float
    end: float
    device: bool
    stream: int = 0
    corr: int = 0
    thread: int = 0


def merged(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of ``intervals`` as sorted, disjoint ``(start, end)`` pairs."""
    out: list[tuple[float, float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def total(intervals: Sequence[tuple[float, float]]) -> float:
    """Summed length of disjoint intervals."""
    return sum(e - s for s, e in intervals)


def overlap(a: Sequence[tuple[float, float]], b: Sequence[tuple[float, float]]) -> float:
    """Length of the intersection of two sorted, disjoint interval lists."""
    i = j = 0
    got = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        got += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return got


def kineto_events(prof: Any) -> list[Ev]:
    """The profiler's activities as :class:`Ev` (GPU activities carry their stream as ``stream``)."""
    out = []
    for e in prof.profiler.kineto_results.events():
        device = str(e.device_type()).endswith("CUDA")
        start = e.start_ns() / 1e3
        thread = 0 if device or not hasattr(e, "start_thread_id") else int(e.start_thread_id())
        out.append(
            Ev(
                e.name(),
                start,
                start + e.duration_ns() / 1e3,
                device,
                e.device_resource_id() if device else 0,
                e.correlation_id(),
                thread,
            )
        )
    return out


def gpu_idle_gaps(events: Sequence[Ev], top: int = 8, prefix: str = "tidal::") -> list[dict[str, Any]]:
    """The ``top`` longest stretches in which the GPU ran no kernel (copies may run), longest first, each
    with the host activities named ``prefix*`` or ``cuda*Synchronize`` that overlap it and for how long
    (``{"start_ms": from the first kernel, "ms": length, "host": {name: ms}}``): what the GPU waited for."""
    kernels = merged(
        (e.start, e.end) for e in events if e.device and not e.name.startswith(("Memcpy", "Memset"))
    )
    if not kernels:
        return []
    gaps = sorted(
        ((a[1], b[0]) for a, b in itertools.pairwise(kernels) if b[0] > a[1]), key=lambda g: g[0] - g[1]
    )[:top]
    host = [e for e in events if not e.device and (e.name.startswith(prefix) or "Synchronize" in e.name)]
    out = []
    for lo, hi in gaps:
        seen: dict[str, float] = {}
        for e in host:
            ov = min(e.end, hi) - max(e.start, lo)
            if ov > 0:
                name = e.name.split("[")[0]  # "tidal::stream.fetch[12]" -> per kind, not per block
                seen[name] = seen.get(name, 0.0) + ov / 1e3
        ranked = dict(sorted(seen.items(), key=lambda kv: -kv[1])[:5])
        out.append({"start_ms": (lo - kernels[0][0]) / 1e3, "ms": (hi - lo) / 1e3, "host": ranked})
    return out


def annotation_ms(events: Sequence[Ev], prefix: str = "tidal::") -> dict[str, dict[int, float]]:
    """Host milliseconds in each ``prefix*`` annotation (per kind: ``[i]`` suffixes dropped), per thread."""
    out: dict[str, dict[int, float]] = {}
    for e in events:
        if not e.device and e.name.startswith(prefix):
            per = out.setdefault(e.name.split("[")[0], {})
            per[e.thread] = per.get(e.thread, 0.0) + (e.end - e.start) / 1e3
    return out
