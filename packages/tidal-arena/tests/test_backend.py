"""The page-locked code path, run on the CPU against a stand-in for CuPy's runtime (malloc/free).

Real page-locking is checked by the gpu-marked tests; these check the lifetime and accounting logic.
"""

import ctypes
import gc

import pytest
import torch

from tidal_arena import (
    ArenaConfig,
    ArenaError,
    PageLockLimitError,
    PinnedArena,
    _backend,
    arena_stats,
    is_registered,
    pin_,
    unpin_,
)

_libc = ctypes.CDLL(None)
_libc.malloc.restype = ctypes.c_void_p
_libc.malloc.argtypes = [ctypes.c_size_t]
_libc.free.argtypes = [ctypes.c_void_p]


class FakeRuntime:
    """Records the calls tidal-arena makes into ``cupy.cuda.runtime``; memory comes from malloc."""

    def __init__(self, fail_above: int | None = None) -> None:
        self.allocs: list[tuple[int, int, int]] = []
        self.freed: list[int] = []
        self.registered: dict[int, int] = {}
        self.fail_above = fail_above

    def hostAlloc(self, nbytes: int, flags: int) -> int:
        if self.fail_above is not None and nbytes > self.fail_above:
            raise RuntimeError("cudaErrorMemoryAllocation: out of memory")
        ptr = _libc.malloc(nbytes)
        self.allocs.append((ptr, nbytes, flags))
        return ptr

    def freeHost(self, ptr: int) -> None:
        self.freed.append(ptr)
        _libc.free(ptr)

    def hostRegister(self, ptr: int, nbytes: int, flags: int) -> None:
        if ptr in self.registered:
            raise RuntimeError("cudaErrorHostMemoryAlreadyRegistered")
        self.registered[ptr] = nbytes

    def hostUnregister(self, ptr: int) -> None:
        del self.registered[ptr]


@pytest.fixture
def fake(monkeypatch):
    import resource

    rt = FakeRuntime()
    monkeypatch.setattr(_backend, "cupy_runtime", lambda: (rt, ""))
    # this machine's own ulimit -l must not decide these tests (the memlock test sets its own)
    monkeypatch.setattr(resource, "getrlimit", lambda _k: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    return rt


def test_slabs_are_allocated_at_exact_size_and_freed_after_last_view(fake, rand_bytes):
    arena = PinnedArena(ArenaConfig(backend="cupy", slab_bytes=1 << 20, max_pinned_bytes=1 << 24))
    assert (arena.backend, arena.pinned) == ("cupy", True)
    arena.reserve(3 * (1 << 20) + 1000)
    assert [n for _, n, _ in fake.allocs] == [3 * (1 << 20) + 1024]  # exact (512-aligned), no 4 MiB
    assert all(flags == _backend.PORTABLE for _, _, flags in fake.allocs)
    blk = arena.alloc(5000, tag="x")
    view = blk.tensor(torch.uint8)
    data = rand_bytes(5000, 1)
    view.copy_(data)
    assert blk.data_ptr == fake.allocs[0][0] and blk.pinned
    arena.alloc(4 << 20)  # grows: a slab of exactly the request (above slab_bytes)
    assert [n for _, n, _ in fake.allocs][1] == 4 << 20
    s = arena.stats()
    assert (s.page_lock_calls, s.reserved_bytes) == (2, 3 * (1 << 20) + 1024 + (4 << 20))
    assert arena_stats()["pinned_reserved_bytes"] >= s.reserved_bytes
    arena.close()
    gc.collect()
    assert fake.freed == [fake.allocs[1][0]]  # the slab nobody views is returned at once
    assert torch.equal(view, data)  # the viewed slab stays valid
    del view
    gc.collect()
    assert sorted(fake.freed) == sorted(p for p, _, _ in fake.allocs)


def test_driver_refusal_is_a_page_lock_limit_error(fake):
    fake.fail_above = 1 << 20
    arena = PinnedArena(ArenaConfig(backend="cupy", slab_bytes=4 << 20, max_pinned_bytes=1 << 30))
    with pytest.raises(PageLockLimitError, match=r"cudaHostAlloc of 4194304 bytes.*failed.*Fix"):
        arena.alloc(100)
    arena.close()
    with PinnedArena(ArenaConfig(backend="cupy", slab_bytes=4 << 20, on_limit="pageable")) as spill:
        blk = spill.alloc(100)
        assert not blk.pinned and spill.stats().fallbacks == 1


def test_memlock_limit_caps_the_page_locked_backend(fake, monkeypatch):
    import resource

    monkeypatch.setattr(resource, "getrlimit", lambda _k: (1 << 20, resource.RLIM_INFINITY))
    arena = PinnedArena(ArenaConfig(backend="cupy", slab_bytes=1 << 20, max_pinned_bytes=1 << 30))
    arena.alloc(1 << 20)
    with pytest.raises(ArenaError, match=r"cap 1\.00 MiB \(1048576 B\) set by ulimit -l"):
        arena.alloc(1)
    arena.close()


def test_pin_registers_whole_storage_once_and_unpin_undoes_it(fake):
    base = arena_stats()
    x = torch.randn(64, 32)
    view = x[3:10]  # pinning a view registers the storage it lives in
    assert pin_(view) is view
    ptr = x.untyped_storage().data_ptr()
    assert fake.registered == {ptr: 64 * 32 * 4} and is_registered(x)
    pin_(x)  # already registered: no second cudaHostRegister
    after = arena_stats()
    assert after["pin_calls"] == base["pin_calls"] + 1
    assert after["pinned_in_place_bytes"] == base["pinned_in_place_bytes"] + 64 * 32 * 4
    unpin_(x)
    assert fake.registered == {} and not is_registered(x)
    assert arena_stats()["pinned_in_place_bytes"] == base["pinned_in_place_bytes"]
    with pytest.raises(ArenaError, match="was not pinned by pin_"):
        unpin_(x)


def test_cupy_backend_with_device_uses_that_device(fake, monkeypatch):
    entered = []

    class Device:
        def __init__(self, index):
            self.index = index

        def __enter__(self):
            entered.append(self.index)

        def __exit__(self, *exc):
            return False

    class Cuda:
        pass

    class Cupy:
        cuda = Cuda()

    Cupy.cuda.Device = Device
    real_import = _backend.importlib.import_module
    monkeypatch.setattr(
        _backend.importlib, "import_module", lambda name: Cupy if name == "cupy" else real_import(name)
    )
    arena = PinnedArena(ArenaConfig(backend="cupy", slab_bytes=1 << 16, device=1))
    arena.alloc(10)
    assert entered == [1]
    arena.close()
