"""Layer placement in tidal_kv.config: spreading, budgets, explicit lists."""

from __future__ import annotations

import pytest

from tidal_kv import KVCacheError, KVConfig
from tidal_kv.config import LayerBytes, place_layers, spread_offloaded


@pytest.mark.parametrize(
    ("layers", "off", "expected"),
    [
        (8, 4, [1, 3, 5, 7]),
        (32, 16, list(range(1, 32, 2))),
        (6, 4, [0, 2, 3, 5]),
        (5, 0, []),
        (3, 3, [0, 1, 2]),
    ],
)
def test_spread_offloaded(layers, off, expected):
    assert spread_offloaded(layers, off) == expected


def test_place_layers_modes():
    sizes = LayerBytes(layer=100, tail=10, staging=20)
    cfg = KVConfig(num_layers=8, max_tokens=16, resident_layers=[0, 1, 2])
    assert place_layers(cfg, None, sizes)[0] == [3, 4, 5, 6, 7]
    cfg = KVConfig(num_layers=8, max_tokens=16, resident_layers=6)
    assert place_layers(cfg, None, sizes)[0] == [2, 6]
    auto = KVConfig(num_layers=8, max_tokens=16)
    assert place_layers(auto, 800, sizes)[0] == []  # all 8 fit exactly
    # 5 resident + 2 slots + 3 tails + staging = 500 + 200 + 30 + 20 = 750
    assert place_layers(auto, 750, sizes)[0] == spread_offloaded(8, 3)
    with pytest.raises(KVCacheError, match="vram_budget=100"):
        place_layers(auto, 100, sizes)


def test_layer_bytes_total_counts_slots_only_when_offloading():
    sizes = LayerBytes(layer=100, tail=10, staging=20)
    assert sizes.total(4, 4, 2) == 400
    assert sizes.total(4, 3, 2) == 300 + 100 + 10 + 20
    assert sizes.total(4, 0, 3) == 300 + 40 + 20
    staged = LayerBytes(layer=100, tail=10, staging=20, slot_stage=30)  # quantized pages: a staging per slot
    assert staged.total(4, 4, 2) == 400
    assert staged.total(4, 3, 2) == 300 + 130 + 10 + 20
