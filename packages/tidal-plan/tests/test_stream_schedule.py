"""The block-by-block replay of a step with streamed blocks, on cases whose seconds follow by hand."""

import pytest

from tidal_plan.stream_schedule import held_blocks, spread_streamed, streamed_ahead, streamed_step_s

N = 6


def _step(fwd, bwd, refill, *, turn=0.5, depth=1, window=2, frozen=None, hold=True):
    frozen = [True] * len(fwd) if frozen is None else frozen
    return streamed_step_s(fwd, bwd, turn, refill, depth, window, frozen, hold)


def test_resident_blocks_add_up_their_compute():
    fwd, bwd = [1.0 + i for i in range(N)], [2.0 + i for i in range(N)]
    assert _step(fwd, bwd, [None] * N) == pytest.approx(sum(fwd) + 0.5 + sum(bwd))


@pytest.mark.parametrize("window", [1, 2, 3])
def test_a_link_bound_step_takes_every_refill_but_the_held_ones(window):
    """No compute: the step is the link's time for 2 refills a block, less one window at each turn."""
    zero = [0.0] * N
    assert _step(zero, zero, [1.0] * N, turn=0.0, window=window, hold=False) == pytest.approx(2 * N)
    held = _step(zero, zero, [1.0] * N, turn=0.0, window=window)
    assert held == pytest.approx(2 * (N - window))


def test_compute_bound_step_exposes_only_the_refills_at_the_turns():
    """Each block computes longer than its refill: without holds the first block of the forward and the
    first of the backward wait for their refill, nothing else; with holds nothing waits."""
    fwd, bwd, refill = [3.0] * N, [5.0] * N, [2.0] * N
    compute = sum(fwd) + 0.5 + sum(bwd)
    assert _step(fwd, bwd, refill, hold=False) == pytest.approx(compute + 2 * 2.0)
    assert _step(fwd, bwd, refill) == pytest.approx(compute)


def test_trained_blocks_are_not_held_for_the_next_forward():
    """The first block trains (its host copy is updated at the step): it is refilled at the forward's start."""
    fwd, bwd, refill = [3.0] * N, [5.0] * N, [2.0] * N
    frozen = [False] + [True] * (N - 1)
    assert held_blocks(range(N), 2, frozen) == ([4, 5], [1])
    compute = sum(fwd) + 0.5 + sum(bwd)
    assert _step(fwd, bwd, refill, frozen=frozen) == pytest.approx(compute + 2.0)


def test_resident_blocks_before_the_streamed_ones_hide_their_first_refill():
    """Blocks 0-2 resident, 3-5 streamed, one refill as long as one resident forward: block 3's refill is
    issued at block 2 (depth 1) and lands as block 2 ends; holds keep 4-5 for the backward and 3-4 for the
    next forward, so only block 5's refill in forward and block 3's in backward are left."""
    fwd, bwd = [1.0] * N, [1.0] * N
    refill = [None, None, None, 1.0, 1.0, 1.0]
    compute = sum(fwd) + 0.5 + sum(bwd)
    step = _step(fwd, bwd, refill)
    assert step == pytest.approx(compute)  # each refill lands while the block before it computes
    assert _step(fwd, bwd, [r and 4.0 for r in refill]) > compute + 4.0  # a refill longer than that waits


def test_prefetch_looks_past_resident_blocks_to_the_next_streamed_ones():
    streamed = [False, True, False, False, True, True, False]
    assert streamed_ahead(streamed, 0, 2, 1) == [1, 4]
    assert streamed_ahead(streamed, 1, 1, 1) == [4]
    assert streamed_ahead(streamed, 6, 2, -1) == [5, 4]
    assert streamed_ahead(streamed, 3, 3, -1) == [1]
    assert streamed_ahead(streamed, 5, 2, 1) == [] and streamed_ahead(streamed, 2, 0, 1) == []


def test_spread_takes_evenly_spaced_blocks_among_the_candidates():
    assert spread_streamed(range(12), 4, 12) == [1, 4, 7, 10]
    assert spread_streamed(range(12), 6, 12) == [0, 2, 4, 6, 8, 10]  # ties go to the earlier block
    # candidates from block 6 up: spread from there to the end of the stack
    assert spread_streamed(range(6, 12), 3, 12) == [6, 8, 10]
    assert spread_streamed([2, 3, 4, 9, 11], 3, 12) == [3, 4, 9]  # nearest to 3.7, 7 (a tie) and 10.3
    assert spread_streamed([3, 5], 4, 12) == [3, 5] and spread_streamed(range(4), 0, 4) == []


def test_streamed_blocks_spread_between_resident_ones_hide_the_resident_compute():
    """A link-bound step (lora14b exact at 512 tokens: a refill ~7x a block's forward): 20 of 48 blocks
    streamed as the last 20, the link waits while the 28 resident blocks run forward and backward; spread,
    each refill runs while the resident blocks before it compute: the spread saves more than 85 % of the
    resident compute, and exceeds the link's time for the refills (two per block, less the four held over
    the turns) by less than the turn and 20 ms."""
    n, streamed = 48, 20
    fwd, bwd, refill_s = [0.0013] * n, [0.0035] * n, 0.0101
    tail = [refill_s if i >= n - streamed else None for i in range(n)]
    spread = set(spread_streamed(range(n), streamed, n))
    even = [refill_s if i in spread else None for i in range(n)]
    link_s = (2 * streamed - 4) * refill_s
    t_tail = _step(fwd, bwd, tail, turn=0.015, depth=2, window=2)
    t_even = _step(fwd, bwd, even, turn=0.015, depth=2, window=2)
    resident_s = 28 * (0.0013 + 0.0035)
    assert t_tail > link_s + 0.9 * resident_s  # the resident compute adds to the link time
    assert t_tail - t_even > 0.85 * resident_s
    assert link_s <= t_even < link_s + 0.015 + 0.020
