"""Micro benchmarks of tidal-arena against torch's own host allocations.

- alloc/free latency: ``PinnedArena.alloc`` + ``free`` vs ``torch.empty`` (pageable on the CPU; on CUDA
  also page-locked arena blocks vs ``torch.empty(..., pin_memory=True)``);
- H2D / D2H bandwidth (GB/s in ``extra_info``) from arena blocks vs ``torch.empty(..., pin_memory=True)``.

Every CUDA timing synchronizes inside the timed function, so the clock sees the copy finish. Cases that
need CUDA skip cleanly without it. Run: ``pytest benchmarks/arena --benchmark-only``.
"""

from __future__ import annotations

import pytest
import torch

from tidal_arena import ArenaConfig, PinnedArena

MiB = 1 << 20
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _random_bytes(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)  # never time on zeros


@pytest.fixture
def arena_factory():
    made: list[PinnedArena] = []

    def make(backend: str, slab_bytes: int) -> PinnedArena:
        arena = PinnedArena(ArenaConfig(backend=backend, slab_bytes=slab_bytes))  # type: ignore[arg-type]
        made.append(arena)
        return arena

    yield make
    for a in made:
        a.close()


# -- alloc / free latency ------------------------------------------------------------------------------
@pytest.mark.parametrize("nbytes", [4096, 1 * MiB])
def test_alloc_free_arena_pageable(benchmark, arena_factory, nbytes):
    arena = arena_factory("pageable", 64 * MiB)
    keep = [arena.alloc(nbytes) for _ in range(64)]  # a populated free list, not an empty arena
    for b in keep[::2]:
        b.free()

    def op() -> None:
        arena.alloc(nbytes, tag="bench").free()

    benchmark.group = f"alloc+free {nbytes} B (cpu)"
    benchmark(op)


@pytest.mark.parametrize("nbytes", [4096, 1 * MiB])
def test_alloc_free_torch_empty(benchmark, nbytes):
    benchmark.group = f"alloc+free {nbytes} B (cpu)"
    benchmark(lambda: torch.empty(nbytes, dtype=torch.uint8))


@requires_cuda
@pytest.mark.parametrize("nbytes", [4096, 1 * MiB, 64 * MiB])
def test_alloc_free_arena_pinned(benchmark, arena_factory, nbytes):
    arena = arena_factory("cupy", 256 * MiB)

    def op() -> None:
        arena.alloc(nbytes, tag="bench").free()

    benchmark.group = f"alloc+free {nbytes} B (pinned)"
    benchmark(op)


@requires_cuda
@pytest.mark.parametrize("nbytes", [4096, 1 * MiB, 64 * MiB])
def test_alloc_free_torch_pin_memory(benchmark, nbytes):
    benchmark.group = f"alloc+free {nbytes} B (pinned)"
    benchmark(lambda: torch.empty(nbytes, dtype=torch.uint8, pin_memory=True))


# -- H2D / D2H bandwidth ---------------------------------------------------------------------------------
def _host_buffer(source: str, n: int, arena_factory) -> torch.Tensor:
    if source == "arena":
        return arena_factory("cupy", n).alloc(n, tag="bench").tensor(torch.uint8)  # [n] page-locked
    return torch.empty(n, dtype=torch.uint8, pin_memory=True)  # [n] torch's pinned pool


@requires_cuda
@pytest.mark.parametrize("direction", ["h2d", "d2h"])
@pytest.mark.parametrize("mib", [64, 256])
@pytest.mark.parametrize("source", ["arena", "torch_pin_memory"])
def test_copy_bandwidth(benchmark, arena_factory, source, mib, direction):
    n = mib * MiB
    host = _host_buffer(source, n, arena_factory)
    assert host.is_pinned()
    host.copy_(_random_bytes(n, mib))
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    src, dst = (host, dev) if direction == "h2d" else (dev, host)
    if direction == "d2h":
        dev.copy_(host)
        dev.add_(1)  # the data coming back differs from what the host holds
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()  # why: the warm-up copy must land before it is checked
    assert torch.equal(host[:4096], dev[:4096].cpu()), "check the copy before timing it"

    def op() -> None:
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()  # why: the timer must see the copy complete

    benchmark.group = f"{direction} {mib} MiB"
    benchmark.pedantic(op, rounds=20, warmup_rounds=3, iterations=1)
    if benchmark.stats is None:  # --benchmark-disable: ran once, nothing timed
        return
    gbs = n / benchmark.stats.stats.median / 1e9
    benchmark.extra_info["GB/s"] = round(gbs, 2)
    print(f"\n{source} {direction} {mib} MiB: {gbs:.1f} GB/s (median of 20)")
