import pytest

from tidal_arena import ArenaConfig, memlock_limit_bytes, physical_ram_bytes
from tidal_arena.config import effective_cap


@pytest.mark.parametrize(
    "kwargs, option",
    [
        ({"backend": "cuda"}, "backend"),
        ({"slab_bytes": 0}, "slab_bytes"),
        ({"slab_bytes": 1.5}, "slab_bytes"),
        ({"max_pinned_bytes": -1}, "max_pinned_bytes"),
        ({"max_pinned_bytes": "1G"}, "max_pinned_bytes"),
        ({"alignment": 100}, "alignment"),
        ({"alignment": 8}, "alignment"),
        ({"alignment": True}, "alignment"),
        ({"on_limit": "swap"}, "on_limit"),
        ({"device": -1}, "device"),
    ],
)
def test_bad_config_names_the_option(kwargs, option):
    with pytest.raises((ValueError, TypeError), match=f"ArenaConfig.{option}") as info:
        ArenaConfig(**kwargs)
    value = next(iter(kwargs.values()))
    assert repr(value) in str(info.value) or str(value) in str(info.value)


def test_unknown_mode_lists_accepted():
    with pytest.raises(ValueError, match="'error', 'pageable'"):
        ArenaConfig(on_limit="warn")
    with pytest.raises(ValueError, match="'auto', 'cupy', 'pageable'"):
        ArenaConfig(backend="cuda")


def test_config_is_frozen():
    cfg = ArenaConfig()
    with pytest.raises(AttributeError):
        cfg.slab_bytes = 1  # type: ignore[misc]


def test_default_cap_is_fraction_of_ram_and_memlock_binds_when_pinned():
    ram = physical_ram_bytes()
    cap, why = effective_cap(ArenaConfig(), pinned=False)
    assert 0 < cap < ram and "physical RAM" in why
    explicit, why2 = effective_cap(ArenaConfig(max_pinned_bytes=1 << 40), pinned=True)
    lim = memlock_limit_bytes()
    if lim is None:
        assert (explicit, why2) == (1 << 40, "max_pinned_bytes")
    else:
        assert explicit == min(lim, 1 << 40)
        assert why2 == ("ulimit -l" if lim < 1 << 40 else "max_pinned_bytes")


def test_memlock_limit_is_read_from_rlimit(monkeypatch):
    import resource

    monkeypatch.setattr(resource, "getrlimit", lambda _k: (12345 * 1024, resource.RLIM_INFINITY))
    assert memlock_limit_bytes() == 12345 * 1024
    cap, why = effective_cap(ArenaConfig(max_pinned_bytes=1 << 30), pinned=True)
    assert (cap, why) == (12345 * 1024, "ulimit -l")
    # the pageable backend locks nothing, so ulimit -l does not bind there
    assert effective_cap(ArenaConfig(max_pinned_bytes=1 << 30), pinned=False) == (1 << 30, "max_pinned_bytes")
    monkeypatch.setattr(resource, "getrlimit", lambda _k: (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    assert memlock_limit_bytes() is None
