"""Self-explaining out-of-memory rows: who allocated the CUDA memory that was live when a worker ran out.

[Note: allocation history] With ``BENCH_CUDA_MEMORY_HISTORY`` unset (or a number) a CUDA worker records
the Python stack of every allocation from its start through setup and the warm-up steps
(``torch.cuda.memory._record_memory_history``, Python frames only); the timed steps run without it, so
step times are not affected. On an out-of-memory error, ``torch.cuda.memory._snapshot()`` gives every
live block with its creating frames, and :func:`summarize` folds them into a few lines for the row's
``detail_extra``: the biggest allocation sites by live bytes. ``BENCH_CUDA_MEMORY_HISTORY=0`` turns it off;
a number sets ``max_entries`` of the trace ring (default 20000).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable
from typing import Any

import torch

log = logging.getLogger(__name__)

ENV = "BENCH_CUDA_MEMORY_HISTORY"
DEFAULT_MAX_ENTRIES = 20_000
GiB = float(1 << 30)
MiB = float(1 << 20)

#: frames from these folders are plumbing, not the code that asked for the memory
_PLUMBING = (f"{os.sep}torch{os.sep}", f"{os.sep}contextlib.py", f"{os.sep}functools.py")


def history_entries(env: dict[str, str] | None = None) -> int:
    """``max_entries`` for the allocation history, 0 when it is turned off (``BENCH_CUDA_MEMORY_HISTORY``)."""
    raw = (os.environ if env is None else env).get(ENV, "").strip()
    if raw == "":
        return DEFAULT_MAX_ENTRIES
    try:
        n = int(raw)
    except ValueError:
        raise ValueError(
            f"{ENV}={raw!r} is invalid; accepted: 0 (off) or a positive max_entries. Fix: e.g. {ENV}=20000"
        ) from None
    if n < 0:
        raise ValueError(f"{ENV}={raw!r} is invalid; accepted: 0 (off) or a positive max_entries")
    return n


def start(device: torch.device, max_entries: int) -> bool:
    """Record allocation stacks on ``device`` (Python frames only: cheap); False when off or unsupported."""
    if device.type != "cuda" or max_entries <= 0:
        return False
    try:
        torch.cuda.memory._record_memory_history(
            enabled="all", context="alloc", stacks="python", max_entries=max_entries, device=device
        )
    except (AttributeError, RuntimeError, TypeError) as exc:  # older torch or a build without the recorder
        log.warning("CUDA allocation history unavailable (%s); OOM rows will have no allocation sites", exc)
        return False
    return True


def stop(device: torch.device) -> None:
    """Stop recording (the history of live blocks is dropped; later allocations carry no frames)."""
    with contextlib.suppress(AttributeError, RuntimeError, TypeError):  # recording never started there
        torch.cuda.memory._record_memory_history(enabled=None, device=device)


def _site(frames: Iterable[dict[str, Any]], depth: int) -> str:
    """The first ``depth`` frames outside torch, innermost first, as ``file.py:line fn < ...``."""
    out = []
    for f in frames:
        name = str(f.get("filename", "?"))
        if any(p in name for p in _PLUMBING) or name.startswith("<"):
            continue
        short = os.sep.join(name.split(os.sep)[-2:])
        out.append(f"{short}:{f.get('line', '?')} {f.get('name', '?')}")
        if len(out) == depth:
            break
    return " < ".join(out) if out else "(no Python frame recorded)"


def _size(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / MiB:.1f} MiB"


def summarize(snapshot: dict[str, Any], top: int = 10, depth: int = 3) -> list[str]:
    """The live allocations of a memory snapshot, grouped by creating site, biggest first.

    Args:
        snapshot: ``torch.cuda.memory._snapshot()`` (its ``segments`` and their ``blocks``).
        top: sites listed.
        depth: frames per site (innermost first, torch's own frames skipped).

    Returns:
        A first line with the live total, then one line per site:
        ``"<size> in <n> x (largest <size>): <site>"`` (sizes in GiB from 1 GiB, else MiB).
    """
    sites: dict[str, list[int]] = {}
    total = count = 0
    for seg in snapshot.get("segments", []):
        for blk in seg.get("blocks", []):
            if blk.get("state") != "active_allocated":
                continue
            size = int(blk.get("requested_size") or blk.get("size") or 0)
            total += size
            count += 1
            sites.setdefault(_site(blk.get("frames") or [], depth), []).append(size)
    lines = [f"live at OOM: {_size(total)} in {count} blocks, {len(sites)} allocation sites"]
    ranked = sorted(sites.items(), key=lambda kv: sum(kv[1]), reverse=True)[:top]
    for site, sizes in ranked:
        lines.append(f"{_size(sum(sizes))} in {len(sizes)} x (largest {_size(max(sizes))}): {site}")
    return lines


def reserved_by_pool(snapshot: dict[str, Any]) -> str:
    """Where the reserved memory of a snapshot sits: the allocator's shared pool and CUDA graphs' private
    pools, each with its live bytes and its largest free block (an allocation bigger than every free
    block needs new device memory, even when the free bytes add up to more).

    Returns:
        One line: ``"reserved: <size> in the shared pool (<size> live, largest free block <size>); ..."``.
    """
    pools: dict[str, list[int]] = {}  # name -> [reserved, live, largest free]
    for seg in snapshot.get("segments", []):
        pool_id = tuple(seg.get("segment_pool_id") or (0, 0))
        name = "the shared pool" if pool_id == (0, 0) else "CUDA graph pools"
        acc = pools.setdefault(name, [0, 0, 0])
        acc[0] += int(seg.get("total_size") or 0)
        for blk in seg.get("blocks", []):
            size = int(blk.get("size") or 0)
            if blk.get("state") == "active_allocated":
                acc[1] += size
            elif blk.get("state") == "inactive":
                acc[2] = max(acc[2], size)
    parts = [
        f"{_size(r)} in {name} ({_size(live)} live, largest free block {_size(free)})"
        for name, (r, live, free) in sorted(pools.items(), key=lambda kv: -kv[1][0])
    ]
    return "reserved: " + ("; ".join(parts) if parts else "nothing")


def oom_report(device: torch.device, top: int = 10) -> list[str]:
    """:func:`summarize` of the live CUDA memory now, then :func:`reserved_by_pool` (call it while the
    failed frames are still alive)."""
    if device.type != "cuda":
        return []
    try:
        snap = torch.cuda.memory._snapshot(device)
    except (AttributeError, RuntimeError, TypeError) as exc:
        return [f"no memory snapshot: {type(exc).__name__}: {exc}"]
    return [*summarize(snap, top=top), reserved_by_pool(snap)]
