"""The block-by-block replay of a step with streamed blocks, on cases whose seconds follow by hand."""

import pytest

from tidal_plan.stream_schedule import held_blocks, streamed_step_s

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
