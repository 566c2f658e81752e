"""gather_stream: the option, and the "auto" policy's decisions ([Note: gathers on the compute stream])."""

from __future__ import annotations

import pytest
import torch

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


def test_auto_decides_once_per_window_on_the_median_step_span(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(policy_mod.time, "perf_counter", lambda: now[0])
    p = GatherStreamPolicy("auto")
    p.set_link(1000, 1.0)

    def step(nbytes: int, span: float, between: float) -> bool:
        """One decode step whose first-to-last-layer span is ``span`` s, then ``between`` s elsewhere."""
        p.begin_step()
        now[0] += span
        changed = p.end_step(nbytes, 1)
        now[0] += between
        return changed

    # 1 s spans gathering 0.1 s; 9 s between steps (other caches stepped in turn) must not count
    changed = [step(100, 1.0, 9.0) for _ in range(WINDOW)]
    assert changed == [False] * (WINDOW - 1) + [True] and p.inline
    p.restart()  # a new sequence
    # 0.6 s of link in 1 s spans: back to the side stream, although 10 s pass from step to step
    changed = [step(600, 1.0, 9.0) for _ in range(WINDOW)]
    assert changed == [False] * (WINDOW - 1) + [True] and not p.inline


def test_a_step_whose_first_layer_was_not_noted_is_not_counted(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(policy_mod.time, "perf_counter", lambda: now[0])
    p = GatherStreamPolicy("auto")
    p.set_link(1000, 1.0)
    p.begin_step()
    now[0] += 50.0
    p.restart()  # a prefill came between: the span would hold it
    assert not any(p.end_step(100, 1) for _ in range(2 * WINDOW))  # no begin: nothing to count
    assert not p.inline


def test_cache_times_from_the_first_to_the_last_layer(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(policy_mod.time, "perf_counter", lambda: now[0])
    cache = PagedKVCache(4, 64, resident_layers=2, page_tokens=4, gather_stream="auto")
    cache._timing = True  # as a CUDA cache sets it once its link is measured
    k = torch.zeros(1, 1, 5, 8)
    for layer in range(4):
        cache.update(layer, k, k)  # a prefill: the slow path, not timed
    for _ in range(3):
        for layer in range(4):
            now[0] += 1.0  # one second per layer
            cache.update(layer, k[:, :, :1], k[:, :, :1])
        now[0] += 100.0  # between steps (sampling, other caches): not part of the step
    assert cache._policy._steps == [3.0, 3.0, 3.0]  # layer 0's token to layer 3's, once per step


def test_gather_stream_option_is_checked_and_named():
    for good in ("auto", "side", "compute"):
        assert KVConfig(num_layers=2, max_tokens=8, gather_stream=good).gather_stream == good
    with pytest.raises(KVConfigError, match=r"gather_stream='h2d' is not accepted: expected one of 'auto'"):
        PagedKVCache(2, 8, gather_stream="h2d")
