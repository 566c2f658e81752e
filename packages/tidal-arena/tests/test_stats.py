import pytest

from tidal_arena import ArenaStats
from tidal_arena.stats import fmt_bytes


@pytest.mark.parametrize(
    "n, text",
    [(0, "0 B"), (1023, "1023 B"), (1536, "1.50 KiB (1536 B)"), (3 << 29, "1.50 GiB (1610612736 B)")],
)
def test_fmt_bytes_keeps_exact_count(n, text):
    assert fmt_bytes(n) == text


def test_stats_snapshot_reflects_arena(make_arena):
    arena = make_arena(slab_bytes=8192)
    arena.alloc(1000, tag="a")
    s = arena.stats()
    assert isinstance(s, ArenaStats)
    d = s.as_dict()
    assert d["by_tag"] == {"a": 1024} and d["used_bytes"] == 1024 and d["reserved_bytes"] == 8192
    d["by_tag"]["a"] = 0  # a copy: the snapshot is not changed
    assert s.by_tag == {"a": 1024}
    assert s.free_bytes + s.used_bytes == s.reserved_bytes
