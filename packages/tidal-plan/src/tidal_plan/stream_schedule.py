"""The step of a training run whose streamed blocks share one host link, replayed block by block.

A cost model that only compares totals (link seconds against compute seconds) takes every transfer as
hidden while the other side is busy. Streamed weights are not so free: a block's refill can start only
when the window has a free slot and the compute stream has reached the point where it was asked for
(the refill writes memory the blocks before it may still read), and the compute waits for it. Resident
blocks at the start of the forward and at the end of the backward leave the link idle while they run
(the window is already full with the first streamed blocks); resident blocks spread between streamed
ones hide behind their copies instead (:func:`spread_streamed`).

:func:`streamed_step_s` replays one steady-state step of ``tidal_stream.StreamedBlocks``' rules:

- forward, block ``i``: refill it if it is not resident, then prefetch the next ``depth`` streamed blocks
  after it (resident blocks between are skipped: their compute hides the copies) while fewer than
  ``window`` streamed blocks are resident; after it ran, release it;
- backward, block ``i`` (reverse order): release the streamed blocks after it, refill it if needed,
  prefetch the next ``depth`` streamed blocks before it the same way;
- a refill starts when the link is free and the compute has reached the point where it was issued;
  a block computes once its refill has landed;
- with turn holds ([Note: turn holds] in ``tidal_stream.streamed_blocks``), the last ``window`` streamed
  blocks stay from the forward for the backward, and the first ``window`` frozen ones from the backward
  for the next forward.

Two steps are replayed (holds carry over from the first); the second's seconds are returned.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["frozen_blocks", "held_blocks", "spread_streamed", "streamed_ahead", "streamed_step_s"]


def frozen_blocks(blocks: Sequence[Any]) -> list[bool]:
    """Per census block: it streams no trained weight (LoRA: the adapters stay resident, as ``wrap()``
    keeps them when they are at most half the block's bytes), so it may wait on the device for the next
    step and needs no host update before its refill."""
    return [b.trainable_bytes <= 0.5 * (b.trainable_bytes + b.frozen_bytes + b.buffer_bytes) for b in blocks]


def spread_streamed(candidates: Sequence[int], count: int, n_blocks: int) -> list[int]:
    """``count`` of ``candidates`` (block indices of a stack of ``n_blocks``) spread as evenly as they allow
    from the first candidate to the end of the stack: for each of ``count`` evenly spaced positions there,
    the nearest candidate not yet taken.

    Streamed blocks spread so are each preceded by resident blocks whose compute hides their copy, where
    a run of streamed blocks leaves the link alone on the critical path (the module docstring).
    """
    free = sorted(candidates)
    if count >= len(free):
        return free
    start = free[0] if free else 0
    chosen: list[int] = []
    for k in range(count):
        target = start + (k + 0.5) * (n_blocks - start) / count
        j = min(free, key=lambda c: (abs(c + 0.5 - target), c))
        chosen.append(j)
        free.remove(j)
    return sorted(chosen)


def streamed_ahead(streamed: Sequence[bool], i: int, depth: int, step: int) -> list[int]:
    """The next ``depth`` streamed blocks after block ``i`` in the direction ``step`` (+1 forward, -1
    backward), resident blocks between them skipped: what ``StreamedBlocks`` prefetches at block ``i``."""
    out: list[int] = []
    j = i + step
    while 0 <= j < len(streamed) and len(out) < depth:
        if streamed[j]:
            out.append(j)
        j += step
    return out


def held_blocks(streamed: Sequence[int], window: int, frozen: Sequence[bool]) -> tuple[list[int], list[int]]:
    """The blocks turn holds keep: the last ``window`` of ``streamed`` (forward to backward) and the first
    ``window`` of them that are ``frozen`` (backward to the next forward; an updated block is refilled)."""
    order = sorted(streamed)
    tail = order[-window:] if window > 0 else []
    head = [i for i in order[:window] if frozen[i]]
    return tail, head


def streamed_step_s(
    forward_s: Sequence[float],
    backward_s: Sequence[float],
    turn_s: float,
    refill_s: Sequence[float | None],
    depth: int,
    window: int,
    frozen: Sequence[bool],
    hold_turns: bool = True,
) -> float:
    """Seconds of one steady-state training step with streamed blocks (see the module docstring).

    Args:
        forward_s: forward seconds of each block.
        backward_s: backward seconds of each block (recompute included).
        turn_s: compute between the last block's forward and its backward (the head, the loss).
        refill_s: seconds the link needs to refill each block; None for a resident block.
        depth: prefetch depth (streamed blocks looked ahead, resident ones between skipped).
        window: streamed blocks resident at most (the running one and those fetched ahead).
        frozen: per block, no weight it streams is trained (it may wait for the next forward).
        hold_turns: replay turn holds.
    """
    n = len(forward_s)
    is_streamed = [r is not None for r in refill_s]
    streamed = [i for i in range(n) if is_streamed[i]]
    tail, head = held_blocks(streamed, window, frozen) if hold_turns else ([], [])
    resident: set[int] = set()
    landed: dict[int, float] = {}  # block -> when its refill lands
    link = gpu = 0.0  # when the link is free; when the compute stream reaches the end of its queue

    def refill(j: int) -> None:
        nonlocal link
        link = max(link, gpu) + refill_s[j]  # type: ignore[operator]
        landed[j] = link
        resident.add(j)

    def run(i: int, seconds: float, ahead: list[int]) -> None:
        nonlocal gpu
        if refill_s[i] is not None:
            if i not in resident:
                refill(i)
            gpu = max(gpu, landed[i])
        for j in ahead:
            if j in resident:
                continue
            if len(resident) >= window:
                break
            refill(j)
        gpu += seconds

    steps = []
    for _ in range(2):
        start = gpu
        for i in range(n):
            run(i, forward_s[i], streamed_ahead(is_streamed, i, depth, 1))
            if i not in tail:
                resident.discard(i)
        gpu += turn_s
        for i in reversed(range(n)):
            resident -= {j for j in resident if j > i and j not in head}
            run(i, backward_s[i], streamed_ahead(is_streamed, i, depth, -1))
        resident &= set(head)
        steps.append(gpu - start)
    return steps[-1]
