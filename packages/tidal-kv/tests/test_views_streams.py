"""TokenRange views, the cached current-stream lookup, and the slot placement helpers."""

from __future__ import annotations

import pytest
import torch

from tidal_kv.slots import Slot, pick_slot, prefetch_order
from tidal_kv.stats import KVStats
from tidal_kv.streams import CurrentStream, wait
from tidal_kv.views import TokenRange
from tidal_testing import devices


@pytest.mark.parametrize("device", devices())
def test_token_range_is_the_slice_view_of_buffers_and_their_unbound_parts(device):
    kv = torch.randn(2, 3, 4, 10, 8, device=device)  # [2, B, H, T, D]
    cases = [(kv, lambda s, e: kv[:, :, :, s:e]), (kv[1], lambda s, e: kv[1][:, :, s:e])]
    for buf, sliced in cases:  # kv[1] starts at a storage offset
        at = TokenRange(buf)
        for start, length in [(0, 10), (3, 1), (9, 1), (0, 0), (4, 5)]:
            view = at(start, length)
            ref = sliced(start, start + length)
            assert view.shape == ref.shape and view.stride() == ref.stride()
            assert view.data_ptr() == ref.data_ptr() or length == 0
            assert torch.equal(view, ref)
    before = kv.clone()
    TokenRange(kv[0])(2, 3).copy_(torch.zeros(3, 4, 3, 8, device=device))  # writes land in the buffer
    assert not kv[0][:, :, 2:5].any()
    before[0][:, :, 2:5] = 0
    assert torch.equal(kv, before)  # and nowhere else


def test_prefetch_order_is_the_next_offloaded_layers_cyclically():
    off = [1, 3, 5, 7]
    assert prefetch_order(0, off, 2) == (1,)  # one slot is left to cool (the last one attention read)
    assert prefetch_order(1, off, 2) == (3,)  # an offloaded layer's own slot stays in use
    assert prefetch_order(7, off, 3) == (1, 3)  # after the last one: the next step's first
    assert prefetch_order(4, [5], 2) == (5,)  # never more than the offloaded layers


def test_pick_slot_prefers_the_owner_then_a_free_slot_then_takes_back_the_oldest_prefetch():
    slots = [Slot(torch.zeros(2, 1, 1, 8, 2)) for _ in range(2)]
    stats = KVStats()
    a = pick_slot(slots, {}, None, layer=3, stats=stats)
    a.pages = 2
    assert pick_slot(slots, {}, None, layer=3, stats=stats) is a and stats.pages_reused == 2
    b = pick_slot(slots, {}, a, layer=5, stats=stats)  # `a` is in use by attention
    assert b is not a and b.owner == 5 and b.pages == 0
    pending = {5: b}
    c = pick_slot(slots, pending, a, layer=7, stats=stats)  # nothing free: layer 5's prefetch is taken back
    assert c is b and pending == {} and c.owner == 7


@pytest.mark.gpu
def test_current_stream_follows_stream_contexts_and_reuses_its_object():
    current = CurrentStream(torch.device("cuda", torch.cuda.current_device()))
    first = current()
    assert first == torch.cuda.current_stream() and current() is first  # same stream: same object
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        assert current() == side
    assert current() == torch.cuda.current_stream()


class _Stream:
    def __init__(self) -> None:
        self.waited: list[object] = []

    def wait_event(self, event: object) -> None:
        self.waited.append(event)


class _Event:
    def __init__(self, done: bool) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


def test_wait_inserts_a_wait_only_for_an_event_still_pending():
    stream, pending, finished = _Stream(), _Event(False), _Event(True)
    wait(stream, finished)  # a completed event orders nothing: no wait is inserted
    wait(stream, None)
    wait(None, pending)  # the CPU: no streams
    assert stream.waited == []
    wait(stream, pending)
    assert stream.waited == [pending]


@pytest.mark.gpu
def test_wait_orders_work_behind_an_unfinished_event_and_skips_a_finished_one():
    side, compute = torch.cuda.Stream(), torch.cuda.current_stream()
    x = torch.zeros(1 << 20, device="cuda")
    compute.synchronize()
    with torch.cuda.stream(side):
        torch.cuda._sleep(50_000_000)  # why: keep the side stream busy so the event is still pending
        x.fill_(1.0)
        ev = torch.cuda.Event()
        ev.record(side)
    assert not ev.query()
    wait(compute, ev)  # pending: the compute stream must wait for the fill
    assert bool((x.clone() == 1.0).all())
    ev.synchronize()
    wait(compute, ev)  # finished: nothing to wait for
    assert bool((x == 1.0).all())
