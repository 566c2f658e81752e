"""gather_stream: the option, and the "auto" policy's decisions ([Note: gathers on the compute stream])."""

from __future__ import annotations

import pytest

from tidal_kv import KVConfig, KVConfigError, PagedKVCache
from tidal_kv import policy as policy_mod
from tidal_kv.policy import INLINE_BELOW, SIDE_ABOVE, WINDOW, GatherStreamPolicy


def test_fixed_modes_never_measure_and_auto_starts_on_the_side_stream():
    assert GatherStreamPolicy("compute").inline and not GatherStreamPolicy("compute").measuring
    assert not GatherStreamPolicy("side").inline and not GatherStreamPolicy("side").measuring
    auto = GatherStreamPolicy("auto")
    assert auto.measuring and not auto.inline


def test_auto_wants_the_compute_stream_below_one_share_and_leaves_it_above_the_other():
    p = GatherStreamPolicy("auto")
    assert not p.wants_inline(1000, 1, 1.0, False)  # the link is not measured yet: side
    p.set_link(1000, 1.0)  # 1000 bytes per second
    step = 1.0
    below, between, above = INLINE_BELOW - 0.05, (INLINE_BELOW + SIDE_ABOVE) / 2, SIDE_ABOVE + 0.05
    assert p.wants_inline(int(below * 1000), 1, step, False)
    assert not p.wants_inline(int(between * 1000), 1, step, False)  # between the two: the choice stays
    assert p.wants_inline(int(between * 1000), 1, step, True)
    assert not p.wants_inline(int(above * 1000), 1, step, True)
    assert not p.wants_inline(int(below * 1000), 2, step, False)  # batch > 1: the device is not idle


def test_auto_decides_once_per_window_on_the_median_step(monkeypatch):
    clock = iter(float(t) for t in range(1000))
    monkeypatch.setattr(policy_mod.time, "perf_counter", lambda: next(clock))  # one second per step
    p = GatherStreamPolicy("auto")
    p.set_link(1000, 1.0)
    changed = [p.step(100, 1) for _ in range(WINDOW)]  # the first call only starts the clock
    assert changed == [False] * WINDOW and not p.inline
    assert p.step(100, 1) and p.inline  # a full window of 1 s steps gathering 0.1 s: compute stream
    p.restart()  # a new sequence: the next step starts the clock again
    changed = [p.step(900, 1) for _ in range(WINDOW + 1)]
    assert changed == [False] * WINDOW + [True] and not p.inline


def test_gather_stream_option_is_checked_and_named():
    for good in ("auto", "side", "compute"):
        assert KVConfig(num_layers=2, max_tokens=8, gather_stream=good).gather_stream == good
    with pytest.raises(KVConfigError, match=r"gather_stream='h2d' is not accepted: expected one of 'auto'"):
        PagedKVCache(2, 8, gather_stream="h2d")
